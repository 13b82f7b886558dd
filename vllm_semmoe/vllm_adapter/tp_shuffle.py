"""Attention-TP with Sem-MoE's token shuffle (``mode: tp``, TP > 1 + expert parallelism).

In vLLM's TP + expert-parallel MoE every rank runs its local experts for *all* B tokens and
the partial outputs are all-reduced. Here instead, per MoE layer and forward step:

1. all ranks compute the same schedule (:func:`vllm_semmoe.scheduling.tp_schedule` with the
   Sem-MoE tables, or contiguous equal slices for other tables), i.e. the SRS permutation;
2. rank ``r`` gets the reduced rows of its ``ceil(B/E)`` tokens: in Qwen3-MoE-style decoder
   layers by a shuffled reduce-scatter of the attention's unreduced output
   (:func:`fused_decoder_forward`, residual add and norm then run on the slice), elsewhere by
   taking its rows of vLLM's all-reduced input (:func:`shuffled_moe_forward`); it runs the
   real gate on them;
3. activations whose expert is on this rank are computed here; every token is sent once to
   each other rank that holds one of its experts (uneven ``all_to_all_single``), computed
   there, and the partial sums come back (reverse all-to-all);
4. the shuffled all-gather collects all slices (and, when fused, the residual) and applies the
   inverse permutation, so every rank again holds ``[B, H]`` in token order.

Bytes sent in dispatch and combine and local/remote activations are counted per layer.
"""

from __future__ import annotations

import numpy as np
import torch

from csrc_triton import sag_unpack, srs_pack

from .. import scheduling
from ..tables import SemMoETables

#: set by the model-runner hook for the duration of one real forward step
STEP: "StepContext | None" = None


class StepContext:
    """What the MoE layers of one forward step share: token rows and the routing so far."""

    def __init__(self, tokens: np.ndarray, tables: SemMoETables, recorder):
        self.rows = tables.token_rows(tokens)
        self.major: dict[int, np.ndarray] = {}  # layer -> [B] device holding most experts
        self.recorder = recorder


class TpShuffleLayer:
    """Per-MoE-layer state: its index, the tables, and byte/activation counters."""

    counters = {"dispatch_bytes": 0, "combine_bytes": 0, "local_activations": 0,
                "remote_activations": 0, "tokens": 0, "layers_run": 0, "fused_layers_run": 0}

    def __init__(self, layer: int, tables: SemMoETables):
        self.layer = layer
        self.tables = tables
        self.shuffle = tables.placement.method == "semmoe"
        self.t2d = tables.t2d_score[layer].astype(np.float32)
        self.p2l = tables.placement.physical_to_logical()[layer]

    def schedule(self, step: StepContext, num_tokens: int, ep_size: int):
        """``(slot_token, token_slot, capacity)``, identical on every rank."""
        cap = scheduling.slice_capacity(num_tokens, ep_size)
        if self.shuffle:
            history = np.full(num_tokens, -1, np.int64)
            if self.layer >= 2 and (self.layer - 1) in step.major and (self.layer - 2) in step.major:
                history = step.major[self.layer - 2] * ep_size + step.major[self.layer - 1]
            _, slot_token, token_slot = scheduling.tp_schedule(
                step.rows, history, self.t2d, self.tables.oov_score[self.layer],
                self.tables.markov[self.layer], ep_size)
        else:
            device = scheduling.contiguous_slices(num_tokens, ep_size)
            slot_token, token_slot = scheduling.shuffle_permutation(device, ep_size, cap)
        return slot_token, token_slot, cap


def shuffled_moe_forward(runner, layer: TpShuffleLayer, hidden_states: torch.Tensor, step: StepContext):
    """MoE-boundary variant (any model): take this rank's slice of the replicated input, run
    :func:`moe_on_slice`, and restore ``[B, H]`` with the shuffled all-gather."""
    from vllm.distributed.parallel_state import get_ep_group

    group = get_ep_group()
    B = hidden_states.shape[0]
    slot_token, token_slot, cap = layer.schedule(step, B, group.world_size)
    mine_slots = slot_token[group.rank_in_group * cap : (group.rank_in_group + 1) * cap]
    count = int((mine_slots >= 0).sum())
    device = hidden_states.device
    x_my = srs_pack(hidden_states, torch.from_numpy(mine_slots.copy()).to(device))[:count]
    out_my = moe_on_slice(runner, layer, x_my, step, cap, token_slot, group)
    return sag_unpack(_all_gather_slices(out_my, cap, group), torch.from_numpy(token_slot).to(device))


def fused_decoder_forward(decoder, layer: TpShuffleLayer, positions, hidden_states, residual, step: StepContext):
    """Qwen3-MoE-style decoder layer with the shuffle fused into the collectives.

    The attention's row-parallel output projection is left unreduced; the shuffled
    reduce-scatter (pack by the schedule, reduce-scatter equal slices) gives each rank the
    reduced rows of its tokens; the residual add and norm run on the slice, then the MoE; the
    shuffled all-gather returns MoE output and residual to every rank in token order. This
    replaces vLLM's two all-reduces (attention output, MoE output).
    """
    from vllm.distributed.parallel_state import get_ep_group, get_tp_group

    group, tp = get_ep_group(), get_tp_group()
    if residual is None:
        residual = hidden_states
        hidden = decoder.input_layernorm(hidden_states)
    else:
        hidden, residual = decoder.input_layernorm(hidden_states, residual)
    o_proj = decoder.self_attn.o_proj
    o_proj.reduce_results = False
    try:
        partial = decoder.self_attn(positions=positions, hidden_states=hidden)
    finally:
        o_proj.reduce_results = True
    B = partial.shape[0]
    slot_token, token_slot, cap = layer.schedule(step, B, group.world_size)
    rank = group.rank_in_group
    mine_slots = slot_token[rank * cap : (rank + 1) * cap]
    count = int((mine_slots >= 0).sum())
    device = partial.device
    packed = srs_pack(partial, torch.from_numpy(slot_token).to(device))  # SRS: pack, reduce-scatter
    reduced = tp.reduce_scatterv(packed, dim=0, sizes=[cap] * group.world_size)[:count]
    residual_my = srs_pack(residual, torch.from_numpy(mine_slots.copy()).to(device))[:count]
    hidden_my, residual_my = decoder.post_attention_layernorm(reduced, residual_my)
    out_my = moe_on_slice(decoder.mlp.experts, layer, hidden_my, step, cap, token_slot, group)
    TpShuffleLayer.counters["fused_layers_run"] += 1
    inverse = torch.from_numpy(token_slot).to(device)
    out = sag_unpack(_all_gather_slices(out_my, cap, group), inverse)
    residual = sag_unpack(_all_gather_slices(residual_my, cap, group), inverse)
    return out, residual


def moe_on_slice(runner, layer: TpShuffleLayer, x_my: torch.Tensor, step: StepContext, cap: int,
                 token_slot: np.ndarray, group) -> torch.Tensor:
    """Gate this rank's tokens, move only remotely-routed ones, return their MoE output rows."""
    import torch.distributed as dist

    rank, world = group.rank_in_group, group.world_size
    experts = runner.routed_experts
    n_local = int(experts.global_num_experts) // world
    H = x_my.shape[1]

    # the real gate on this rank's slice (capture is fed below, for all tokens, in token order)
    capture, runner.router.capture_fn = runner.router.capture_fn, None
    try:
        logits, _ = runner.gate(x_my)
        weights, ids = runner.router.select_experts(
            hidden_states=x_my, router_logits=logits,
            topk_indices_dtype=runner._quant_method.topk_indices_dtype)
    finally:
        runner.router.capture_fn = capture
    dest = (ids.long() // n_local).cpu().numpy()  # [m, K] rank holding each chosen expert
    device = x_my.device

    # dispatch: each token once to every other rank holding one of its experts
    send_index = [np.nonzero((dest == s).any(axis=1))[0] if s != rank else np.zeros(0, np.int64)
                  for s in range(world)]
    send_counts = torch.tensor([len(i) for i in send_index], dtype=torch.int64, device=device)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=_comm(group, device))
    order = torch.from_numpy(np.concatenate(send_index).astype(np.int64)).to(device)
    sends, recvs = send_counts.tolist(), recv_counts.tolist()
    recv_x = _exchange(x_my.index_select(0, order), recvs, sends, group)
    recv_ids = _exchange(ids.index_select(0, order).to(torch.int64), recvs, sends, group)
    recv_w = _exchange(weights.index_select(0, order).float(), recvs, sends, group)

    # experts: this rank's experts for its own tokens and for the rows it received
    local_out = experts.forward_modular(x_my, weights, ids)
    remote_out = experts.forward_modular(recv_x, recv_w.to(weights.dtype), recv_ids.to(ids.dtype)) \
        if recv_x.shape[0] else recv_x
    back = _exchange(remote_out, sends, recvs, group)  # combine: partial sums home
    out_my = local_out.index_add(0, order, back) if order.numel() else local_out

    full_ids = _all_gather_slices(ids.to(torch.int64), cap, group).index_select(
        0, torch.from_numpy(token_slot).to(device)).cpu()
    local = int((dest == rank).sum())
    row_bytes = H * x_my.element_size()
    counters = TpShuffleLayer.counters
    counters["dispatch_bytes"] += sum(sends) * row_bytes
    counters["combine_bytes"] += sum(recvs) * row_bytes
    counters["local_activations"] += local
    counters["remote_activations"] += dest.size - local
    counters["tokens"] += x_my.shape[0]
    counters["layers_run"] += 1
    majority = np.stack([(full_ids.numpy() // n_local == d).sum(axis=1) for d in range(world)], axis=1)
    step.major[layer.layer] = np.argmax(majority, axis=1)
    if step.recorder is not None:  # the recorder takes logical ids
        step.recorder.on_layer(layer.layer, torch.from_numpy(layer.p2l[full_ids.numpy()]))
    return out_my


def _exchange(tensor: torch.Tensor, recv_counts: list[int], send_counts: list[int], group) -> torch.Tensor:
    """Uneven all-to-all of rows (``tensor`` rows ordered by destination)."""
    import torch.distributed as dist

    out = torch.empty((sum(recv_counts), *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    dist.all_to_all_single(out, tensor.contiguous(), recv_counts, send_counts, group=_comm(group, tensor.device))
    return out


def _all_gather_slices(rows: torch.Tensor, cap: int, group) -> torch.Tensor:
    """Pad this rank's rows to ``cap`` and all-gather: ``[E * cap, ...]`` in slot order."""
    import torch.distributed as dist

    padded = torch.zeros((cap, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    padded[: rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in range(group.world_size)]
    dist.all_gather(parts, padded, group=_comm(group, rows.device))
    return torch.cat(parts)


def _comm(group, device: torch.device):
    """NCCL (the device group) for accelerator tensors, gloo (the CPU group) for CPU tensors."""
    return group.cpu_group if device.type == "cpu" else group.device_group
