"""Attention-TP with Sem-MoE's token shuffle (``mode: tp``, TP > 1 + expert parallelism).

In vLLM's TP + expert-parallel MoE every rank runs its local experts for *all* B tokens and
the partial outputs are all-reduced. Here instead, per MoE layer and forward step:

1. all ranks compute the same schedule (:func:`vllm_semmoe.core.scheduling.tp_schedule` with the
   Sem-MoE tables, or contiguous equal slices for other tables), i.e. the SRS permutation;
2. rank ``r`` owns its ``ceil(B/E)`` scheduled tokens;
3. activations whose expert is on this rank are computed here; every token is sent once to
   each other rank that holds one of its experts (uneven ``all_to_all_single``), computed
   there, and the partial sums come back (reverse all-to-all).

Two ways to run it, both exactly vLLM's MoE layer:

- **MoE boundary** (any model on vLLM's fused MoE layer, :func:`shuffled_moe_forward`): vLLM's
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
from typing import TYPE_CHECKING

import numpy as np
import torch

from csrc_triton import sag_unpack, srs_pack

from ..core import scheduling
from ..core.tables import SemMoETables
from . import compat
from .ep_dispatch import comm_for, routed_exchange

if TYPE_CHECKING:
    from .capture import RoutingRecorder


class StepContext:
    """What the shuffled MoE layers of one real forward step share.

    Attributes:
        rows: ``[B]`` int64 table row of each token of the step (``-1``: unseen token).
        experts: layer -> ``[B, K]`` logical experts of each token (TP-shuffle history).
        major: layer -> ``[B]`` EP rank holding most of each token's experts (the history of
            tables without the X table).
        recorder: the engine's routing recorder (``None``: not recording).
        counters: the engine's MoE exchange counters (a dict of :data:`~.state.MOE_COUNTER_KEYS`).
    """

    def __init__(self, tokens: np.ndarray, tables: SemMoETables, recorder: RoutingRecorder | None,
                 counters: dict[str, float]):
        self.rows = tables.token_rows(tokens)
        self.experts: dict[int, np.ndarray] = {}
        self.major: dict[int, np.ndarray] = {}
        self.recorder = recorder
        self.counters = counters


class TpShuffleLayer:
    """Per-MoE-layer state: its index and the tables (counters live in the engine's state and
    reach the layer through the step context).

    The decision conditions on T2D and, where the tables have the X table, on the experts each
    token activated at the two previous MoE layers (:func:`.scheduling.tp_expert_scores`; those
    layers' routing is in the step context); older tables use the A table over the previous
    layers' majority devices (:func:`.scheduling.tp_layer_scores`).
    """

    def __init__(self, layer: int, tables: SemMoETables):
        self.layer = layer
        self.tables = tables
        self.shuffle = tables.placement.method == "semmoe"
        self.t2d = tables.t2d_score[layer].astype(np.float32)
        self.p2l = tables.placement.physical_to_logical()[layer]  # physical slot -> logical expert
        self.home = tables.placement.logical_to_physical()[layer]  # logical expert -> home slot
        self.uses_experts = tables.transition is not None
        if self.uses_experts:
            self.evidence = tables.log_evidence()[layer]  # [2, N, N] (computed once per tables)
            self.log_prior = tables.log_expert_prior()[layer]
            self.holds = tables.placement.holds()[layer].astype(np.float32)  # [N, E]
            self.weights = np.asarray(scheduling.TP_EVIDENCE_WEIGHTS, np.float64)
        self._device_tables: dict = {}  # device -> tables as tensors for on-device decisions

    def schedule(self, step: StepContext, num_tokens: int, ep_size: int, device: torch.device | None = None):
        """``(slot_token, token_slot, capacity)``, identical on every rank.

        With activations on a CUDA ``device`` the decision runs there, in PyTorch ops
        (:func:`_schedule_on_device`: the same rule), and the index tensors stay there;
        otherwise in Numba on the host (NumPy arrays).
        """
        if self.shuffle and device is not None and device.type == "cuda":
            return self._schedule_on_device(step, num_tokens, ep_size, device)
        cap = scheduling.slice_capacity(num_tokens, ep_size)
        if self.shuffle:
            if self.uses_experts:
                scores = scheduling.tp_expert_scores(
                    step.rows, self.previous_experts(step, num_tokens), self.t2d, self.tables.oov_score[self.layer],
                    self.evidence, self.log_prior, self.holds, self.weights)
            else:
                scores = scheduling.tp_layer_scores(
                    step.rows, self._history(step, num_tokens, ep_size), self.t2d, self.tables.oov_score[self.layer],
                    self.tables.markov[self.layer], scheduling.COMBINE_PRODUCT)
            _, slot_token, token_slot = scheduling.tp_decide(scores, ep_size)
        else:
            device = scheduling.contiguous_slices(num_tokens, ep_size)
            slot_token, token_slot = scheduling.shuffle_permutation(device, ep_size, cap)
        return slot_token, token_slot, cap

    def record(self, step: StepContext, physical_ids: np.ndarray, ep_size: int) -> np.ndarray:
        """Keep this layer's routing ``[B, K]`` (physical ids, every token of the step) as history
        for the next layers' decisions; returns it as logical ids."""
        logical = self.p2l[physical_ids]
        if self.uses_experts:
            step.experts[self.layer] = logical
        else:  # home copies: with replicas, ranks map other ranks' tokens to their own copies
            step.major[self.layer] = _majority(self.home[logical], len(self.p2l) // ep_size, ep_size)
        return logical

    def previous_experts(self, step: StepContext, num_tokens: int) -> np.ndarray:
        """``[B, 2, K]`` logical experts of every token at the two previous MoE layers (``-1``:
        not routed in this step, e.g. before the first layer)."""
        prev = np.full((num_tokens, 2, self.tables.top_k), -1, np.int64)
        for j in (1, 2):
            ids = step.experts.get(self.layer - j)
            if ids is not None and ids.shape == prev[:, j - 1].shape:
                prev[:, j - 1] = ids
        return prev

    def _history(self, step: StepContext, num_tokens: int, ep_size: int) -> np.ndarray:
        """``[B]`` ``d2 * E + d1`` of the two previous layers' majority devices (``-1``: unknown)."""
        if self.layer >= 2 and (self.layer - 1) in step.major and (self.layer - 2) in step.major:
            return step.major[self.layer - 2] * ep_size + step.major[self.layer - 1]
        return np.full(num_tokens, -1, np.int64)

    def _schedule_on_device(self, step: StepContext, num_tokens: int, ep_size: int, device: torch.device):
        """:meth:`schedule` in PyTorch ops on ``device`` (index tensors returned there)."""
        from ..kernels import scheduling_torch

        tables = self._device_tables.get(device)
        if tables is None:
            arrays = ((self.t2d, self.tables.oov_score[self.layer], self.evidence, self.log_prior, self.holds)
                      if self.uses_experts else
                      (self.t2d, self.tables.oov_score[self.layer], self.tables.markov[self.layer]))
            tables = self._device_tables[device] = tuple(
                torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays)
        rows = torch.from_numpy(step.rows).to(device, non_blocking=True)
        if self.uses_experts:
            prev = torch.from_numpy(self.previous_experts(step, num_tokens)).to(device)
            t2d, oov, evidence, log_prior, holds = tables
            scores = scheduling_torch.tp_expert_scores(rows, prev, t2d, oov, evidence, log_prior, holds,
                                                       tuple(self.weights))
        else:
            history = torch.from_numpy(np.asarray(self._history(step, num_tokens, ep_size), np.int64)).to(device)
            scores = scheduling_torch.tp_layer_scores(rows, history, *tables)
        _, slot_token, token_slot = scheduling_torch.tp_decide(scores, ep_size)
        return slot_token, token_slot, scheduling.slice_capacity(num_tokens, ep_size)


def _index(indices, device: torch.device) -> torch.Tensor:
    """An index array from :meth:`TpShuffleLayer.schedule` as an int64 tensor on ``device``."""
    if isinstance(indices, torch.Tensor):
        return indices.to(device)
    return torch.from_numpy(np.ascontiguousarray(indices)).to(device)


def shuffled_moe_forward(runner, layer: TpShuffleLayer, moe_forward, step: StepContext, hidden_states,
                         router_logits, *args, **kwargs):
    """MoE-boundary variant (any model built on vLLM's fused MoE layer): vLLM's own
    ``MoERunner.forward`` runs unchanged on the replicated ``[B, H]`` input (gate or the model's
    router logits, routing with its capture hook, shared experts and their gate, the routed
    scaling factor, input/output transforms, zero experts, the final TP all-reduce); only its
    routed-experts stage is replaced by :func:`shuffled_routed_experts`: this rank computes the
    complete routed output of *its* scheduled tokens (remote activations through the
    all-to-all) and leaves the other rows zero, so vLLM's final all-reduce, which also sums the
    TP-partial shared-expert output, yields every token's full output on every rank.
    """
    experts = runner.routed_experts
    original = experts.forward_modular

    def routed(x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        return shuffled_routed_experts(original, layer, step, x, topk_weights, topk_ids,
                                       shared_experts, shared_experts_input)

    experts.forward_modular = routed
    try:
        return moe_forward(runner, hidden_states, router_logits, *args, **kwargs)
    finally:
        del experts.forward_modular


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


def _majority(ids: np.ndarray, n_local: int, world: int) -> np.ndarray:
    """``[B]``: the EP rank holding most of each token's chosen (physical) experts."""
    return np.argmax(np.stack([(ids // n_local == d).sum(axis=1) for d in range(world)], axis=1), axis=1)


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
    from vllm.model_executor.layers.fused_moe.router.zero_expert_router import ZeroExpertRouter

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
            or isinstance(runner.router, ZeroExpertRouter) or runner.moe_config.is_sequence_parallel
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
