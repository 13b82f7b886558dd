"""Run-time fixes for vLLM's CPU backend (vLLM 0.32.x), installed by the plugin entry point.

vLLM 0.32 on CPU crashes or fails in two parallel modes that Sem-MoE needs:

1. **Tensor parallel + expert parallel** (``--tensor-parallel-size 2 --enable-expert-parallel``):
   ``CPUUnquantizedExperts.apply`` (``model_executor/layers/fused_moe/experts/cpu_moe.py``) passes
   the router's *global* expert ids to ``torch.ops._C.cpu_fused_moe`` and ignores ``expert_map``
   (global id -> local slot, ``-1`` for experts held by another rank; built by
   ``fused_moe/expert_map_manager.py``). Each rank only holds ``E / ep_size`` experts, so the
   kernel indexes past its weight tensors: a segfault in the engine (or, with small tensors,
   silently wrong output).

   Fix: :func:`_localize_topk` maps the ids through ``expert_map``. A (token, slot) pair routed
   to an expert of another rank gets weight 0 and id 0 (a valid local slot), so it contributes
   exactly zero here; the rank that holds the expert adds its share, and the all-reduce after
   the MoE layer sums the ranks. Zeroing a ``[M, topk]`` weight tensor is much cheaper than
   masking expert weights, and gives the same sum.

2. **Data parallel** (``vllm serve --data-parallel-size 2``): the MoE layers gather tokens of all
   DP ranks with ``all_gatherv`` and scatter results back with ``reduce_scatterv``, which
   ``CpuCommunicator`` (``distributed/device_communicators/cpu_communicator.py``) does not
   implement: the base class raises ``NotImplementedError`` and every request fails with HTTP 500.

   Fix: :func:`_cpu_all_gatherv` (pad every rank to the largest size, ``all_gather``, drop the
   padding) and :func:`_cpu_reduce_scatterv` (``all_reduce`` the whole tensor, keep this rank's
   rows).

3. **Data parallel, compiled** (vLLM's default compilation, no ``--enforce-eager``): on CPU,
   ``MoERunner`` calls its MoE function directly (``_select_forward``), so Dynamo traces the
   DP gather/scatter into the graph, with token counts that change every step: tracing fails
   (``_check_sizes`` cannot be guarded) or, worse, bakes one step's sizes in.

   Fix: :func:`_make_select_forward` makes MoE layers with ``dp_size > 1`` (or sequence
   parallelism) call vLLM's opaque ``torch.ops.vllm.moe_forward`` op, as CUDA vLLM always does,
   so the gather runs eagerly on every step with that step's sizes.

Policy: fixes are applied only on the CPU platform and only for vLLM 0.32.x, where the bugs were
seen. On other versions nothing is patched; if a target has moved, a warning names it. If a fix
is needed (CPU and 0.32) but its target is missing, :func:`apply_cpu_fixes` raises
``RuntimeError`` naming the missing internal, instead of letting vLLM crash later.
"""

from __future__ import annotations

import functools
import importlib
import logging
import re
from typing import Any

logger = logging.getLogger(__name__)

#: vLLM (major, minor) versions with the bugs fixed here.
AFFECTED_VERSIONS = frozenset({(0, 32)})

CPU_MOE_MODULE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"
CPU_MOE_CLASS = "CPUUnquantizedExperts"
CPU_COMM_MODULE = "vllm.distributed.device_communicators.cpu_communicator"
CPU_COMM_CLASS = "CpuCommunicator"
MOE_RUNNER_MODULE = "vllm.model_executor.layers.fused_moe.runner.moe_runner"
MOE_RUNNER_CLASS = "MoERunner"

#: Attribute set on the functions this module installs (idempotency and introspection).
PATCH_MARKER = "__semmoe_cpu_fix__"

_APPLIED = False


# ---------------------------------------------------------------------------------------------
# Fix 1: expert parallel in CPUUnquantizedExperts.apply
# ---------------------------------------------------------------------------------------------


def _localize_topk(topk_weights, topk_ids, expert_map, apply_router_weight_on_input: bool):
    """Map global ``topk_ids`` to this rank's expert slots.

    Returns ``(weights, local_ids, apply_router_weight_on_input)`` for the kernel: pairs routed
    to experts of other ranks (``expert_map == -1``; also any negative id) get weight 0 and
    local id 0. When the router weight was already applied to the input (the kernel would then
    skip the weights), the weights become the 0/1 locality mask and the kernel is told to apply
    them, which multiplies local pairs by 1 and remote pairs by 0.
    """
    import torch

    ids = topk_ids.long()
    n_map = expert_map.numel()
    local = expert_map.to(device=topk_ids.device)[ids.clamp(0, n_map - 1)]
    is_local = (local >= 0) & (ids >= 0) & (ids < n_map)
    local_ids = local.clamp_min(0).to(topk_ids.dtype).contiguous()
    if apply_router_weight_on_input:
        weights = is_local.to(topk_weights.dtype).contiguous()
        return weights, local_ids, False
    weights = torch.where(is_local, topk_weights, torch.zeros_like(topk_weights)).contiguous()
    return weights, local_ids, apply_router_weight_on_input


def _make_ep_apply(original):
    """Wrap ``CPUUnquantizedExperts.apply`` (0.32 signature) to honour ``expert_map``."""

    @functools.wraps(original)
    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
              expert_tokens_meta, apply_router_weight_on_input):
        if expert_map is not None:
            topk_weights, topk_ids, apply_router_weight_on_input = _localize_topk(
                topk_weights, topk_ids, expert_map, apply_router_weight_on_input)
            expert_map = None  # ids are local now: never map them twice
        return original(self, output, hidden_states, w1, w2, topk_weights, topk_ids,
                        activation, global_num_experts, expert_map, a1q_scale, a2_scale,
                        workspace13, workspace2, expert_tokens_meta,
                        apply_router_weight_on_input)

    setattr(apply, PATCH_MARKER, "expert_map")
    apply.__semmoe_original__ = original
    return apply


# ---------------------------------------------------------------------------------------------
# Fix 2: all_gatherv / reduce_scatterv in CpuCommunicator
# ---------------------------------------------------------------------------------------------


def _check_sizes(comm, sizes, what: str) -> None:
    if len(sizes) != comm.world_size:
        raise ValueError(f"{what}: len(sizes)={len(sizes)} != world_size={comm.world_size}")
    if any(s < 0 for s in sizes):
        raise ValueError(f"{what}: negative size in {sizes}")


def _through_comm(x) -> bool:
    """Whether the communicator's own collectives take this dtype. Its shared-memory backend
    (used by "tp"/"pp" groups) rejects integer tensors ("shm_all_gather_impl not implemented
    for 'Int'"); other dtypes go through torch.distributed on the same group."""
    import torch

    return x.dtype in (torch.float32, torch.bfloat16)


def _all_gather_dim0(comm, x):
    """Concatenating all-gather along dim 0 (rank-major)."""
    import torch

    if _through_comm(x):
        return comm.all_gather(x.contiguous(), 0)
    out = x.new_empty((comm.world_size * x.shape[0],) + tuple(x.shape[1:]))
    torch.distributed.all_gather_into_tensor(out, x.contiguous(), group=comm.device_group)
    return out


def _all_reduce(comm, x):
    """In-place sum over ranks."""
    import torch

    if _through_comm(x):
        return comm.all_reduce(x)
    torch.distributed.all_reduce(x, group=comm.device_group)
    return x


def _all_gatherv_one(comm, tensor, dim: int, sizes):
    import torch

    if dim < 0:
        dim += tensor.dim()
    if not 0 <= dim < tensor.dim():
        raise ValueError(f"all_gatherv: invalid dim for shape {tuple(tensor.shape)}")
    x = tensor.movedim(dim, 0)
    rest = tuple(x.shape[1:])
    if sizes is not None:
        sizes = [int(s) for s in sizes]
        _check_sizes(comm, sizes, "all_gatherv")
        if x.shape[0] != sizes[comm.rank_in_group]:
            raise ValueError(f"all_gatherv: rank {comm.rank_in_group} has {x.shape[0]} rows "
                             f"along dim {dim}, sizes say {sizes[comm.rank_in_group]}")
    if sizes is None or all(s == sizes[0] for s in sizes):
        if x.shape[0] == 0:
            out = x.new_empty((0,) + rest)
        else:
            out = _all_gather_dim0(comm, x)  # [world * rows, *rest], rank-major
    else:
        largest = max(sizes)
        padded = x.new_zeros((largest,) + rest)
        padded[: x.shape[0]] = x
        gathered = _all_gather_dim0(comm, padded)  # [world * largest, *rest], rank-major
        out = torch.cat([gathered[r * largest: r * largest + s] for r, s in enumerate(sizes)])
    return out.movedim(0, dim).contiguous()


def _cpu_all_gatherv(self, input_, dim: int = 0, sizes=None):
    """All-gather with per-rank sizes along ``dim`` (``sizes[r]`` rows from rank ``r``).

    ``input_`` is one tensor or a list of tensors (one collective each, same ``sizes``);
    ``sizes=None`` means every rank contributes the same shape.
    """
    if isinstance(input_, (list, tuple)):
        return [_all_gatherv_one(self, t, dim, sizes) for t in input_]
    return _all_gatherv_one(self, input_, dim, sizes)


def _cpu_reduce_scatterv(self, input_, dim: int = -1, sizes=None):
    """Sum ``input_`` over ranks and return this rank's ``sizes[rank]`` rows along ``dim``.

    ``input_`` has ``sum(sizes)`` rows along ``dim``, rank-major; ``sizes=None`` splits it
    evenly. The input is not modified.
    """
    world = self.world_size
    if dim < 0:
        dim += input_.dim()
    if not 0 <= dim < input_.dim():
        raise ValueError(f"reduce_scatterv: invalid dim for shape {tuple(input_.shape)}")
    total = input_.shape[dim]
    if sizes is None:
        if total % world:
            raise ValueError(f"reduce_scatterv: {total} rows not divisible by {world} ranks")
        sizes = [total // world] * world
    sizes = [int(s) for s in sizes]
    _check_sizes(self, sizes, "reduce_scatterv")
    if sum(sizes) != total:
        raise ValueError(f"reduce_scatterv: sum(sizes)={sum(sizes)} != {total} rows")
    if world == 1:
        return input_
    reduced = _all_reduce(self, input_.contiguous().clone())
    start = sum(sizes[: self.rank_in_group])
    return reduced.narrow(dim, start, sizes[self.rank_in_group]).contiguous()


setattr(_cpu_all_gatherv, PATCH_MARKER, "all_gatherv")
setattr(_cpu_reduce_scatterv, PATCH_MARKER, "reduce_scatterv")


# ---------------------------------------------------------------------------------------------
# Fix 3: data parallel MoE layers as an opaque op (compiled models)
# ---------------------------------------------------------------------------------------------


def _make_select_forward(original):
    """Wrap ``MoERunner._select_forward``: DP (or sequence-parallel) MoE layers use the opaque
    ``torch.ops.vllm.moe_forward[_shared]`` op instead of the traced function."""

    @functools.wraps(original)
    def _select_forward(self):
        entry = original(self)
        config = self.moe_config
        if getattr(config, "dp_size", 1) > 1 or getattr(config, "is_sequence_parallel", False):
            import torch

            return torch.ops.vllm.moe_forward if self.shared_experts is None else torch.ops.vllm.moe_forward_shared
        return entry

    setattr(_select_forward, PATCH_MARKER, "dp_opaque_moe")
    _select_forward.__semmoe_original__ = original
    return _select_forward


# ---------------------------------------------------------------------------------------------
# Installation
# ---------------------------------------------------------------------------------------------


def _vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def _major_minor(version: str) -> tuple[int, int] | None:
    m = re.match(r"\s*v?(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _resolve(module: str, cls: str, attr: str) -> tuple[Any, str | None]:
    """``(class, None)`` if ``module.cls.attr`` exists, else ``(None, what is missing)``."""
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # ImportError, or anything the import raised
        return None, f"module {module} ({type(exc).__name__}: {exc})"
    klass = getattr(mod, cls, None)
    if klass is None:
        return None, f"{module}.{cls}"
    if not callable(getattr(klass, attr, None)):
        return None, f"{module}.{cls}.{attr}"
    return klass, None


_TARGETS = (
    (CPU_MOE_MODULE, CPU_MOE_CLASS, "apply"),
    (CPU_COMM_MODULE, CPU_COMM_CLASS, "all_gatherv"),
    (CPU_COMM_MODULE, CPU_COMM_CLASS, "reduce_scatterv"),
    (MOE_RUNNER_MODULE, MOE_RUNNER_CLASS, "_select_forward"),
)


def _is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def apply_cpu_fixes() -> None:
    """Install the CPU fixes once per process (no-op off CPU or on unaffected vLLM versions)."""
    global _APPLIED
    if _APPLIED:
        return
    try:
        import vllm  # noqa: F401
    except ImportError:
        _APPLIED = True
        return
    if not _is_cpu_platform():
        _APPLIED = True
        return

    version = _vllm_version()
    if _major_minor(version) not in AFFECTED_VERSIONS:
        _APPLIED = True
        missing = [what for what in (_resolve(*t)[1] for t in _TARGETS) if what]
        if missing:
            logger.warning("semmoe CPU fixes: vLLM %s is not a version they were written for "
                           "(%s); not applied, and these targets no longer exist: %s",
                           version, sorted(AFFECTED_VERSIONS), "; ".join(missing))
        else:
            logger.info("semmoe CPU fixes: not applied on vLLM %s (written for %s)",
                        version, sorted(AFFECTED_VERSIONS))
        return

    resolved = {}
    for target in _TARGETS:
        klass, missing = _resolve(*target)
        if missing:
            raise RuntimeError(
                f"semmoe CPU fixes for vLLM {version}: cannot find {missing}. Without it, "
                "tensor/expert/data parallel MoE runs on CPU crash; update "
                "vllm_semmoe/vllm_adapter/cpu_fixes.py for this vLLM build.")
        resolved[target] = klass

    for (_, _, attr), klass in resolved.items():
        if hasattr(klass.__dict__.get(attr), PATCH_MARKER):
            continue  # installed already
        if attr in ("apply", "_select_forward") and attr not in klass.__dict__:
            raise RuntimeError(f"semmoe CPU fixes for vLLM {version}: {klass.__module__}.{klass.__name__} "
                               f"no longer defines {attr} itself")
        if attr == "apply":
            klass.apply = _make_ep_apply(klass.__dict__["apply"])
        elif attr == "all_gatherv":
            klass.all_gatherv = _cpu_all_gatherv
        elif attr == "reduce_scatterv":
            klass.reduce_scatterv = _cpu_reduce_scatterv
        elif attr == "_select_forward":
            klass._select_forward = _make_select_forward(klass.__dict__["_select_forward"])

    _APPLIED = True
    logger.debug("semmoe CPU fixes applied for vLLM %s: %s.%s.apply honours expert_map; "
                 "%s.%s.all_gatherv/reduce_scatterv implemented", version, CPU_MOE_MODULE,
                 CPU_MOE_CLASS, CPU_COMM_MODULE, CPU_COMM_CLASS)


def fixes_active(_worker: Any = None) -> dict[str, bool]:
    """Which fixes are installed in this process (for tests and diagnostics).

    The ignored argument lets it be passed to ``LLM.collective_rpc``, which calls it with the
    worker, to ask each worker process.
    """
    out = {"expert_map": False, "all_gatherv": False, "reduce_scatterv": False, "dp_opaque_moe": False}
    try:
        moe = importlib.import_module(CPU_MOE_MODULE)
        out["expert_map"] = hasattr(
            getattr(moe, CPU_MOE_CLASS).__dict__.get("apply"), PATCH_MARKER)
        comm = getattr(importlib.import_module(CPU_COMM_MODULE), CPU_COMM_CLASS)
        out["all_gatherv"] = hasattr(comm.__dict__.get("all_gatherv"), PATCH_MARKER)
        out["reduce_scatterv"] = hasattr(comm.__dict__.get("reduce_scatterv"), PATCH_MARKER)
        runner = getattr(importlib.import_module(MOE_RUNNER_MODULE), MOE_RUNNER_CLASS)
        out["dp_opaque_moe"] = hasattr(runner.__dict__.get("_select_forward"), PATCH_MARKER)
    except Exception:  # pragma: no cover - diagnostics only
        pass
    return out
