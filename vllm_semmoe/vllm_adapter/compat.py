"""Every vLLM internal the adapter reaches, in one place, per vLLM version (0.32.x-0.34.x).

:data:`INTERNALS` lists them: where each lives, what kind of thing it is, which surface of vLLM
it belongs to (:data:`SURFACES`), the call signature the adapter relies on, what needs it, the
vLLM versions that need it, and, for model-runner / worker members, why no public surface
serves. :data:`REFUSED_FEATURES` names, per version, the features the plugin refuses at engine
start there and why. Three things read these:

- :func:`check_vllm` at plugin start-up (live: import, ``getattr``, ``inspect.signature``);
- ``semmoe doctor`` (:mod:`.doctor`), which checks an installed vLLM or a vLLM *source* (an
  unpacked tree or a wheel read as a zip) by parsing it with :mod:`ast`, without importing it;
- the accessors below, the only code in the adapter that touches these names.

Per-version differences are kept here and nowhere else (see :func:`internals_for`,
:func:`refused_features`, :func:`dp_queue_scores`). Model-structure attributes of the decoder
layers the TP shuffle fuses (``input_layernorm``, ``self_attn.o_proj``,
``post_attention_layernorm``, ``mlp.experts``) belong to the model architecture, not to vLLM's
internals; the shuffle checks them per layer when it installs.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from dataclasses import dataclass

#: vLLM (major, minor) versions this adapter supports (some features refused per version:
#: :data:`REFUSED_FEATURES`)
SUPPORTED_VERSIONS = ((0, 32), (0, 33), (0, 34))

#: the versions whose GPU model runner is ``vllm/v1/worker/gpu_model_runner.py`` (model runner
#: v1), the step source of the capture, the TP shuffle and the MoE counters
RUNNER_V1 = ((0, 32), (0, 33))

#: the surfaces of vLLM the internals belong to, from the sturdiest to the most private
SURFACES = ("engine config", "model layer", "communicator", "engine client", "runner/worker", "process fix")

_STEP_SOURCE_V2 = (
    "vLLM {version} replaced the GPU model runner (model runner v2, vllm/v1/worker/gpu/model_runner.py): "
    "it runs the model inline in execute_model and keeps the step's batch (request ids, prompt lengths, token "
    "bounds) local to it, so the plugin has no per-step source there yet")

#: version -> feature -> why the plugin refuses it at engine start on that version. Features:
#: ``capture`` (the routing capture), ``tp`` / ``dp`` (the serving modes), ``dispatch`` (the
#: sparse or metered DP + EP dispatch and its MoE counters)
REFUSED_FEATURES: dict[tuple[int, int], dict[str, str]] = {
    (0, 34): {
        "capture": _STEP_SOURCE_V2 + " (a capture records every real step's requests and tokens)",
        "tp": _STEP_SOURCE_V2 + " (the TP shuffle schedules each step from its tokens)",
        "dp": _STEP_SOURCE_V2 + " (mode dp meters every step's routing)",
        "dispatch": _STEP_SOURCE_V2 + " (the dispatch's MoE counters count real steps only)",
    },
}

#: version -> the reason of its refusals in a few words (``semmoe doctor --one-line``)
REFUSED_SUMMARY: dict[tuple[int, int], str] = {(0, 34): "model runner v2: no per-step source yet"}

#: ``needed_by`` group -> the features that use it (``all`` and ``cpu``: always needed)
_GROUP_FEATURES = {"capture": ("capture", "tp", "dp", "dispatch"), "tp": ("tp",), "dp": ("dp", "dispatch")}

_MOE_RUNNER = "vllm.model_executor.layers.fused_moe.runner.moe_runner"
_RUNNER = "vllm.v1.worker.gpu_model_runner"
_CORE_CLIENT = "vllm.v1.engine.core_client"
_PARALLEL = "vllm.distributed.parallel_state"
_BASE_ROUTER = "vllm.model_executor.layers.fused_moe.router.base_router"
_ROUTED = "vllm.model_executor.layers.fused_moe.routed_experts"
_DEVICE_COMM = "vllm.distributed.device_communicators.base_device_communicator"
_NAIVE_DP_EP = "vllm.model_executor.layers.fused_moe.prepare_finalize.naive_dp_ep"
_NO_BATCH = ("the forward context and its attention metadata carry token bounds and positions but no "
             "request ids or prompt lengths; the scheduler's output has them but not the batch order")


def _surface_of(module: str) -> str:
    if module.startswith("vllm.v1.worker"):
        return "runner/worker"
    if module.startswith("vllm.v1.engine"):
        return "engine client"
    if module.startswith(("vllm.distributed.device_communicators", _PARALLEL)):
        return "communicator"
    if module.startswith(("vllm.config", "vllm.engine.arg_utils")):
        return "engine config"
    if module.startswith("vllm.triton_utils"):
        return "process fix"
    return "model layer"  # MoE layers, routers, EPLB maps, the forward context, custom ops


@dataclass(frozen=True)
class Internal:
    """One vLLM internal.

    Attributes:
        module: dotted module name; qualname: ``Class.member`` or a module-level name.
        kind: ``function`` (a def; ``params`` are its leading parameter names, in order),
            ``attribute`` (set on instances as ``self.<name> = ...``, a class field or a
            property; ``params`` empty).
        params: the parameter names the adapter passes or receives, in order.
        needed_by: the features that use it (``all``, ``capture``, ``tp``, ``dp``, ``cpu``; several
            joined by ``", "``).
        why: what the adapter does with it.
        mentions: names the definition must mention (e.g. parameters it registers by name).
        versions: the ``(major, minor)`` versions that need it (empty: every supported version).
        surface: which surface of vLLM it belongs to (:data:`SURFACES`; derived from ``module``
            when not given).
        no_public: for a model-runner / worker member: why no public surface serves instead.
    """

    module: str
    qualname: str
    kind: str
    params: tuple[str, ...] = ()
    needed_by: str = "all"
    why: str = ""
    mentions: tuple[str, ...] = ()  # string constants the definition must contain (source check)
    versions: tuple[tuple[int, int], ...] = ()
    surface: str = ""
    no_public: str = ""

    def __post_init__(self):
        if not self.surface:
            object.__setattr__(self, "surface", _surface_of(self.module))
        assert self.surface in SURFACES, self.surface

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}"

    def needed_on(self, version: str) -> bool:
        """Whether vLLM ``version`` needs this internal (its CPU fixes only on a CPU build)."""
        if self.needed_by == "cpu" and not is_cpu_build(version):
            return False
        if self.versions and version_key(version) not in self.versions:
            return False
        refused = refused_features(version)
        return any(group not in _GROUP_FEATURES or not refused.keys() >= set(_GROUP_FEATURES[group])
                   for group in self.needed_by.split(", "))


INTERNALS: tuple[Internal, ...] = (
    # engine start: validate settings, refuse unsupported layouts
    Internal("vllm.engine.arg_utils", "EngineArgs.create_engine_config", "function", ("self",),
             why="hooked: validate the semmoe settings and layout at engine start"),
    Internal("vllm.config.compilation", "CompilationConfig.mode", "attribute",
             why="compilation mode (refuse what the plugin cannot serve)"),
    Internal("vllm.config.compilation", "CompilationConfig.cudagraph_mode", "attribute",
             why="CUDA-graph mode (refuse full graphs when hooks must run per step)"),
    Internal("vllm.config.compilation", "CompilationConfig.splitting_ops", "attribute",
             why="keep the plugin's ops outside piecewise CUDA graphs"),
    Internal("vllm.config.parallel", "ParallelConfig.pipeline_parallel_size", "attribute",
             why="refuse pipeline parallelism"),
    Internal("vllm.config.parallel", "ParallelConfig.enable_expert_parallel", "attribute",
             why="EP size"),
    Internal("vllm.config.parallel", "ParallelConfig.tensor_parallel_size", "attribute", why="layout, EP size"),
    Internal("vllm.config.parallel", "ParallelConfig.data_parallel_size", "attribute", why="layout, EP size"),
    Internal("vllm.config.parallel", "ParallelConfig.data_parallel_rank", "attribute", why="capture path per DP rank"),
    Internal("vllm.config.parallel", "ParallelConfig.prefill_context_parallel_size", "attribute",
             why="refuse context parallelism"),
    Internal("vllm.config.parallel", "ParallelConfig.decode_context_parallel_size", "attribute",
             why="refuse context parallelism"),
    Internal("vllm.config.vllm", "VllmConfig.additional_config", "attribute", why="the semmoe settings"),
    Internal("vllm.config.model", "ModelConfig.hf_text_config", "attribute", why="expert count, top-k"),
    Internal("vllm.config.model", "ModelConfig.get_vocab_size", "function", ("self",), why="capture vocabulary size"),
    Internal("vllm.config.model", "ModelConfig.enforce_eager", "attribute", why="compilation check"),
    # model build: placement, TP shuffle installation
    Internal("vllm.model_executor.model_loader.base_loader", "BaseModelLoader.create_model", "function",
             ("self", "vllm_config", "model_config", "prefix"),
             why="hooked: install the placement before weights load; create the engine state"),
    Internal(_MOE_RUNNER, "MoERunner.forward", "function", ("self", "hidden_states", "router_logits"),
             needed_by="tp", why="called eagerly inside the TP-shuffle op for padded / warm-up batches"),
    Internal(_MOE_RUNNER, "MoERunner._forward_entry", "attribute", needed_by="capture",
             why="switched to the opaque torch.ops.vllm.moe_forward so routing hooks run per step"),
    Internal(_MOE_RUNNER, "_moe_forward", "function", (), needed_by="capture", why="registered by vLLM as torch.ops.vllm.moe_forward"),
    Internal(_MOE_RUNNER, "_moe_forward_shared", "function", (), needed_by="capture", why="registered by vLLM as torch.ops.vllm.moe_forward_shared"),
    Internal(_MOE_RUNNER, "MoERunner.shared_experts", "attribute", needed_by="capture",
             why="which opaque MoE op (with or without shared experts)"),
    Internal(_MOE_RUNNER, "MoERunner._select_forward", "function", ("self",), needed_by="cpu",
             why="CPU fix: opaque MoE op under data parallelism, so compiled models gather per step"),
    Internal(_MOE_RUNNER, "MoERunner.layer_name", "attribute", why="names the MoE layer in the plugin's ops"),
    Internal(_MOE_RUNNER, "MoERunner.gate", "attribute", why="placement permutes the gate rows; TP shuffle gates its slice"),
    Internal(_MOE_RUNNER, "MoERunner.router", "attribute", why="routing capture hook; TP shuffle selects experts"),
    Internal(_MOE_RUNNER, "MoERunner.routed_experts", "attribute", why="expert weights, expert count"),
    Internal(_MOE_RUNNER, "MoERunner._quant_method", "attribute", needed_by="tp",
             why="topk_indices_dtype for select_experts"),
    Internal("vllm.model_executor.layers.fused_moe.fused_moe_method_base", "FusedMoEMethodBase.topk_indices_dtype",
             "attribute", why="dtype of the expert ids (TP shuffle, placement self-check)"),
    Internal("vllm.model_executor.layers.fused_moe.router.base_router", "BaseRouter.set_capture_fn", "function",
             ("self", "capture_fn"), needed_by="capture", why="feeds the routing recorder"),
    Internal("vllm.model_executor.layers.fused_moe.router.base_router", "BaseRouter.capture_fn", "attribute",
             why="suspended while the TP shuffle gates a slice and while the placement self-check routes"),
    Internal("vllm.model_executor.layers.fused_moe.router.fused_moe_router", "FusedMoERouter.select_experts",
             "function", ("self", "hidden_states", "router_logits"),
             why="expert choice on this rank's slice (TP shuffle); the placement self-check's routing"),
    Internal(_ROUTED, "RoutedExperts._map_global_expert_id_to_local_expert_id", "function", ("self", "expert_id"),
             why="placement self-check: the physical slots this rank holds"),
    Internal(_MOE_RUNNER, "MoERunner.moe_config", "attribute",
             why="placement self-check: hidden size of a layer without its own gate"),
    Internal("vllm.model_executor.layers.fused_moe.routed_experts", "RoutedExperts.forward_modular", "function",
             ("self", "x", "topk_weights", "topk_ids"), needed_by="tp, dp",
             why="this rank's experts on its own and received rows"),
    Internal("vllm.model_executor.layers.fused_moe.routed_experts", "RoutedExperts.global_num_experts",
             "attribute", why="expert count"),
    Internal("vllm.model_executor.layers.fused_moe.routed_experts", "RoutedExperts.forward_monolithic", "function",
             ("self", "x", "router_logits"), needed_by="dp",
             why="a layer whose first forward is monolithic is reported unmetered"),
    Internal(_MOE_RUNNER, "MoERunner.do_naive_dispatch_combine", "attribute", needed_by="dp",
             why="names the runner's own all-gather when a layer has no prepare/finalize stage (unmetered)"),
    # exact re-placement (replacement.py): ids mapped after top-k, per-expert loads re-placed
    Internal(_BASE_ROUTER, "BaseRouter._apply_eplb_mapping", "function", ("self", "topk_ids"),
             why="placement: followed by logical -> physical ids on every MoE layer"),
    Internal(_BASE_ROUTER, "BaseRouter.eplb_state", "attribute", why="placement refused with EPLB's own map"),
    Internal(_ROUTED, "RoutedExperts.expert_map_manager", "attribute",
             why="placement refused with fused shared-expert slots"),
    Internal(_ROUTED, "RoutedExperts.quant_method", "attribute", why="monolithic kernels refused; DP dispatch stage"),
    Internal(_ROUTED, "RoutedExperts.quant_config", "attribute", why="quantizations loading all experts at once refused"),
    Internal(_ROUTED, "RoutedExperts.moe_config", "attribute", why="redundant slots, EPLB, hidden size"),
    Internal(_ROUTED, "RoutedExperts.local_num_experts", "attribute", why="which tensors are per expert"),
    Internal(_ROUTED, "RoutedExperts._expert_routing_tables", "function", ("self",),
             why="layout buffers that must not be re-placed"),
    Internal("vllm.model_executor.layers.fused_moe.config", "FusedMoEConfig.num_logical_experts", "attribute",
             why="redundant expert slots refused"),
    Internal("vllm.model_executor.layers.fused_moe.config", "FusedMoEConfig.num_experts", "attribute",
             why="physical expert slots: the replica slots the layer was built with, fused shared-expert slots"),
    Internal("vllm.model_executor.layers.fused_moe.config", "FusedMoEParallelConfig.enable_eplb", "attribute",
             why="placement refused with EPLB"),
    Internal("vllm.config.parallel", "ParallelConfig.enable_eplb", "attribute",
             why="replica slots: MoE layers built as for EPLB, then EPLB left off"),
    Internal("vllm.config.parallel", "EPLBConfig.num_redundant_experts", "attribute",
             why="replica slots: the redundant physical slots the MoE layers are built with"),
    Internal("vllm.distributed.eplb.eplb_state", "EplbState.build_initial_global_physical_to_logical_map",
             "function", ("num_routed_experts", "num_redundant_experts"),
             why="replica slots: which logical expert a loader call for a physical slot carries"),
    Internal("vllm.model_executor.layers.fused_moe.fused_moe_method_base", "FusedMoEMethodBase.is_monolithic",
             "attribute", why="monolithic kernels route internally: placement refused"),
    Internal("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",
             "UnquantizedFusedMoEMethod.create_weights", "function", (),
             mentions=("w13_weight", "w2_weight"),
             why="registers the expert weights w13_weight / w2_weight whose weight_loader the placement wraps"),
    Internal("vllm.model_executor.layers.linear", "RowParallelLinear.reduce_results", "attribute", needed_by="tp",
             why="attention output left unreduced for the shuffled reduce-scatter"),
    # model runner (0.32, 0.33: vllm/v1/worker/gpu_model_runner.py; the CPU runner inherits it):
    # real forward steps, capture, flush. Model runner v2 (0.34) has none of these: the features
    # that need a step source are refused there (REFUSED_FEATURES).
    Internal(_RUNNER, "GPUModelRunner._model_forward", "function", ("self", "input_ids", "positions"),
             needed_by="capture", versions=RUNNER_V1, why="hooked: open/close the step context around real steps",
             no_public="the one call that runs the model for real steps only (warm-up, profiling and dummy "
                       "batches bypass it); the forward context is set for those runs too and names no request"),
    Internal("vllm.v1.worker.gpu_worker", "Worker.execute_dummy_batch", "function", ("self",), needed_by="dp",
             versions=RUNNER_V1,
             why="hooked: the dummy batches an idle DP rank runs in lock-step count in the MoE counters",
             no_public="the worker's own RPC for an idle DP rank's lock-step batch; nothing else marks it"),
    Internal("vllm.v1.worker.gpu_worker", "Worker.model_runner", "attribute", needed_by="dp", versions=RUNNER_V1,
             why="the engine state of a worker",
             no_public="a worker reaches its model only through its runner (vLLM's own worker code does the same)"),
    Internal(_RUNNER, "GPUModelRunner.get_model", "function", ("self",), needed_by="capture", versions=RUNNER_V1,
             why="the engine's model (its state key)",
             no_public="the runner's public accessor of its model, which vLLM's worker calls itself"),
    Internal(_RUNNER, "GPUModelRunner.shutdown", "function", ("self",), needed_by="capture", versions=RUNNER_V1,
             why="hooked: write the capture when the engine stops",
             no_public="engines in worker processes end here on SIGTERM; vLLM has no plugin shutdown callback"),
    Internal(_RUNNER, "GPUModelRunner.input_batch", "attribute", needed_by="capture", versions=RUNNER_V1,
             why="request ids and prompt lengths of the step",
             no_public=_NO_BATCH),
    Internal(_RUNNER, "GPUModelRunner.query_start_loc", "attribute", needed_by="capture", versions=RUNNER_V1,
             why="token bounds of each request in the step",
             no_public="the attention metadata's query_start_loc is per attention backend (and a device "
                       "tensor); the runner's CPU copy is the one every backend is built from"),
    Internal("vllm.v1.worker.gpu_input_batch", "InputBatch.req_ids", "attribute", needed_by="capture",
             versions=RUNNER_V1, why="request ids (their number: the step's requests)", no_public=_NO_BATCH),
    Internal("vllm.v1.worker.gpu_input_batch", "InputBatch.num_prompt_tokens", "attribute", needed_by="capture",
             versions=RUNNER_V1, why="prompt length (prefill/decode marking)", no_public=_NO_BATCH),
    Internal("vllm.v1.worker.gpu_input_batch", "InputBatch.token_ids_cpu", "attribute", needed_by="capture",
             versions=RUNNER_V1,
             why="token ids of the positions a step skips (prefix-cache hits), recorded as not routed",
             no_public="prefix-cache hits are never run through the model, so no model-side surface sees them"),
    Internal(_RUNNER, "GPUModelRunner.requests", "attribute", needed_by="capture", versions=RUNNER_V1,
             why="the requests the engine still holds (the capture's coverage records of others are dropped)",
             no_public="finished requests reach the worker only inside the runner's state update"),
    Internal("vllm.forward_context", "get_forward_context", "function", (),
             why="the per-step context the plugin's ops read the engine state from"),
    Internal("vllm.forward_context", "is_forward_context_available", "function", (),
             why="outside a forward pass there is no context"),
    Internal("vllm.forward_context", "ForwardContext.no_compile_layers", "attribute",
             why="MoE layer by name inside the plugin's ops"),
    Internal("vllm.forward_context", "ForwardContext.dp_metadata", "attribute", needed_by="capture",
             why="where this DP rank's tokens start in a gathered MoE batch"),
    Internal("vllm.forward_context", "DPMetadata.num_tokens_across_dp_cpu", "attribute", needed_by="capture",
             why="tokens of each DP rank"),
    Internal("vllm.forward_context", "DPMetadata.local_sizes", "attribute", needed_by="capture",
             why="tokens of each DP rank in the current chunk"),
    Internal("vllm.utils.torch_utils", "direct_register_custom_op", "function",
             ("op_name", "op_func", "mutates_args", "fake_impl", "target_lib", "dispatch_key"),
             why="registers the plugin's opaque ops"),
    # collectives
    Internal(_PARALLEL, "get_ep_group", "function", (),
             why="EP group of the shuffle and of the sparse dispatch; this EP rank (replica placement)"),
    Internal(_PARALLEL, "get_tp_group", "function", (), needed_by="tp", why="TP group (shuffled reduce-scatter)"),
    Internal(_PARALLEL, "get_tensor_model_parallel_rank", "function", (), why="TP rank 0 writes the capture"),
    Internal("vllm.model_executor.layers.fused_moe.fused_moe_method_base", "FusedMoEMethodBase.moe_kernel",
             "attribute", needed_by="dp", why="the layer's modular kernel (its prepare/finalize stage)"),
    Internal("vllm.model_executor.layers.fused_moe.modular_kernel", "FusedMoEKernel.impl", "attribute",
             needed_by="dp", why="holds the prepare/finalize stage"),
    Internal("vllm.model_executor.layers.fused_moe.modular_kernel", "FusedMoEKernelModularImpl.prepare_finalize",
             "attribute", needed_by="dp", why="replaced by the sparse EP stage, or metered"),
    Internal(_NAIVE_DP_EP, "MoEPrepareAndFinalizeNaiveDPEPModular.prepare", "function",
             ("self", "a1", "topk_weights", "topk_ids", "num_experts", "expert_map",
              "apply_router_weight_on_input", "quant_config"), needed_by="dp",
             why="the all-gather dispatch the sparse stage replaces (same signature)"),
    Internal(_NAIVE_DP_EP, "MoEPrepareAndFinalizeNaiveDPEPModular.finalize", "function",
             ("self", "output", "fused_expert_output", "topk_weights", "topk_ids",
              "apply_router_weight_on_input", "weight_and_reduce_impl"), needed_by="dp",
             why="the reduce-scatter combine the sparse stage replaces (same signature)"),
    Internal(_NAIVE_DP_EP, "MoEPrepareAndFinalizeNaiveDPEPModular.__init__", "function",
             ("self", "is_sequence_parallel", "num_dispatchers"), needed_by="dp",
             why="the sparse and metered stages are its subclasses, built with the layer's stage's settings"),
    Internal(_NAIVE_DP_EP, "MoEPrepareAndFinalizeNaiveDPEPModular.is_sequence_parallel", "attribute",
             needed_by="dp", why="copied into the sparse or metered stage that replaces the layer's"),
    Internal(_NAIVE_DP_EP, "MoEPrepareAndFinalizeNaiveDPEPModular.num_dispatchers", "function", ("self",),
             needed_by="dp", why="copied into the sparse or metered stage that replaces the layer's"),
    Internal(_NAIVE_DP_EP, "_quantize_and_setup_dispatch", "function", ("a1", "quant_config", "defer_input_quant"),
             needed_by="dp", why="activation quantization before the dispatch, as vLLM's stage does it"),
    Internal("vllm.model_executor.layers.fused_moe.topk_weight_and_reduce", "TopKWeightAndReduceDelegate",
             "attribute", needed_by="dp", why="finalize: the experts left the top-k reduction to the stage"),
    Internal("vllm.model_executor.layers.fused_moe.topk_weight_and_reduce", "TopKWeightAndReduceContiguous",
             "attribute", needed_by="dp", why="finalize: top-k reduction of contiguous expert outputs"),
    Internal(_PARALLEL, "model_parallel_is_initialized", "function", (), why="TP rank when not distributed"),
    Internal(_PARALLEL, "GroupCoordinator.reduce_scatterv", "function", ("self", "input_", "dim", "sizes"),
             needed_by="tp", why="shuffled reduce-scatter"),
    Internal(_PARALLEL, "GroupCoordinator.device_communicator", "attribute", needed_by="capture",
             why="the TP group's communicator, whose collectives are metered"),
    Internal(_DEVICE_COMM, "DeviceCommunicatorBase.all_reduce", "function", ("self", "input_"), needed_by="capture",
             why="metered (TP all-reduces)"),
    Internal(_DEVICE_COMM, "DeviceCommunicatorBase.reduce_scatter", "function", ("self", "input_", "dim"),
             needed_by="capture", why="metered"),
    Internal(_DEVICE_COMM, "DeviceCommunicatorBase.reduce_scatterv", "function", ("self", "input_", "dim", "sizes"),
             needed_by="capture", why="metered (the TP shuffle's reduce-scatter)"),
    Internal(_DEVICE_COMM, "DeviceCommunicatorBase.all_gather", "function", ("self", "input_", "dim"),
             needed_by="capture", why="metered"),
    Internal(_DEVICE_COMM, "DeviceCommunicatorBase.all_gatherv", "function", ("self", "input_", "dim", "sizes"),
             needed_by="capture", why="metered"),
    Internal(_PARALLEL, "GroupCoordinator.rank_in_group", "attribute", why="this rank (TP shuffle, replica placement)"),
    Internal(_PARALLEL, "GroupCoordinator.world_size", "attribute", needed_by="tp", why="group size"),
    Internal(_PARALLEL, "GroupCoordinator.cpu_group", "attribute", needed_by="tp", why="gloo group for CPU tensors"),
    Internal(_PARALLEL, "GroupCoordinator.device_group", "attribute", needed_by="tp", why="NCCL group"),
    # API server: DP rank choice
    Internal(_CORE_CLIENT, "DPLBAsyncMPClient.__init__", "function", ("self", "vllm_config", "executor_class", "log_stats"),
             needed_by="dp",
             why="hooked: the DP router is built and warmed when the API server starts, not at its first request"),
    Internal(_CORE_CLIENT, "DPLBAsyncMPClient.get_core_engine_for_request", "function", ("self", "request"),
             needed_by="dp", why="hooked: choose the DP rank the Sem-MoE way"),
    Internal(_CORE_CLIENT, "DPLBAsyncMPClient.process_engine_outputs", "function", ("self", "outputs"),
             needed_by="dp", why="hooked: each request's generated tokens and finish (the router's in-flight work)"),
    Internal("vllm.v1.engine", "EngineCoreOutputs.outputs", "attribute", needed_by="dp",
             why="the requests that stepped"),
    Internal("vllm.v1.engine", "EngineCoreOutputs.finished_requests", "attribute", needed_by="dp",
             why="requests that left an engine"),
    Internal("vllm.v1.engine", "EngineCoreOutput.new_token_ids", "attribute", needed_by="dp",
             why="tokens a request generated this step"),
    Internal(_CORE_CLIENT, "DPLBAsyncMPClient.client_count", "attribute", needed_by="dp", why="queue score"),
    Internal(_CORE_CLIENT, "DPLBAsyncMPClient.engine_inflight", "attribute", needed_by="dp", why="queue score"),
    Internal(_CORE_CLIENT, "DPLBAsyncMPClient.reqs_in_flight", "attribute", needed_by="dp",
             why="requests already placed keep their rank"),
    Internal(_CORE_CLIENT, "DPAsyncMPClient.lb_engines", "attribute", needed_by="dp",
             why="waiting/running (and KV usage) per rank"),
    Internal(_CORE_CLIENT, "MPClient.core_engines", "attribute", needed_by="dp", why="the DP ranks"),
    Internal(_CORE_CLIENT, "MPClient.engine_ranks_managed", "attribute", needed_by="dp",
             why="the DP ranks behind core_engines (hybrid load balancing: this node's only)"),
    Internal("vllm.config.parallel", "ParallelConfig.data_parallel_size_local", "attribute", needed_by="dp",
             why="the DP ranks a hybrid-balancing node serves"),
    Internal("vllm.config.parallel", "ParallelConfig.data_parallel_hybrid_lb", "attribute", needed_by="dp",
             why="whether each node's API server balances only its own DP ranks"),
    Internal("vllm.config.parallel", "ParallelConfig.data_parallel_external_lb", "attribute", needed_by="dp",
             why="whether no vLLM balancer sees more than one DP rank"),
    Internal(_CORE_CLIENT, "MPClient.vllm_config", "attribute", needed_by="dp", why="the semmoe settings"),
    # process-wide fixes
    Internal("vllm.triton_utils.dispatcher", "_rebind_kernels", "function", (), needed_by="all",
             versions=RUNNER_V1,
             why="its module-level vars() is given a version that tolerates llvmlite objects (0.34's "
                 "_rebind_impls tolerates them itself)"),
    Internal("vllm.model_executor.layers.fused_moe.experts.cpu_moe", "CPUUnquantizedExperts.apply", "function",
             ("self", "output", "hidden_states", "w1", "w2", "topk_weights", "topk_ids", "activation",
              "global_num_experts", "expert_map", "a1q_scale", "a2_scale", "workspace13", "workspace2",
              "expert_tokens_meta", "apply_router_weight_on_input"), needed_by="cpu",
             why="CPU fix: honour expert_map under expert parallelism"),
    Internal("vllm.distributed.device_communicators.cpu_communicator", "CpuCommunicator.all_gatherv", "function",
             ("self", "input_", "dim", "sizes"), needed_by="cpu", why="CPU fix: implemented for data parallelism"),
    Internal("vllm.distributed.device_communicators.cpu_communicator", "CpuCommunicator.reduce_scatterv",
             "function", ("self", "input_", "dim", "sizes"), needed_by="cpu", why="CPU fix: implemented for data parallelism"),
)


# ---- versions -------------------------------------------------------------------------------
def major_minor(version: str) -> tuple[int, int] | None:
    m = re.match(r"\s*v?(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def version_supported(version: str) -> bool:
    return major_minor(version) in SUPPORTED_VERSIONS


def supported_text() -> str:
    return ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VERSIONS)


def version_key(version: str) -> tuple[int, int]:
    """The supported ``(major, minor)`` whose internals ``version`` is checked against: its own,
    else the nearest supported one (a newer release is checked as the newest supported)."""
    mm = major_minor(version)
    if mm in SUPPORTED_VERSIONS:
        return mm
    if mm is None or mm > SUPPORTED_VERSIONS[-1]:
        return SUPPORTED_VERSIONS[-1]
    return SUPPORTED_VERSIONS[0]


def internals_for(version: str) -> list[Internal]:
    """The internals vLLM ``version`` needs (its version's, its build's CPU fixes)."""
    return [i for i in INTERNALS if i.needed_on(version)]


def surface_counts(version: str) -> dict[str, int]:
    """How many internals ``version`` needs, per surface (:data:`SURFACES` order)."""
    needed = internals_for(version)
    return {surface: sum(i.surface == surface for i in needed) for surface in SURFACES}


def refused_features(version: str) -> dict[str, str]:
    """Feature -> why the plugin refuses it at engine start on vLLM ``version`` (``{}``: none)."""
    return {feature: why.format(version=version) for feature, why in
            REFUSED_FEATURES.get(version_key(version), {}).items()}


def refused_summary(version: str) -> str:
    """Why vLLM ``version`` refuses its :func:`refused_features`, in a few words (``""``: none)."""
    return REFUSED_SUMMARY.get(version_key(version), "")


def has_step_source(version: str) -> bool:
    """Whether the plugin hooks the real forward steps of vLLM ``version``'s model runner."""
    return version_key(version) in RUNNER_V1


def features_used(config, parallel_config=None) -> list[str]:
    """The features of :data:`REFUSED_FEATURES` a validated semmoe ``config`` uses."""
    mode = str(getattr(config.mode, "value", config.mode))
    used = ["capture"] if config.capture is not None else []
    if mode in ("tp", "dp"):
        used.append(mode)
    dispatch = config.resolved_dispatch(parallel_config) if parallel_config is not None else config.dispatch
    if dispatch == "sparse" or (dispatch == "vllm" and config.records):  # placement-only leaves vLLM's alone
        used.append("dispatch")
    return used


def check_features(config, parallel_config=None, version: str | None = None) -> None:
    """Raise :class:`~.config.SemMoEConfigError` naming the first feature ``config`` uses that
    vLLM ``version`` (the installed one by default) does not support, and why."""
    version = version or vllm_version()
    refused = refused_features(version)
    for feature in features_used(config, parallel_config):
        if feature in refused:
            from .config import SemMoEConfigError

            raise SemMoEConfigError(
                f"semmoe: {_FEATURE_NAMES[feature]} is not supported on vLLM {version}: {refused[feature]}. "
                f"Use vLLM {' or '.join(f'{a}.{b}' for a, b in RUNNER_V1)} for it, or leave it out "
                "(placement-only serving with tables works here).")


_FEATURE_NAMES = {"capture": "the routing capture ('capture')", "tp": "mode 'tp'", "dp": "mode 'dp'",
                  "dispatch": "the DP + EP dispatch ('dispatch')"}


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


# ---- live check (start-up) ------------------------------------------------------------------
def resolve(internal: Internal):
    """The live object of a ``function`` internal (``AttributeError``/``ImportError`` if absent)."""
    import importlib

    obj = importlib.import_module(internal.module)
    for part in internal.qualname.split("."):
        obj = getattr(obj, part)
    return obj


def params_compatible(actual: list[str], expected: tuple[str, ...], has_var_positional: bool = False,
                      required: int | None = None) -> bool:
    """Whether a signature whose positional parameter names are ``actual`` (the first
    ``required`` of them without a default) accepts the adapter's calls: ``expected`` must be
    its leading parameters, in order (a ``*args`` takes the rest), and it may require no more."""
    if len(actual) < len(expected):
        return has_var_positional and list(actual) == list(expected[: len(actual)])
    if required is not None and required > len(expected):
        return False
    return list(actual[: len(expected)]) == list(expected)


def check_live(internal: Internal) -> str | None:
    """``None`` when ``internal`` is usable in this process, else what is wrong."""
    if internal.kind != "function":
        return None  # attributes of instances are checked from source (semmoe doctor)
    try:
        obj = resolve(internal)
    except (ImportError, AttributeError) as exc:
        return f"missing ({type(exc).__name__})"
    if not internal.params:
        return None
    target = getattr(obj, "__semmoe_original__", None) or inspect.unwrap(obj)
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    positional = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = [p.name for p in positional]
    required = sum(p.default is p.empty for p in positional)
    var = any(p.kind == p.VAR_POSITIONAL for p in sig.parameters.values())
    if not params_compatible(names, internal.params, var, required):
        return f"signature ({', '.join(names)}) does not start with ({', '.join(internal.params)})"
    return None


def is_cpu_build(version: str) -> bool:
    return "+cpu" in (version or "")


def check_vllm() -> None:
    """Raise ``RuntimeError`` naming the vLLM version or internals this adapter cannot work with."""
    version = vllm_version()
    problems = [f"{i.name}: {why}" for i in internals_for(version) if (why := check_live(i)) is not None]
    if problems or not version_supported(version):
        raise RuntimeError(
            f"vllm-semmoe supports vLLM {supported_text()}; this is vLLM {version}"
            + (f", where: {'; '.join(problems)}" if problems else "")
            + ". Install a supported vLLM (`semmoe doctor` lists what is missing), or exclude the "
              "plugin with VLLM_PLUGINS (e.g. VLLM_PLUGINS=\"\").")


# ---- engine start ---------------------------------------------------------------------------
def parallel_layout(vllm_config) -> dict:
    p = vllm_config.parallel_config
    return {"tp": int(p.tensor_parallel_size), "dp": int(p.data_parallel_size),
            "pp": int(getattr(p, "pipeline_parallel_size", 1)),
            "pcp": int(getattr(p, "prefill_context_parallel_size", 1)),
            "dcp": int(getattr(p, "decode_context_parallel_size", 1)),
            "ep": bool(getattr(p, "enable_expert_parallel", False)),
            "dp_rank": int(getattr(p, "data_parallel_rank", 0) or 0)}


def compilation(vllm_config) -> dict:
    """``{"compiled": bool, "cudagraphs": "NONE" | "PIECEWISE" | "FULL..."}`` of this config."""
    cc = vllm_config.compilation_config
    mode = getattr(cc, "mode", None)
    graphs = getattr(cc, "cudagraph_mode", None)
    name = getattr(graphs, "name", str(graphs)) if graphs is not None else "NONE"
    return {"compiled": bool(mode) and int(mode) != 0, "cudagraphs": name,
            "enforce_eager": bool(getattr(vllm_config.model_config, "enforce_eager", False))}


def keep_ops_outside_graphs(vllm_config, op_names: list[str]) -> None:
    """Add ``op_names`` (``"ns::name"``) to the splitting ops, so piecewise CUDA graphs leave
    them out and they run (with their Python) on every step, as vLLM does for attention."""
    cc = vllm_config.compilation_config
    if cc.splitting_ops is None:
        cc.splitting_ops = []
    for name in op_names:
        if name not in cc.splitting_ops:
            cc.splitting_ops.append(name)


def current_platform_is_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


# ---- custom ops -----------------------------------------------------------------------------
def register_op(library, name: str, func, fake, mutates_args=()) -> None:
    """Register ``library::name`` (a ``torch.library.Library``) the way vLLM registers its own."""
    from vllm.utils.torch_utils import direct_register_custom_op

    direct_register_custom_op(op_name=name, op_func=func, mutates_args=list(mutates_args),
                              fake_impl=fake, target_lib=library)


def use_opaque_moe_op(runner) -> None:
    """Make ``runner`` call vLLM's opaque ``torch.ops.vllm.moe_forward`` (what CUDA vLLM always
    does) instead of tracing ``_moe_forward`` into the compiled graph (vLLM's choice on CPU), so
    the router's capture hook runs, in Python, on every step of a compiled model."""
    import torch

    shared = runner.shared_experts is not None
    runner._forward_entry = torch.ops.vllm.moe_forward_shared if shared else torch.ops.vllm.moe_forward


@contextlib.contextmanager
def redundant_expert_slots(vllm_config, count: int):
    """Build the model's MoE layers with ``count`` redundant physical expert slots in all.

    vLLM 0.32 creates redundant slots only for its EPLB (``FusedMoE`` asserts "Redundant
    experts are only supported with EPLB", and ``ParallelConfig`` refuses
    ``num_redundant_experts`` without ``enable_eplb``), and refuses EPLB off CUDA / ROCm / XPU.
    So while the model is built, the parallel config reads as EPLB's with
    ``num_redundant_experts = count``: every MoE layer gets EPLB's physical layout (``N +
    count`` slots, ``(N + count) / EP`` per rank, the model's expert-weight mapping over
    physical slots), and kernels are chosen as for EPLB. The config is restored right after,
    so the model runner builds no ``EplbState`` and nothing rebalances; the placement drives
    the physical map (:func:`.replacement.install_placement`).
    """
    if not count:
        yield
        return
    parallel = vllm_config.parallel_config
    saved = parallel.enable_eplb, parallel.eplb_config.num_redundant_experts
    parallel.enable_eplb, parallel.eplb_config.num_redundant_experts = True, int(count)
    try:
        yield
    finally:
        parallel.enable_eplb, parallel.eplb_config.num_redundant_experts = saved


def initial_physical_to_logical(num_experts: int, num_redundant: int) -> list[int]:
    """The logical expert each physical slot's checkpoint weights come from in vLLM's expert
    mapping (EPLB's initial layout: ``range(N)`` then ``i % N``)."""
    from vllm.distributed.eplb.eplb_state import EplbState

    return list(EplbState.build_initial_global_physical_to_logical_map(num_experts, num_redundant))


def prepare_finalize(experts):
    """The prepare/finalize stage of ``experts``' modular kernel (``None``: no modular kernel)."""
    kernel = getattr(experts.quant_method, "moe_kernel", None)
    return None if kernel is None else kernel.impl.prepare_finalize


def set_prepare_finalize(experts, stage) -> None:
    experts.quant_method.moe_kernel.impl.prepare_finalize = stage


def allgather_stage_class():
    """vLLM's all-gather / reduce-scatter DP + EP prepare/finalize class (modular kernels)."""
    from vllm.model_executor.layers.fused_moe.prepare_finalize.naive_dp_ep import (
        MoEPrepareAndFinalizeNaiveDPEPModular)

    return MoEPrepareAndFinalizeNaiveDPEPModular


def is_allgather_stage(stage) -> bool:
    """Whether ``stage`` is vLLM's own all-gather / reduce-scatter DP + EP stage (modular kernels)."""
    return type(stage) is allgather_stage_class()


def quantize_for_dispatch(a1, quant_config, defer_input_quant: bool):
    """``(a1q, a1q_scale)``: the activations as vLLM's DP + EP stage quantizes them for dispatch."""
    from vllm.model_executor.layers.fused_moe.prepare_finalize.naive_dp_ep import _quantize_and_setup_dispatch

    a1q, _, a1q_scale = _quantize_and_setup_dispatch(a1, quant_config, defer_input_quant)
    return a1q, a1q_scale


def weight_and_reduce(impl, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input):
    """``[M, H]``: the experts' output reduced over each row's top-k (as vLLM's stage does it)."""
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
        TopKWeightAndReduceContiguous, TopKWeightAndReduceDelegate)

    if isinstance(impl, TopKWeightAndReduceDelegate):
        impl = TopKWeightAndReduceContiguous()
    return impl.apply(output=None, fused_expert_output=fused_expert_output, topk_weights=topk_weights,
                      topk_ids=topk_ids, apply_router_weight_on_input=apply_router_weight_on_input)


def moe_forward_eager(runner, hidden_states, router_logits):
    """vLLM's own MoE layer forward (all-reduce included), run eagerly."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    return MoERunner.forward(runner, hidden_states, router_logits)


# ---- per-step context -----------------------------------------------------------------------
def layer_by_name(name: str):
    """The module vLLM registered under ``name`` (MoE runners register their ``layer_name``)."""
    from vllm.forward_context import get_forward_context

    return get_forward_context().no_compile_layers[name]


def dp_rows_offset(dp_rank: int, rows: int) -> int:
    """Where this DP rank's tokens start among ``rows`` rows a MoE layer sees: under data
    parallelism vLLM gathers every rank's tokens (rank-major) before routing them."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if dp_rank == 0 or not is_forward_context_available():
        return 0
    metadata = get_forward_context().dp_metadata
    if metadata is None:
        return 0
    sizes = getattr(metadata, "local_sizes", None) or metadata.num_tokens_across_dp_cpu.tolist()
    if sum(sizes) != rows:  # not gathered
        return 0
    return int(sum(sizes[:dp_rank]))


def request_token_ids(runner, row: int, start: int, end: int):
    """``[end - start]`` token ids at positions ``start:end`` of the request in row ``row`` of the
    step's batch (prompt, then generated tokens)."""
    return runner.input_batch.token_ids_cpu[row, start:end].copy()


def live_request_ids(runner):
    """The ids of every request the model runner still holds (running or preempted), a container."""
    return runner.requests


def runner_dispatches_itself(runner) -> bool:
    """Whether vLLM's MoE runner all-gathers the tokens itself (its naive dispatch / combine,
    for kernels without a modular prepare/finalize stage)."""
    return bool(getattr(runner, "do_naive_dispatch_combine", False))


def step_batch(runner):
    """``(req_ids [R], num_prompt_tokens [R], bounds [R+1])`` of the step being run."""
    import numpy as np

    batch = runner.input_batch
    req_ids = list(batch.req_ids)  # condensed before every step: exactly the step's requests
    num_reqs = len(req_ids)
    bounds = runner.query_start_loc.np[: num_reqs + 1].astype(np.int64).copy()
    return req_ids, np.asarray(batch.num_prompt_tokens[:num_reqs]).copy(), bounds


# ---- MoE layer pieces used by the TP shuffle --------------------------------------------------
def moe_runner_class():
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    return MoERunner


def base_router_class():
    """vLLM's router base class, whose select step the placement's EPLB-map hook relies on."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    return BaseRouter


def zero_expert_router_class():
    """vLLM's router for models with zero (identity) experts, which the fused TP path leaves alone."""
    from vllm.model_executor.layers.fused_moe.router.zero_expert_router import ZeroExpertRouter

    return ZeroExpertRouter


def topk_indices_dtype(runner):
    return runner._quant_method.topk_indices_dtype


def select_experts(runner, hidden_states, router_logits):
    """``(weights [m, K], ids [m, K])`` of ``runner``'s router, without its capture hook."""
    router = runner.router
    capture, router.capture_fn = router.capture_fn, None
    try:
        return router.select_experts(hidden_states=hidden_states, router_logits=router_logits,
                                     topk_indices_dtype=topk_indices_dtype(runner))
    finally:
        router.capture_fn = capture


def experts_forward(experts, hidden_states, weights, ids):
    """This rank's experts on ``hidden_states`` rows routed by ``(weights, ids)``."""
    return experts.forward_modular(hidden_states, weights, ids)


@contextlib.contextmanager
def unreduced(linear):
    """Run a row-parallel linear layer without its all-reduce (partial sums per rank)."""
    linear.reduce_results = False
    try:
        yield
    finally:
        linear.reduce_results = True


def ep_group():
    from vllm.distributed.parallel_state import get_ep_group

    return get_ep_group()


def tp_group():
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group()


def tp_rank() -> int:
    from vllm.distributed import parallel_state

    return parallel_state.get_tensor_model_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0


# ---- DP load balancer -----------------------------------------------------------------------
def dp_managed_ranks(client) -> list[int]:
    """The DP ranks of ``client.core_engines``, in their order (all of them, or with hybrid load
    balancing this node's)."""
    return [int(r) for r in client.engine_ranks_managed]


def dp_load_balancing(parallel_config) -> str:
    """Who balances DP requests: ``"internal"`` (one API server balancer sees every rank),
    ``"hybrid"`` (each node's API server balances its own ranks) or ``"external"`` (an outside
    router picks the rank; each rank has its own API server)."""
    if parallel_config.data_parallel_external_lb:
        return "external"
    return "hybrid" if parallel_config.data_parallel_hybrid_lb else "internal"


def dp_request_placed(client, request) -> bool:
    """Whether vLLM already placed this request (streaming-input session affinity)."""
    return request.request_id in client.reqs_in_flight


def dp_queue_scores(client, version: str | None = None) -> list[float]:
    """vLLM's own load score of each DP rank (lower: less loaded), as its balancer computes it.

    0.32: ``max(client_count * in_flight, waiting + running)``; 0.33 adds a KV-pressure term
    for waiting requests, ``waiting * 6 * max(0, kv_usage - 0.5)``.
    """
    version = version or vllm_version()
    penalise_kv = major_minor(version) >= (0, 33)
    scores = []
    for engine, counts in zip(client.core_engines, client.lb_engines):
        waiting, running = counts[0], counts[1]
        score = float(max(client.client_count * client.engine_inflight[engine], waiting + running))
        if penalise_kv and waiting and len(counts) > 2:
            score += waiting * 6.0 * max(0.0, float(counts[2]) - 0.5)
        scores.append(score)
    return scores
