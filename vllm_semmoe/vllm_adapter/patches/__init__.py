"""Every patch of the host engine, in one place.

One module per patched area of vLLM; each class- or process-level patch is a
:class:`~.base.Patch` naming the :data:`..compat.INTERNALS` entry it relies on and why:

- :mod:`.engine_args`: ``EngineArgs.create_engine_config`` (validate at engine start);
- :mod:`.model_loader`: ``BaseModelLoader.create_model`` (placement before the weights load,
  the engine state);
- :mod:`.model_runner`: ``GPUModelRunner._model_forward`` / ``shutdown`` and
  ``Worker.execute_dummy_batch`` (real steps, dummy batches, the capture at shutdown; model
  runner v1 only);
- :mod:`.dp_client`: ``DPLBAsyncMPClient.get_core_engine_for_request`` /
  ``process_engine_outputs`` (Sem-MoE's DP rank choice; where mode ``dp`` is not refused);
- :mod:`.triton`: the Triton re-binding scan's ``vars`` (where vLLM has that scan);
- :mod:`.fused_moe`, :mod:`.communicator`: the CPU fixes (:mod:`..cpu_fixes`: on the CPU
  platform, for the affected vLLM versions).

:func:`install_all` (what :func:`..plugin.register` calls) installs what this vLLM needs, once;
:func:`remove_all` puts vLLM's own attributes back. Nothing here touches a process-global hook
such as ``sys.excepthook``.

What each engine changes on its own objects (its MoE layers, their routers and kernels, its TP
group's communicator) is listed in :data:`LAYER_HOOKS`, each with the internal it relies on and
the function that installs it; those go through vLLM's own extension points where it has one
(a subclass of its prepare/finalize stage, a forward pre-hook) and are replaced once per
engine, never per call.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import compat, cpu_fixes
from . import communicator, dp_client, engine_args, fused_moe, model_loader, model_runner, triton
from .base import Patch

#: every class- and process-level patch, in installation order
PATCHES: tuple[Patch, ...] = (*triton.PATCHES, *fused_moe.PATCHES, *communicator.PATCHES, *engine_args.PATCHES,
                              *model_loader.PATCHES, *model_runner.PATCHES, *dp_client.PATCHES)


def needed(version: str | None = None) -> list[Patch]:
    """The patches vLLM ``version`` (the installed one by default) gets, the CPU fixes aside
    (:func:`..cpu_fixes.apply_cpu_fixes` decides those)."""
    version = version or compat.vllm_version()
    out = list(triton.PATCHES) if triton.needed() else []
    out += [*engine_args.PATCHES, *model_loader.PATCHES]
    if compat.has_step_source(version):  # else the features that need it are refused at start
        out += model_runner.PATCHES
    if "dp" not in compat.refused_features(version):
        out += dp_client.PATCHES
    return out


def install_all(version: str | None = None) -> None:
    """Install every patch this vLLM needs (idempotent)."""
    cpu_fixes.apply_cpu_fixes(version)
    for patch in needed(version):
        patch.install()


def remove_all() -> None:
    """Put back every attribute a patch replaced (idempotent)."""
    for patch in reversed(PATCHES):
        patch.remove()


def installed() -> list[str]:
    """The names of the patches installed now."""
    return [patch.name for patch in PATCHES if patch.installed]


@dataclass(frozen=True)
class LayerHook:
    """A change the plugin makes on one engine's vLLM objects when it builds them.

    Attributes:
        internal: the :data:`..compat.INTERNALS` entry it relies on (its ``name``).
        installed_by: the function that installs it (``module:function`` under ``vllm_adapter``).
        why: one sentence.
    """

    internal: str
    installed_by: str
    why: str


_MOE_RUNNER = "vllm.model_executor.layers.fused_moe.runner.moe_runner.MoERunner"
_ROUTED = "vllm.model_executor.layers.fused_moe.routed_experts.RoutedExperts"

#: every per-engine change of vLLM objects
LAYER_HOOKS: tuple[LayerHook, ...] = (
    LayerHook(f"{_MOE_RUNNER}.forward", "ops:install_moe_op",
              "mode tp: the MoE layer runs as the opaque semmoe::moe_layer op, so the shuffle runs every step of a "
              "compiled model"),
    LayerHook(f"{_ROUTED}.forward_modular", "tp_shuffle:install_shuffled_experts",
              "mode tp: the routed-experts stage computes this rank's scheduled tokens when a step is running "
              "(installed once; it reads the step context)"),
    LayerHook(f"{_MOE_RUNNER}._forward_entry", "compat:use_opaque_moe_op",
              "capture and DP + EP dispatch: the layer calls vLLM's opaque MoE op, so per-step Python runs in "
              "compiled models"),
    LayerHook("vllm.model_executor.layers.fused_moe.modular_kernel.FusedMoEKernelModularImpl.prepare_finalize",
              "patches.prepare_finalize:install_stages",
              "DP + EP: vLLM's all-gather stage becomes its subclass with the sparse EP exchange, or with its bytes "
              "counted (chosen once, before the model's first forward)"),
    LayerHook("vllm.model_executor.layers.fused_moe.router.base_router.BaseRouter._apply_eplb_mapping",
              "replacement:install_placement", "placement: logical expert ids become physical slots after top-k"),
    LayerHook("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method.UnquantizedFusedMoEMethod."
              "create_weights", "replacement:install_placement",
              "placement: each expert-indexed parameter's weight loader loads logical expert e into its slots"),
    LayerHook("vllm.distributed.device_communicators.base_device_communicator.DeviceCommunicatorBase.all_reduce",
              "ep_dispatch:CollectiveMeter", "mode tp with a capture: the TP group's collectives are counted"),
)
