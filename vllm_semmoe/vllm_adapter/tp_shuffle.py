"""Attention-TP with Sem-MoE's shuffle, at the MoE-layer boundary (``mode: tp``, TP > 1 + EP).

In vLLM's TP + expert-parallel MoE every rank runs its local experts for *all* B tokens and
the partial outputs are all-reduced. Here instead, per MoE layer and forward step:

1. all ranks compute the same schedule (:func:`vllm_semmoe.scheduling.tp_schedule` with the
   Sem-MoE tables, or contiguous equal slices for other tables), i.e. the SRS permutation;
2. rank ``r`` takes its slice of ``ceil(B/E)`` tokens (the shuffled reduce-scatter's output;
   vLLM has already all-reduced the attention output, so taking rows is all it needs — fusing
   the shuffle into that reduction is the next step) and runs the real gate on it;
3. activations whose expert is on this rank are computed here; every token is sent once to
   each other rank that holds one of its experts (uneven ``all_to_all_single``), computed
   there, and the partial sums come back (reverse all-to-all);
4. the shuffled all-gather collects all slices and applies the inverse permutation, so every
   rank again holds ``[B, H]`` in token order, as the all-reduce would have produced.

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
                "remote_activations": 0, "tokens": 0, "layers_run": 0}

    def __init__(self, layer: int, tables: SemMoETables):
        self.layer = layer
        self.tables = tables
        self.shuffle = tables.placement.method == "semmoe"
        self.t2d = tables.t2d_score[layer].astype(np.float32)

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
            device = np.arange(num_tokens) // cap
            slot_token, token_slot = scheduling.shuffle_permutation(device, ep_size, cap)
        return slot_token, token_slot, cap


def shuffled_moe_forward(runner, layer: TpShuffleLayer, hidden_states: torch.Tensor, step: StepContext):
    """The MoE layer as described in the module docstring; returns the reduced ``[B, H]``."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_ep_group

    group = get_ep_group()
    rank, world = group.rank_in_group, group.world_size
    experts = runner.routed_experts
    n_local = int(experts.global_num_experts) // world
    x = hidden_states
    B, H = x.shape
    slot_token, token_slot, cap = layer.schedule(step, B, world)
    mine_slots = slot_token[rank * cap : (rank + 1) * cap]
    mine = torch.from_numpy(mine_slots[mine_slots >= 0].copy())
    # SRS: this rank's slice, packed by the Triton kernel on GPUs (PyTorch reference on CPU)
    x_my = srs_pack(x, torch.from_numpy(mine_slots.copy()))[: mine.numel()]

    # the real gate on this rank's slice (capture is fed below, for all tokens, in token order)
    capture, runner.router.capture_fn = runner.router.capture_fn, None
    try:
        logits, _ = runner.gate(x_my)
        weights, ids = runner.router.select_experts(
            hidden_states=x_my, router_logits=logits,
            topk_indices_dtype=runner._quant_method.topk_indices_dtype)
    finally:
        runner.router.capture_fn = capture
    dest = (ids.long() // n_local).numpy()  # [m, K] rank holding each chosen expert

    # dispatch: each token once to every other rank holding one of its experts
    send_index = [np.nonzero((dest == s).any(axis=1))[0] if s != rank else np.zeros(0, np.int64)
                  for s in range(world)]
    send_counts = torch.tensor([len(i) for i in send_index], dtype=torch.int64)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group.cpu_group)
    order = torch.from_numpy(np.concatenate(send_index).astype(np.int64))
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

    # shuffled all-gather: slices in slot order, then the inverse permutation
    inverse = torch.from_numpy(token_slot)
    out = sag_unpack(_all_gather_slices(out_my, cap, group), inverse)
    full_ids = _all_gather_slices(ids.to(torch.int64), cap, group).index_select(0, inverse)

    local = int((dest == rank).sum())
    row_bytes = H * x.element_size()
    counters = TpShuffleLayer.counters
    counters["dispatch_bytes"] += sum(sends) * row_bytes
    counters["combine_bytes"] += sum(recvs) * row_bytes
    counters["local_activations"] += local
    counters["remote_activations"] += dest.size - local
    counters["tokens"] += len(mine)
    counters["layers_run"] += 1

    majority = np.stack([(full_ids.numpy() // n_local == d).sum(axis=1) for d in range(world)], axis=1)
    step.major[layer.layer] = np.argmax(majority, axis=1)
    if step.recorder is not None:
        step.recorder.on_layer(layer.layer, full_ids)
    return out


def _exchange(tensor: torch.Tensor, recv_counts: list[int], send_counts: list[int], group) -> torch.Tensor:
    """Uneven all-to-all of rows (``tensor`` rows ordered by destination)."""
    import torch.distributed as dist

    out = torch.empty((sum(recv_counts), *tensor.shape[1:]), dtype=tensor.dtype)
    dist.all_to_all_single(out, tensor.contiguous(), recv_counts, send_counts, group=group.cpu_group)
    return out


def _all_gather_slices(rows: torch.Tensor, cap: int, group) -> torch.Tensor:
    """Pad this rank's rows to ``cap`` and all-gather: ``[E * cap, ...]`` in slot order."""
    import torch.distributed as dist

    padded = torch.zeros((cap, *rows.shape[1:]), dtype=rows.dtype)
    padded[: rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in range(group.world_size)]
    dist.all_gather(parts, padded, group=group.cpu_group)
    return torch.cat(parts)
