"""Attention-TP with Sem-MoE's token shuffle (``mode: tp``, TP > 1 + expert parallelism).

In vLLM's TP + expert-parallel MoE every rank runs its local experts for *all* B tokens and
the partial outputs are all-reduced. Here instead, per MoE layer and forward step:

1. all ranks compute the same schedule (:class:`vllm_semmoe.core.schedulers.TpScheduler` with the
   Sem-MoE tables, or contiguous equal slices for other tables), i.e. the SRS permutation;
2. rank ``r`` owns its ``ceil(B/E)`` scheduled tokens;
3. activations whose expert is on this rank are computed here; every token is sent once to
   each other rank that holds one of its experts (uneven ``all_to_all_single``), computed
   there, and the partial sums come back (reverse all-to-all).

Two ways to run it, both exactly vLLM's MoE layer:

- **MoE boundary** (any model on vLLM's fused MoE layer, :class:`ShuffledRoutedExperts`): vLLM's
  own ``MoERunner.forward`` runs on the replicated input, so the gate (in the runner or the
  model's block), routing and its capture, shared experts and their gate, the routed scaling
  factor, routed input/output transforms and zero experts are vLLM's code; only the routed
  experts stage is replaced (steps 2-3), returning this rank's rows, and vLLM's final
  all-reduce assembles them. Dense layers (before ``first_k_dense_replace``) are not touched.
- **Fused into the collectives** (:func:`fused_decoder_forward`, only where
  :func:`fusable_runner` recognises the decoder layer, e.g. Qwen3-MoE): the attention's
  unreduced output goes through a shuffled reduce-scatter so rank ``r`` gets the reduced
  rows of its tokens, residual add, norm, gate and routing run on the slice, and the shuffled
  all-gather returns output and residual to every rank in token order (replacing vLLM's two
  all-reduces).

Bytes sent in dispatch and combine and local/remote activations are counted per layer.
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch

from csrc_triton import sag_unpack, srs_pack

from ..core.schedulers import TpScheduler, scheduling_tables
from ..core.tables import SemMoETables
from . import compat
from .ep_dispatch import comm_for, routed_exchange

if TYPE_CHECKING:
    from .capture import RoutingRecorder


class StepContext:
    """What the shuffled MoE layers of one real forward step share.

    Attributes:
        rows: ``[B]`` int64 table row of each token of the step (``-1``: unseen token).
        history: layer -> what the TP decision keeps of that layer's routing in this step
            (:meth:`~vllm_semmoe.core.schedulers.TpScheduler.history`), for the next layers.
        recorder: the engine's routing recorder (``None``: not recording).
        counters: the engine's MoE exchange counters (a dict of :data:`~.state.MOE_COUNTER_KEYS`).
    """

    def __init__(self, tokens: np.ndarray, tables: SemMoETables, recorder: RoutingRecorder | None,
                 counters: dict[str, float]):
        self.rows = tables.token_rows(tokens)
        self.history: dict[int, np.ndarray] = {}
        self.recorder = recorder
        self.counters = counters


class TpShuffleLayer:
    """One MoE layer of the engine's token shuffle: its index, the physical → logical map of its
    placement, and the engine's :class:`~vllm_semmoe.core.schedulers.TpScheduler` (shared by the
    layers; its PyTorch twin on a CUDA device). The decision itself is the scheduler's; this
    keeps what is the engine's: the step's history and rows (the step context), the device the
    activations are on. Counters live in the engine's state and reach the layer through the
    step context.
    """

    def __init__(self, layer: int, tables: SemMoETables, scheduler: TpScheduler | None = None):
        self.layer = layer
        self.tables = tables
        self.scheduler = TpScheduler(scheduling_tables(tables)) if scheduler is None else scheduler
        self.p2l = tables.placement.physical_to_logical()[layer]  # physical slot -> logical expert
        self._on_device: dict = {}  # torch device -> the scheduler's PyTorch twin there

    def schedule(self, step: StepContext, num_tokens: int, ep_size: int, device: torch.device | None = None):
        """``(slot_token, token_slot, capacity)``, identical on every rank.

        With activations on a CUDA ``device`` the decision runs there, in PyTorch ops
        (:meth:`on_device`: the same rule), and the index tensors stay there; otherwise in Numba
        on the host (NumPy arrays).
        """
        scheduler = self.scheduler
        if not scheduler.schedules:  # contiguous slices of the whole batch
            _, slot_token, token_slot, cap = scheduler.decide(self.layer, np.full(num_tokens, -1, np.int64), None,
                                                              ep_size)
            return slot_token, token_slot, cap
        previous = scheduler.previous(self.layer, step.history, num_tokens)
        if device is not None and device.type == "cuda":
            _, slot_token, token_slot, cap = self.on_device(device).decide(self.layer, step.rows, previous, ep_size)
        else:
            _, slot_token, token_slot, cap = scheduler.decide(self.layer, step.rows, previous, ep_size)
        return slot_token, token_slot, cap

    def on_device(self, device: torch.device):
        """The scheduler's PyTorch twin on ``device``
        (:class:`~vllm_semmoe.kernels.scheduling_torch.TorchTpScheduler`, made once per device)."""
        found = self._on_device.get(device)
        if found is None:
            from ..kernels.scheduling_torch import TorchTpScheduler

            found = self._on_device[device] = TorchTpScheduler(self.scheduler, device)
        return found

    def record(self, step: StepContext, physical_ids: np.ndarray, ep_size: int) -> np.ndarray:
        """Keep this layer's routing ``[B, K]`` (physical ids, every token of the step) as the
        next layers' history (:meth:`~vllm_semmoe.core.schedulers.TpScheduler.history`); returns it
        as logical ids (``ep_size``: the EP group's size, as :meth:`schedule` takes it)."""
        logical = self.p2l[physical_ids]
        step.history[self.layer] = self.scheduler.history(self.layer, logical)
        return logical


def _index(indices, device: torch.device) -> torch.Tensor:
    """An index array from :meth:`TpShuffleLayer.schedule` as an int64 tensor on ``device``."""
    if isinstance(indices, torch.Tensor):
        return indices.to(device)
    return torch.from_numpy(np.ascontiguousarray(indices)).to(device)


class ShuffledRoutedExperts:
    """``RoutedExperts.forward_modular`` of one MoE layer on the MoE-boundary path (any model
    built on vLLM's fused MoE layer), installed once with the engine
    (:func:`install_shuffled_experts`).

    vLLM's own ``MoERunner.forward`` runs unchanged on the replicated ``[B, H]`` input (gate or
    the model's router logits, routing with its capture hook, shared experts and their gate, the
    routed scaling factor, input/output transforms, zero experts, the final TP all-reduce); only
    its routed-experts stage is this object. In a real step over the layer's ``B`` tokens (the
    engine's current :class:`StepContext`) it runs :func:`shuffled_routed_experts`: this rank
    computes the complete routed output of *its* scheduled tokens (remote activations through
    the all-to-all) and leaves the other rows zero, so vLLM's final all-reduce, which also sums
    the TP-partial shared-expert output, yields every token's full output on every rank.
    Outside a real step (warm-up, profiling) or on a padded batch it is vLLM's own stage.
    """

    def __init__(self, forward_modular, layer: TpShuffleLayer, state):
        self.forward_modular = forward_modular  # vLLM's, bound to the layer's RoutedExperts
        self.layer = layer
        self._state = weakref.ref(state)

    def step(self, num_tokens: int) -> StepContext | None:
        """The step context when a real step over ``num_tokens`` tokens is running, else ``None``."""
        state = self._state()
        step = None if state is None else state.step
        return step if step is not None and num_tokens == len(step.rows) else None

    def __call__(self, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        step = self.step(x.shape[0])
        if step is None:
            return self.forward_modular(x, topk_weights, topk_ids, shared_experts, shared_experts_input)
        return shuffled_routed_experts(self.forward_modular, self.layer, step, x, topk_weights, topk_ids,
                                       shared_experts, shared_experts_input)


def install_shuffled_experts(runner, layer: TpShuffleLayer, state) -> None:
    """Make :class:`ShuffledRoutedExperts` the routed-experts stage of the MoE layer ``runner`` of
    the engine whose :class:`~.state.EngineState` is ``state`` (held weakly)."""
    experts = runner.routed_experts
    experts.forward_modular = ShuffledRoutedExperts(experts.forward_modular, layer, state)


def shuffled_routed_experts(forward_modular, layer: TpShuffleLayer, step: StepContext, x: torch.Tensor,
                            topk_weights: torch.Tensor, topk_ids: torch.Tensor, shared_experts=None,
                            shared_experts_input=None) -> torch.Tensor:
    """The routed-experts stage of the MoE-boundary path: ``[B, H]`` holding the complete routed
    output of this rank's scheduled tokens, zero elsewhere. ``topk_ids`` are physical ids of
    all ``B`` tokens (vLLM routes every token on every rank)."""
    group = compat.ep_group()
    rank, world = group.rank_in_group, group.world_size
    B = x.shape[0]
    start = time.perf_counter()
    slot_token, _, cap = layer.schedule(step, B, world, x.device)
    step.counters["schedule_s"] += time.perf_counter() - start
    mine = slot_token[rank * cap : (rank + 1) * cap]
    mine = _index(mine[mine >= 0], x.device)
    out_my = routed_exchange(forward_modular, x.index_select(0, mine), topk_weights.index_select(0, mine),
                             topk_ids.index_select(0, mine), group, step.counters, shared_experts,
                             shared_experts_input)
    out = torch.zeros((B, *out_my.shape[1:]), dtype=out_my.dtype, device=out_my.device)
    out.index_copy_(0, mine, out_my)
    start = time.perf_counter()
    all_ids = topk_ids.long().cpu().numpy()
    step.counters["host_sync_s"] += time.perf_counter() - start
    layer.record(step, all_ids, world)
    return out


def fused_decoder_forward(decoder, layer: TpShuffleLayer, positions, hidden_states, residual, step: StepContext):
    """Qwen3-MoE-style decoder layer with the shuffle fused into the collectives.

    The attention's row-parallel output projection is left unreduced; the shuffled
    reduce-scatter (pack by the schedule, reduce-scatter equal slices) gives each rank the
    reduced rows of its tokens; the residual add and norm run on the slice, then the MoE; the
    shuffled all-gather returns MoE output and residual to every rank in token order. This
    replaces vLLM's two all-reduces (attention output, MoE output).
    """
    group, tp = compat.ep_group(), compat.tp_group()
    if residual is None:
        residual = hidden_states
        hidden = decoder.input_layernorm(hidden_states)
    else:
        hidden, residual = decoder.input_layernorm(hidden_states, residual)
    with compat.unreduced(decoder.self_attn.o_proj):
        partial = decoder.self_attn(positions=positions, hidden_states=hidden)
    B = partial.shape[0]
    start = time.perf_counter()
    slot_token, token_slot, cap = layer.schedule(step, B, group.world_size, partial.device)
    step.counters["schedule_s"] += time.perf_counter() - start
    rank = group.rank_in_group
    mine_slots = slot_token[rank * cap : (rank + 1) * cap]
    count = int((mine_slots >= 0).sum())
    device = partial.device
    packed = srs_pack(partial, _index(slot_token, device))  # SRS: pack, reduce-scatter
    reduced = tp.reduce_scatterv(packed, dim=0, sizes=[cap] * group.world_size)[:count]
    residual_my = srs_pack(residual, _index(mine_slots, device))[:count]
    hidden_my, residual_my = decoder.post_attention_layernorm(reduced, residual_my)
    out_my = moe_on_slice(decoder.mlp.experts, layer, hidden_my, step, cap, token_slot, group)
    step.counters["fused_layers_run"] += 1
    inverse = _index(token_slot, device)
    out = sag_unpack(_all_gather_slices(out_my, cap, group, step.counters), inverse)
    residual = sag_unpack(_all_gather_slices(residual_my, cap, group, step.counters), inverse)
    return out, residual


def moe_on_slice(runner, layer: TpShuffleLayer, x_my: torch.Tensor, step: StepContext, cap: int,
                 token_slot, group) -> torch.Tensor:
    """Fused-decoder path: gate and route this rank's tokens (the runner holds its gate, has no
    shared experts, transforms or scaling: see :func:`fusable_runner`), then the routed stage."""
    # the real gate on this rank's slice (capture is fed below, for all tokens, in token order)
    logits, _ = runner.gate(x_my)
    weights, ids = compat.select_experts(runner, x_my, logits)
    out_my = routed_exchange(runner.routed_experts.forward_modular, x_my, weights, ids, group, step.counters)
    device = x_my.device
    full_ids = _all_gather_slices(ids.to(torch.int64), cap, group, step.counters,
                                  key="metadata_bytes").index_select(0, _index(token_slot, device))
    start = time.perf_counter()
    full_ids = full_ids.cpu().numpy()
    step.counters["host_sync_s"] += time.perf_counter() - start
    logical = layer.record(step, full_ids, group.world_size)
    if step.recorder is not None:  # the recorder takes logical ids
        step.recorder.on_layer(layer.layer, torch.from_numpy(logical))
    return out_my


def fusable_runner(decoder, tp_layers: dict):
    """The MoE runner of ``decoder`` when the fused SRS/SAG forward computes exactly what vLLM
    does there, else ``None``. Recognised structure: a decoder layer made only of
    ``input_layernorm``, ``self_attn`` (with a row-parallel ``o_proj``), ``post_attention_layernorm``
    and ``mlp``, whose only parameters are those of ``mlp.experts``, a shuffled MoE runner that
    holds its gate (a layer of ``tp_layers``, name -> :class:`TpShuffleLayer`) and has no shared experts, routed transforms, scaling factor or zero experts,
    without sequence parallelism. (Qwen3-MoE's decoder layer is one; DeepSeek's, with shared
    experts, and Mixtral's, whose router is outside the runner, are not and keep the
    MoE-boundary path, which runs vLLM's whole MoE layer.)"""
    mlp, attn = getattr(decoder, "mlp", None), getattr(decoder, "self_attn", None)
    runner = getattr(mlp, "experts", None)
    if getattr(runner, "layer_name", None) not in tp_layers \
            or not hasattr(getattr(attn, "o_proj", None), "reduce_results"):
        return None
    if {name for name, child in decoder.named_children() if any(True for _ in child.parameters())} \
            - {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}:
        return None
    experts_params = {id(p) for p in runner.parameters()}
    if any(id(p) not in experts_params for p in mlp.parameters()):
        return None
    if (runner.gate is None or runner.shared_experts is not None or runner.routed_input_transform is not None
            or runner.routed_output_transform is not None or runner.routed_scaling_factor != 1.0
            or isinstance(runner.router, compat.zero_expert_router_class()) or runner.moe_config.is_sequence_parallel
            or getattr(mlp, "is_sequence_parallel", False)):
        return None
    return runner


def _all_gather_slices(rows: torch.Tensor, cap: int, group, counters: dict,
                       key: str = "allgather_bytes") -> torch.Tensor:
    """Pad this rank's rows to ``cap`` and all-gather: ``[E * cap, ...]`` in slot order (bytes
    counted under ``key``, as a ring sends them: ``E - 1`` times the padded slice)."""
    import torch.distributed as dist

    padded = torch.zeros((cap, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    padded[: rows.shape[0]] = rows
    counters[key] += (group.world_size - 1) * padded.numel() * padded.element_size()
    parts = [torch.empty_like(padded) for _ in range(group.world_size)]
    dist.all_gather(parts, padded, group=comm_for(group, rows.device))
    return torch.cat(parts)
