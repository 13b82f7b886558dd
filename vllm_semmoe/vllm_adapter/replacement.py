"""Apply a placement transparently: the router stays logical, expert ids become physical after top-k.

Logical expert ``e`` of MoE layer ``l`` lives in physical slot ``l2p[l, e]``; vLLM's ``linear``
expert map puts slots ``r*n .. (r+1)*n-1`` on EP rank ``r``, so each rank holds exactly the
experts the placement gives it.

Why this mechanism (and not permuting the gate's output rows, as an earlier version did): a
routing function is exact under re-placement only if it sees the experts in the order it was
trained with. Permuting router logits into physical order keeps plain softmax top-k exact but
breaks every routing function that depends on expert *positions*: grouped top-k
(DeepSeek-V2 ``group_limited_greedy``, DeepSeek-V3 ``noaux_tc``) forms its groups over
consecutive ids, and the correction bias, custom routing functions and zero experts are all
indexed by logical id. vLLM's own EPLB solves the same problem by keeping the router in logical
space and mapping logical → physical ids after top-k selection
(``BaseRouter._select_experts``: compute routing, ``capture_fn(logical ids)``,
``_apply_eplb_mapping``). We do the same with a static one-replica map: the router's
``_apply_eplb_mapping`` step of every MoE layer is followed by ``l2p[ids]``. So

- the gate, its bias, ``e_score_correction_bias`` and whatever computes router logits (inside
  the MoE runner or in the model's own block, as Mixtral, Qwen2-MoE and OLMoE do) stay untouched;
- routing capture (``router.set_capture_fn``) sees logical ids;
- every expert-indexed tensor of the routed experts is loaded into its physical slot: found from
  the layer itself (every parameter of ``RoutedExperts`` whose weight loader takes an
  ``expert_id`` is wrapped to load logical expert ``e`` into slot ``l2p[e]``), so biases,
  quantization scales and zero points move with their expert without a list of names.

Replicas (tables solved with ``--redundant R``): the layers are built with vLLM EPLB's
physical layout, ``N + E*R`` slots (:func:`.compat.redundant_expert_slots`), and the map is
per rank: a router maps each activation to this rank's own copy where it holds one, else to a
copy on a rank the token is sent to anyway, else to one spread over the copies
(:class:`PhysicalIds`; the rule the offline evaluation and ``bench-ep`` count,
:meth:`~vllm_semmoe.core.placement.Placement.serving_device`). That is exact wherever
every rank maps only the tokens it serves (DP ranks route their own requests; the TP shuffle
computes only its scheduled tokens): each activation then names exactly one slot. The
checkpoint's expert ``e`` is loaded into every slot holding a copy of ``e``.

What cannot be exact this way is refused at engine start (:func:`unsupported_reason`): kernels
that route internally from the logits (vLLM's "monolithic" experts), EPLB (its own map),
fused shared experts and redundant slots other than the tables' replicas, routers that do not
use ``BaseRouter``'s select step, and expert-indexed tensors the wrapper cannot reach.

After the weights load, :func:`self_check` routes fixed random hidden vectors through every MoE
layer's router with and without the placement and requires the same logical experts.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from ..core.placement import Placement
from ..kernels.placement_torch import serving_slots
from . import compat
from .config import SemMoEConfigError

logger = logging.getLogger("vllm.semmoe")

#: hidden vectors per MoE layer in the start-up self-check
SELF_CHECK_TOKENS = 64


def moe_runners(model: torch.nn.Module) -> list:
    """The model's MoE layers (vLLM ``MoERunner`` modules) in forward order."""
    runner_class = compat.moe_runner_class()
    return [m for m in model.modules() if isinstance(m, runner_class)]


def check_model_shape(runners: list, num_layers: int, num_experts: int, what: str) -> None:
    """Raise :class:`SemMoEConfigError` if the model's MoE shape differs from ``what``'s."""
    if not runners:
        raise SemMoEConfigError("semmoe: the model has no MoE layers (no vLLM MoERunner found)")
    model_experts = {int(r.routed_experts.moe_config.num_logical_experts) for r in runners}
    problems = []
    if len(runners) != num_layers:
        problems.append(f"{num_layers} MoE layers (model has {len(runners)})")
    if model_experts != {num_experts}:
        problems.append(f"{num_experts} experts per layer (model has {sorted(model_experts)})")
    if problems:
        raise SemMoEConfigError(f"semmoe: {what} built for another model: " + "; ".join(problems))


@dataclass
class LayerPlacement:
    """The placement as installed on one MoE layer.

    Attributes:
        index: MoE-layer index (the trace's / tables' layer axis), in model forward order.
        name: the layer's vLLM name (e.g. ``model.layers.3.mlp.experts``).
        l2p: ``[N]`` int64 tensor on the model's device: physical slot of each logical expert.
        p2l: ``[N]`` int64 array: logical expert in each physical slot.
        params: names of the routed-experts parameters whose loads are re-placed.
        loaded: per such parameter, the physical slots the checkpoint loaded into (on every
            rank; the self-check compares them with this rank's slots).
    """

    index: int
    name: str
    l2p: torch.Tensor
    p2l: np.ndarray
    params: list[str] = field(default_factory=list)
    loaded: dict[str, set[int]] = field(default_factory=dict)


class PhysicalIds:
    """Replaces one router's ``_apply_eplb_mapping``: vLLM's step, then logical → physical.

    Without replicas every logical expert has one slot, ``l2p[e]``. With replicas (``copies``:
    ``[N, C]`` slots of each expert's copies, this layer's
    :meth:`~vllm_semmoe.core.placement.Placement.logical_to_physical_map`) the slot is chosen per
    activation for tokens on ``device`` by the rule the offline evaluation counts
    (:func:`vllm_semmoe.kernels.placement_torch.serving_slots`, property-tested equal to
    :meth:`~vllm_semmoe.core.placement.Placement.serving_device`): the rank's own copy, else a copy
    on a rank the token is sent to anyway, else one spread over the copies. Ids outside
    ``[0, N)`` (none in the routers vLLM 0.32 ships, but a sentinel is cheap to keep) pass
    through unchanged.
    """

    def __init__(self, original, l2p: torch.Tensor, copies: torch.Tensor | None = None, *,
                 experts_per_device: int = 0, ep_size: int = 1, device: int | None = None):
        self.original, self.l2p, self.copies = original, l2p, copies
        self.experts_per_device, self.ep_size, self.device = experts_per_device, ep_size, device
        self.enabled = True

    def __call__(self, topk_ids: torch.Tensor) -> torch.Tensor:
        ids = self.original(topk_ids)
        if not self.enabled:
            return ids
        n = self.l2p.shape[0]
        long = ids.long()
        valid = (long >= 0) & (long < n)
        if self.copies is None:
            mapped = self.l2p.to(long.device)[long.clamp(0, n - 1)]
        else:
            rows = long if long.ndim == 2 else long.reshape(-1, 1)  # [T, K]
            mapped = serving_slots(rows.clamp(0, n - 1), self.copies.to(long.device), self.experts_per_device,
                                   self.ep_size, self.device).reshape(long.shape)
        return torch.where(valid, mapped, long).to(ids.dtype)


def unsupported_reason(model: torch.nn.Module, runner, redundant_slots: int = 0) -> str | None:
    """Why re-placement cannot be exact on this MoE layer (``None``: it can), for a placement
    with ``redundant_slots`` replica slots in all (``E * R``)."""
    experts = runner.routed_experts
    router = runner.router
    quant = experts.quant_method
    strategy = str(getattr(experts, "expert_placement_strategy", "linear")).lower().split(".")[-1]
    if strategy not in ("linear", "none"):
        return f"needs vLLM's linear expert placement, got {strategy!r} (drop --expert-placement-strategy)"
    if not isinstance(router, compat.base_router_class()):
        return f"its router {type(router).__name__} does not select experts through vLLM's BaseRouter"
    # layers built for replica slots read as EPLB's (their empty EPLB state is released first)
    if router.eplb_state is not None or (experts.moe_config.moe_parallel_config.enable_eplb and not redundant_slots):
        return "EPLB is enabled; it keeps its own logical-to-physical map (disable --enable-eplb)"
    if is_monolithic(quant):
        return _MONOLITHIC.format(quant.method_name)
    manager = experts.expert_map_manager
    if getattr(manager, "num_fused_shared_experts", 0):
        return "shared experts are fused into the routed experts' slots"
    extra = int(experts.moe_config.num_experts) - int(experts.moe_config.num_logical_experts)
    if extra != redundant_slots:
        if not extra:
            return (f"the model class does not build vLLM's redundant expert slots (num_redundant_experts), "
                    f"which the tables' {redundant_slots} replica slots need")
        return f"it has {extra} redundant expert slots, the tables {redundant_slots}"
    if experts.quant_config is not None and experts.quant_config.get_name() == "gpt_oss_mxfp4":
        return "its quantization (gpt_oss_mxfp4) loads all experts as one tensor"
    unreachable = [name for name, _ in expert_indexed_tensors(experts, router) if name not in reachable_params(experts)]
    if unreachable:
        return f"expert-indexed tensor(s) {', '.join(unreachable)} are not loaded per expert"
    return None


def release_eplb_layer_state(runners: list, slots: int) -> None:
    """Detach the empty EPLB layer state from the routers of layers built with the placement's
    ``slots`` redundant slots (:func:`.compat.redundant_expert_slots` builds them as for EPLB;
    EPLB itself is off, so nothing ever fills that state, and the placement's map replaces
    EPLB's step). A layer whose EPLB state holds a map was not built that way and is left as it
    is (and refused)."""
    for runner in runners:
        experts, router = runner.routed_experts, runner.router
        built = int(experts.moe_config.num_experts) - int(experts.moe_config.num_logical_experts) == slots
        state = getattr(router, "eplb_state", None)
        if built and state is not None and getattr(state, "logical_to_physical_map", None) is None:
            router.eplb_state = None


_MONOLITHIC = "its MoE kernel ({}) routes internally from the router logits, so expert ids cannot be mapped after top-k"


def is_monolithic(quant) -> bool:
    """Whether the layer's kernel routes by itself; ``False`` while the kernel is not chosen yet
    (the self-check asks again after loading)."""
    try:
        return bool(quant.is_monolithic)
    except AttributeError:  # no experts class selected before process_weights_after_loading
        return False


def expert_indexed_tensors(experts: torch.nn.Module, router) -> list[tuple[str, torch.Tensor]]:
    """Parameters and buffers of the routed experts with one row per (local or global) expert.

    Excluded by identity: the expert-map buffers vLLM registers itself (``_expert_map``,
    ``expert_mask``, the routing tables), which describe the physical layout, not expert data;
    and tensors the router also holds (e.g. DeepSeek-V3's ``e_score_correction_bias``), which
    routing reads in logical order and so must stay logical.
    """
    sizes = {int(experts.local_num_experts), int(experts.global_num_experts)}
    layout = {id(t) for t in (getattr(experts, "_expert_map", None), getattr(experts, "expert_mask", None),
                              *(experts._expert_routing_tables() or ())) if t is not None} | routing_tensor_ids(router)
    found = []
    for name, tensor in [*experts.named_parameters(recurse=False), *experts.named_buffers(recurse=False)]:
        if id(tensor) in layout or tensor.dim() == 0 or int(tensor.shape[0]) not in sizes:
            continue
        found.append((name, tensor))
    return found


def reachable_params(experts: torch.nn.Module) -> set[str]:
    """Names of the routed experts' parameters whose weight loader takes an ``expert_id``."""
    return {name for name, param in experts.named_parameters(recurse=False)
            if "expert_id" in _loader_parameters(getattr(param, "weight_loader", None))}


def routing_tensor_ids(router) -> set[int]:
    """Identities of the tensors a router holds (read in logical expert order)."""
    return {id(t) for t in vars(router).values() if isinstance(t, torch.Tensor)}


def _loader_parameters(loader) -> tuple[str, ...]:
    if loader is None:
        return ()
    try:
        return tuple(inspect.signature(loader).parameters)
    except (TypeError, ValueError):
        return ()


def install_placement(model: torch.nn.Module, runners: list, placement: Placement,
                      token_device: int | None = None) -> list[LayerPlacement]:
    """Map every MoE layer's selected expert ids to physical slots and re-place the expert loads.

    ``token_device``: the device whose copies the routers prefer (replicas; see the module
    docstring), ``None``: home copies. Must run after the model is built (with the
    placement's redundant slots, :func:`.compat.redundant_expert_slots`) and before its
    weights are loaded. Raises
    :class:`SemMoEConfigError` naming the model class and the reason when any layer cannot be
    re-placed exactly. Returns the installed per-layer state (for :func:`self_check`).
    """
    check_model_shape(runners, placement.num_layers, placement.num_experts, "tables")
    slots = placement.num_physical_experts - placement.num_experts
    if slots:
        release_eplb_layer_state(runners, slots)
    reasons = {}
    for runner in runners:
        reason = unsupported_reason(model, runner, slots)
        if reason is not None:
            reasons.setdefault(reason, []).append(runner.layer_name)
    if reasons:
        reason, names = next(iter(reasons.items()))
        raise SemMoEConfigError(
            f"semmoe: cannot re-place experts of {type(model).__name__} exactly: MoE layer "
            f"{names[0]}{f' (and {len(names) - 1} more)' if len(names) > 1 else ''}: {reason}"
        )
    p2l = placement.physical_to_logical()
    l2p = placement.device_map(token_device)
    copies = placement.logical_to_physical_map()  # [L, N, C] every slot of each logical expert
    # the logical expert whose checkpoint weights a loader call for physical slot p carries
    carried = compat.initial_physical_to_logical(placement.num_experts, slots) if slots else None
    installed = []
    for index, runner in enumerate(runners):
        experts = runner.routed_experts
        device = next(experts.parameters()).device
        state = LayerPlacement(index, runner.layer_name, torch.from_numpy(l2p[index].copy()).to(device),
                               p2l[index].copy())
        router = runner.router
        if isinstance(router.__dict__.get("_apply_eplb_mapping"), PhysicalIds):
            raise RuntimeError("semmoe: placement installed twice on the same layer")
        per_activation = torch.from_numpy(copies[index].copy()).to(device) if slots and token_device is not None else None
        router._apply_eplb_mapping = PhysicalIds(router._apply_eplb_mapping, state.l2p, per_activation,
                                                 experts_per_device=placement.experts_per_device,
                                                 ep_size=placement.ep_size, device=token_device)
        targets = [[int(s) for s in row if s >= 0] for row in copies[index]]
        mapping = targets if carried is None else [targets[e] for e in carried]
        logical = routing_tensor_ids(router)
        for name in sorted(n for n in reachable_params(experts) if id(getattr(experts, n)) not in logical):
            state.loaded[name] = set()
            _wrap_loader(getattr(experts, name), mapping, state.loaded[name], f"{runner.layer_name}.{name}")
            state.params.append(name)
        installed.append(state)
    return installed


def _wrap_loader(param, mapping: list[list[int]], loaded: set[int], name: str) -> None:
    """Make ``param``'s loader put the weights it is called with for expert id ``i`` into the
    physical slots ``mapping[i]`` (every copy of that logical expert; recording them in
    ``loaded``). The result is the original loader's for any slot that took the weights."""
    loader = param.weight_loader
    if getattr(loader, "_semmoe_wrapped", False):
        raise RuntimeError("semmoe: placement installed twice on the same layer")
    signature = inspect.signature(loader)

    def wrapped(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        expert = bound.arguments.get("expert_id")
        if not isinstance(expert, (int, np.integer)):
            raise SemMoEConfigError(f"semmoe: {name} is loaded for all experts at once (expert_id={expert!r}); "
                                    "its experts cannot be re-placed")
        if not 0 <= int(expert) < len(mapping):
            return loader(*bound.args, **bound.kwargs)
        results = []
        for slot in mapping[int(expert)]:
            bound.arguments["expert_id"] = slot
            loaded.add(slot)
            results.append(loader(*bound.args, **bound.kwargs))
        return next((r for r in results if r), results[-1] if results else None)

    wrapped._semmoe_wrapped = True
    param.weight_loader = wrapped


# ---- start-up self-check ------------------------------------------------------------------------
def install_self_check(model: torch.nn.Module, runners: list, installed: list[LayerPlacement]) -> None:
    """Run :func:`self_check` once, right before the model's first forward (vLLM's profiling
    run, after the weights are loaded and processed), then remove the hook."""

    def hook(module, args):
        handle.remove()
        self_check(runners, installed, model_class=type(module).__name__)

    handle = model.register_forward_pre_hook(hook)


def self_check(runners: list, installed: list[LayerPlacement], num_tokens: int = SELF_CHECK_TOKENS,
               seed: int = 0, model_class: str = "the model") -> None:
    """Route fixed random hidden vectors through every MoE layer's router with and without the
    placement; raise :class:`SemMoEConfigError` naming the first layer whose logical experts differ.
    Also require that every re-placed parameter was loaded, into every physical slot of this
    rank, through its (wrapped) per-expert loader: a model whose ``load_weights`` copies expert
    tensors whole would otherwise keep them in logical order, silently.

    Router logits come from the layer's gate when it holds one, else from fixed random logits
    (the gate is then in the model's own block and untouched by the placement).
    """
    generator = torch.Generator().manual_seed(seed)
    for runner, state in zip(runners, installed):
        router = runner.router
        mapper = router.__dict__.get("_apply_eplb_mapping")
        if not isinstance(mapper, PhysicalIds):
            raise SemMoEConfigError(f"semmoe self-check: MoE layer {state.name}: the placement's id map is not installed")
        experts = runner.routed_experts
        if is_monolithic(experts.quant_method):
            raise SemMoEConfigError(f"semmoe: cannot re-place experts of {model_class} exactly: MoE layer "
                                    f"{state.name}: " + _MONOLITHIC.format(experts.quant_method.method_name))
        device = state.l2p.device
        num_experts = int(experts.moe_config.num_logical_experts)
        num_slots = int(experts.global_num_experts)
        gate = getattr(runner, "gate", None)
        width = int(getattr(gate, "input_size", 0) or runner.moe_config.hidden_dim)
        hidden = torch.randn(num_tokens, width, generator=generator).to(device)
        with torch.no_grad():
            if gate is not None:
                weight = next((p for p in gate.parameters() if p.dtype.is_floating_point), None)
                logits = gate(hidden.to(weight.dtype if weight is not None else hidden.dtype))[0]
            else:
                logits = torch.randn(num_tokens, num_experts, generator=generator).to(device)
            capture, router.capture_fn = router.capture_fn, None
            try:
                _, physical = router.select_experts(hidden, logits, experts.quant_method.topk_indices_dtype)
                mapper.enabled = False
                try:
                    _, logical = router.select_experts(hidden, logits, experts.quant_method.topk_indices_dtype)
                finally:
                    mapper.enabled = True
            finally:
                router.capture_fn = capture
        local = {slot for slot in range(num_slots) if experts._map_global_expert_id_to_local_expert_id(slot) != -1}
        for name, slots in state.loaded.items():
            if not local <= slots:
                raise SemMoEConfigError(
                    f"semmoe: cannot re-place experts of {model_class} exactly: MoE layer {state.name}: "
                    f"{name} was not loaded into physical slot(s) {sorted(local - slots)[:8]} through its "
                    "per-expert weight loader (the model's load_weights copies expert tensors whole, "
                    "in logical order)")
        physical = physical.long().cpu().numpy()
        logical = logical.long().cpu().numpy()
        if physical.min() < 0 or physical.max() >= num_slots:
            raise SemMoEConfigError(f"semmoe self-check: MoE layer {state.name} selected physical ids "
                                    f"outside [0, {num_slots})")
        back = state.p2l[physical]
        if not np.array_equal(np.sort(back, axis=1), np.sort(logical, axis=1)):
            bad = int((np.sort(back, axis=1) != np.sort(logical, axis=1)).any(axis=1).sum())
            raise SemMoEConfigError(
                f"semmoe self-check: MoE layer {state.name} (index {state.index}) routes {bad} of "
                f"{num_tokens} test vectors to other logical experts under the placement; "
                "re-placement would change the model's output")
    logger.info("semmoe: self-check passed: %d MoE layers route %d test vectors to the same logical "
                "experts with and without the placement", len(installed), num_tokens)


def local_expert_fingerprints(worker) -> list[list[float]]:
    """Per MoE layer, the sum of each local expert's ``w2`` weights on this rank (in local slot
    order); for tests that check which experts a rank loaded. Usable with ``collective_rpc``.
    """
    runner = getattr(worker, "model_runner", worker)
    return [[float(w.float().sum()) for w in layer.routed_experts.w2_weight]
            for layer in moe_runners(runner.get_model())]
