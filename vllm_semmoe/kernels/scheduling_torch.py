"""The Attention-TP decision of :mod:`vllm_semmoe.core.scheduling` on an accelerator's tensors: the
same device per token and the same permutation as the Numba code (property-tested), computed
where the activations are, without copying the batch to the host.

On Triton tensors (CUDA, or any device under ``TRITON_INTERPRET=1``; :func:`csrc_triton.shuffle.uses_triton`)
a decision is three launches and no host read, so it can be captured in a CUDA graph: the
scores (:mod:`csrc_triton.scores`, one kernel per rule), the price rounds with their repair
(:func:`csrc_triton.align.align_rounds`, one program), and the device grouping
(:func:`csrc_triton.shuffle.device_grouping`). Elsewhere the same rules run as PyTorch ops, the
repair (only when the prices leave a device over capacity) on the host in Numba.

For the A-table rule (:func:`tp_layer_scores`) operation order and precision follow the Numba
functions (float32 products, float64 sums and prices, first index on ties), so the results are
identical, not merely close. The X-table rule (:func:`tp_expert_scores`) takes logarithms and
exponentials, which the device and Numba round differently in the last bits: its scores agree to
float32 rounding, and the decision equals Numba's wherever no two choices are that close
(property-tested); every rank runs the same implementation on the same inputs, so ranks agree.
:class:`TorchTpScheduler` is :class:`vllm_semmoe.core.schedulers.TpScheduler` on these
operations (what the engine's token shuffle decides with on CUDA).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from csrc_triton import align as align_kernel
from csrc_triton import scores as scores_kernel
from csrc_triton import shuffle

from ..core.scheduling import COMBINE_PRODUCT, repair_unit, slice_capacity
from ..core.schedulers import TpScheduler

ROUNDS = 40  # price rounds of :func:`vllm_semmoe.core.scheduling.align`


def tp_layer_scores(rows: torch.Tensor, history: torch.Tensor, t2d_layer: torch.Tensor, oov_layer: torch.Tensor,
                    markov_layer: torch.Tensor, combine: int = COMBINE_PRODUCT) -> torch.Tensor:
    """``[B, E]`` float32 device scores, as :func:`vllm_semmoe.core.scheduling.tp_layer_scores`.

    Args:
        rows: ``[B]`` int64 (``-1``: unseen); history: ``[B]`` int64 (``-1``: unknown);
        t2d_layer: ``[J, E]`` float32; oov_layer: ``[E]`` float32; markov_layer: ``[E*E, E]``.
    """
    if shuffle.uses_triton(rows):
        f32 = torch.float32
        return scores_kernel.layer_scores(rows, history, t2d_layer.to(f32), oov_layer.to(f32), markov_layer.to(f32),
                                          combine)
    oov32 = oov_layer.to(torch.float32)
    base = torch.where((rows >= 0)[:, None], t2d_layer.to(torch.float32)[rows.clamp_min(0)], oov32[None, :])
    known = history >= 0
    markov = markov_layer[history.clamp_min(0)]
    if combine == COMBINE_PRODUCT:
        product = (base * markov.to(torch.float32)).to(torch.float64)
        scaled = (product / oov32.to(torch.float64).clamp_min(1e-9)).to(torch.float32)
        total = torch.zeros(scaled.shape[0], dtype=torch.float64, device=scaled.device)
        for e in range(scaled.shape[1]):  # sequential float64 sum, as Numba adds them
            total = total + scaled[:, e].to(torch.float64)
        normalised = (scaled.to(torch.float64) / total.clamp_min(1e-30)[:, None]).to(torch.float32)
        return torch.where(known[:, None], normalised, base)
    markov32 = markov.to(torch.float32)
    use_markov = known & (markov32.amax(dim=1) > base.amax(dim=1))
    return torch.where(use_markov[:, None], markov32, base)


def tp_expert_scores(rows: torch.Tensor, prev: torch.Tensor, t2d_layer: torch.Tensor, oov_layer: torch.Tensor,
                     log_evidence: torch.Tensor, log_prior: torch.Tensor, holds: torch.Tensor,
                     weights: tuple[float, float, float]) -> torch.Tensor:
    """``[B, E]`` float32 device scores, as :func:`vllm_semmoe.core.scheduling.tp_expert_scores`.

    Args:
        rows: ``[B]`` int64 (``-1``: unseen); prev: ``[B, 2, K]`` int64 logical experts at the two
        previous layers (``-1``: unknown); t2d_layer ``[J, E]``; oov_layer ``[E]``;
        log_evidence ``[2, N, N]``; log_prior ``[N]``; holds ``[N, E]`` (float32 tables);
        weights: 3 floats, or a ``[3]`` float64 tensor on the tables' device.
    """
    if shuffle.uses_triton(rows):
        f32 = torch.float32
        return scores_kernel.expert_scores(rows, prev, t2d_layer.to(f32), oov_layer.to(f32), log_evidence.to(f32),
                                           log_prior.to(f32), holds.to(f32), _weights(weights, rows.device))
    oov = oov_layer.to(torch.float64)
    base = torch.where((rows >= 0)[:, None], t2d_layer.to(torch.float64)[rows.clamp_min(0)], oov[None, :])
    logs = weights[0] * torch.log(base.clamp_min(1e-9))
    q = log_prior.to(torch.float64)[None, :].expand(prev.shape[0], -1).clone()
    evidence = log_evidence.to(torch.float64)
    for j in range(prev.shape[1]):
        ids = prev[:, j]  # [B, K]
        contribution = evidence[j][ids.clamp_min(0)] * (ids >= 0)[:, :, None]  # [B, K, N]
        q = q + weights[1 + j] * contribution.sum(dim=1)
    q = torch.exp(q - q.amax(dim=1, keepdim=True))
    local = (q @ holds.to(torch.float64)) / q.sum(dim=1, keepdim=True)
    known = (prev >= 0).flatten(1).any(dim=1)
    logs = logs + known[:, None] * torch.log(local.clamp_min(1e-9) / oov.clamp_min(1e-9)[None, :])
    return torch.softmax(logs, dim=1).to(torch.float32)


@functools.lru_cache(maxsize=None)
def _weights_on(weights: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """``[3]`` float64 X-rule weights on ``device`` (made once per weights and device: no copy per call)."""
    return torch.tensor(weights, dtype=torch.float64, device=device)


def _weights(weights, device: torch.device) -> torch.Tensor:
    """``weights`` (3 floats or a tensor) as a ``[3]`` float64 tensor on ``device``."""
    if isinstance(weights, torch.Tensor):
        return weights.to(device=device, dtype=torch.float64)
    return _weights_on(tuple(float(w) for w in weights), device)


def align(scores: torch.Tensor, capacity: int, rounds: int = ROUNDS) -> torch.Tensor:
    """``[B]`` int64 device per token, at most ``capacity`` each, as :func:`vllm_semmoe.core.scheduling.align`.

    ``scores``: ``[B, E]`` float32 or float64. On Triton tensors (CUDA, or under
    ``TRITON_INTERPRET=1``) the price rounds and the repair run as one Triton program
    (:func:`csrc_triton.align.align_rounds`, one launch, nothing read back); elsewhere as PyTorch
    ops, one flag read back and the repair on the host."""
    if shuffle.uses_triton(scores):
        if scores.dtype not in (torch.float32, torch.float64):
            scores = scores.to(torch.float64)
        return align_kernel.align_rounds(scores, capacity, rounds, repair=True)[0]
    score = scores.to(torch.float64)
    cap = float(capacity)
    device, load = _align_rounds_torch(score, cap, rounds)
    if bool(load.max() > cap):  # the one host read
        device = _repair(score, device, load, cap)
    return device


def _align_rounds_torch(score: torch.Tensor, cap: float, rounds: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The price rounds in PyTorch ops: ``(device [B], load [E])`` of the last round run. A fixed
    number of rounds with finished ones masked out (no host round trip)."""
    U, E = score.shape
    device_ = score.device
    price = torch.zeros(E, dtype=torch.float64, device=device_)
    device = torch.zeros(U, dtype=torch.int64, device=device_)
    load = torch.zeros(E, dtype=torch.float64, device=device_)
    done = torch.zeros((), dtype=torch.bool, device=device_)
    step = 0.05 * (score.max() - score.min() + 1e-9)
    ones = torch.ones(U, dtype=torch.float64, device=device_)
    for _ in range(rounds):
        best = torch.argmax(score - price[None, :], dim=1)  # first index on ties, like Numba's strict >
        new_load = torch.zeros(E, dtype=torch.float64, device=device_).index_add_(0, best, ones)
        device = torch.where(done, device, best)
        load = torch.where(done, load, new_load)
        done = done | (new_load.max() <= cap)
        updated = torch.clamp_min(price + step * (new_load / cap - 1.0), 0.0)
        price = torch.where(done, price, updated)
        step = step * 0.93
    return device, load


def _repair(score, device, load, cap):
    """The repair is sequential (each move changes the loads): run it on the host, in Numba
    (:func:`vllm_semmoe.core.scheduling.repair_unit`), on the batches the price rounds leave over
    capacity (one copy each way)."""
    fixed = repair_unit(score.cpu().numpy(), device.cpu().numpy().copy(), load.cpu().numpy().copy(), cap)
    return torch.from_numpy(fixed).to(score.device)


def shuffle_permutation(device: torch.Tensor, ep_size: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slot_token [E*cap], token_slot [B])`` as :func:`vllm_semmoe.core.scheduling.shuffle_permutation`
    (on CUDA the Triton device-grouping kernel, one launch, unvalidated: ``device`` comes from
    :func:`align`, at most ``capacity`` per device)."""
    if shuffle.uses_triton(device):
        return shuffle.device_grouping(device, ep_size, capacity, validate=False)
    onehot = torch.nn.functional.one_hot(device, ep_size)
    fill = onehot.cumsum(dim=0).gather(1, device[:, None]).squeeze(1) - 1  # earlier tokens of the same device
    token_slot = device * capacity + fill
    slot_token = torch.full((ep_size * capacity,), -1, dtype=torch.int64, device=device.device)
    slot_token.scatter_(0, token_slot, torch.arange(len(device), device=device.device))
    return slot_token, token_slot


def tp_decide(scores: torch.Tensor, ep_size: int):
    """One layer's decision on the scores' device: ``(device [B], slot_token, token_slot)``,
    as :func:`vllm_semmoe.core.scheduling.tp_decide` (``scores``: ``[B, E]`` float32; on Triton
    tensors two launches, no host read)."""
    cap = slice_capacity(int(scores.shape[0]), ep_size)
    device = align(scores, cap)
    slot_token, token_slot = shuffle_permutation(device, ep_size, cap)
    return device, slot_token, token_slot


def tp_schedule(rows, history, t2d_layer, oov_layer, markov_layer, ep_size: int, combine: int = COMBINE_PRODUCT):
    """:func:`tp_decide` on the A-table rule's scores (:func:`tp_layer_scores`)."""
    return tp_decide(tp_layer_scores(rows, history, t2d_layer, oov_layer, markov_layer, combine), ep_size)


class TorchTpScheduler:
    """:class:`vllm_semmoe.core.schedulers.TpScheduler`'s decision in PyTorch ops on ``device``:
    the same tables (each layer's arrays copied there once) and the same history, so the same
    decision (see the module docstring for the X-table rule's rounding).

    Args:
        scheduler: the host scheduler whose tables and history rule this runs.
        device: where the tables live and the decisions run.
    """

    def __init__(self, scheduler: TpScheduler, device: torch.device):
        self.scheduler = scheduler
        self.device = device
        self._layers: dict[int, tuple[torch.Tensor, ...]] = {}
        self._weights = _weights(tuple(float(w) for w in scheduler.weights), device)  # [3] float64

    def layer_tables(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Layer ``layer``'s arrays as tensors on :attr:`device` (copied once)."""
        found = self._layers.get(layer)
        if found is None:
            a = self.scheduler.layer_tables(layer)
            arrays = ((a.t2d, a.oov, a.evidence, a.log_prior, a.holds) if self.scheduler.uses_experts
                      else (a.t2d, a.oov, a.markov))
            found = self._layers[layer] = tuple(torch.from_numpy(np.ascontiguousarray(x)).to(self.device)
                                                for x in arrays)
        return found

    def _tensor(self, array) -> torch.Tensor:
        if isinstance(array, torch.Tensor):
            return array.to(self.device)
        return torch.from_numpy(np.ascontiguousarray(array, np.int64)).to(self.device, non_blocking=True)

    def scores(self, layer: int, rows, previous) -> torch.Tensor:
        """``[B, E]`` float32 scores, as :meth:`TpScheduler.scores` (``rows``, ``previous``: its
        inputs, arrays or tensors)."""
        rows, previous = self._tensor(rows), self._tensor(previous)
        if self.scheduler.uses_experts:
            t2d, oov, evidence, log_prior, holds = self.layer_tables(layer)
            return tp_expert_scores(rows, previous, t2d, oov, evidence, log_prior, holds, self._weights)
        return tp_layer_scores(rows, previous, *self.layer_tables(layer))

    def decide(self, layer: int, rows, previous, num_ranks: int):
        """``(device [B], slot_token, token_slot, capacity)`` as :meth:`TpScheduler.decide`, the
        index tensors on :attr:`device` (on Triton tensors: three launches, no host read)."""
        B = len(rows)
        cap = slice_capacity(B, num_ranks)
        if self.scheduler.schedules:
            device, slot_token, token_slot = tp_decide(self.scores(layer, rows, previous), num_ranks)
        else:
            device = torch.arange(B, device=self.device) // cap
            slot_token, token_slot = shuffle_permutation(device, num_ranks, cap)
        return device, slot_token, token_slot, cap
