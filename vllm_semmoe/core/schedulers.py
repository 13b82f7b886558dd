"""Data scheduling of a routing trace, as the engines schedule it: Sem-MoE's TP and DP
schedulers run over a whole trace (with tables), or the engines' defaults (without).

One entry, :func:`scheduled_devices`: ``[T, L]`` the device each token is processed on at each
layer. :func:`tp_devices` and :func:`dp_ranks` are its two modes, shared by the offline evaluator
(:mod:`.evaluate`), ``bench-ep`` (:mod:`.bench_ep.plan`), the cost grid (:mod:`.cost_grid`) and
the replica choice of the Sem-MoE policy (:mod:`.policy.semmoe`).

TP: tokens are packed into batches of ``EvalConfig.batch_tokens`` in arrival order; per layer,
each token's device scores (:func:`.scheduling.tp_expert_scores` from its token row and its
experts at the two previous layers, or the paper's A table) are aligned to equal slices
(:func:`.scheduling.align`). Without tables: the reduce-scatter's contiguous slices.
DP: each request goes to one rank for all layers (:func:`.scheduling.dp_assign`: IDF votes minus
a price on in-flight work). Without tables: round-robin.
"""

from __future__ import annotations

import concurrent.futures
import os
from dataclasses import dataclass

import numba
import numpy as np

from . import scheduling
from .modes import ServingMode
from .placement import Placement
from .tables import SemMoETables, majority_device, placement_device_counts
from .trace import RoutingTrace, check_fit


DEFAULT_DP_BALANCE = scheduling.DEFAULT_DP_BALANCE  # the knobs' defaults, :attr:`EvalConfig.dp_balance`
DEFAULT_DP_PRICE_STEP = scheduling.DEFAULT_DP_PRICE_STEP  # and :attr:`EvalConfig.dp_price_step`


@dataclass(frozen=True)
class EvalConfig:
    """How the online side is simulated."""

    mode: str = ServingMode.TP  # a serving mode, "tp" or "dp" (:mod:`.modes`)
    batch_tokens: int = 512  # TP: tokens per forward batch (requests packed in arrival order);
    # 0 = one batch per request of the trace (a live capture in engine-step order)
    dp_window: int | None = None  # DP: requests in a balance window; None = 32 × ranks
    dp_balance: float = DEFAULT_DP_BALANCE  # DP: proportional balance knob (scheduling.dp_choose_balanced):
    # votes per unit of work a request pays per mean request of work above the least-loaded rank
    dp_price_step: float = DEFAULT_DP_PRICE_STEP  # DP: step of the online per-rank prices (same function)
    round_robin_mask: bool = False  # DP: the paper's mask instead of the work rule
    tp_history: str = "experts"  # TP: what the scheduler conditions on besides T2D: "experts" (the
    # token's experts at the two previous layers, the X table, where the tables have it) or
    # "devices" (the paper's A table over the two previous layers' majority devices)
    tp_evidence_weights: tuple = scheduling.TP_EVIDENCE_WEIGHTS  # TP, "experts": see
    # scheduling.tp_expert_scores (what the engine uses is the default)
    dp_decode_weight: float | None = None  # DP: decode work per request (None: profile's mean
    # output length where the profile has decode tokens, else scheduling.DEFAULT_DECODE_WEIGHT)
    threads: int | None = None  # TP: layers decided at once on threads (None: one per CPU, at
    # most MAX_LAYER_THREADS; 1 where the caller shares its CPUs, e.g. the plugin's live meter)

    def window(self, ep_size: int) -> int:
        return scheduling.balance_window(ep_size) if self.dp_window is None else int(self.dp_window)


def scheduled_devices(trace: RoutingTrace, placement: Placement, tables: SemMoETables | None,
                      config: EvalConfig) -> np.ndarray:
    """``[T, L]`` int64 device each token is processed on at each layer under ``config``'s
    data scheduling (Sem-MoE's with ``tables``, else the engines' default)."""
    check_inputs_fit(trace, placement, tables)
    if config.mode == ServingMode.TP:
        counts = placement_device_counts(trace.experts, placement)
        return tp_devices(trace, counts, tables, placement.ep_size, config)[0]
    return request_devices(trace, dp_ranks(trace, tables, placement.ep_size, config)[0])


def check_inputs_fit(trace: RoutingTrace, placement: Placement, tables: SemMoETables | None) -> None:
    """:func:`.trace.check_fit` of the routing against the placement and the tables: the compiled
    counting indexes the placement with the trace's layers and expert ids."""
    hint = "evaluate on routing of the model the placement was solved for"
    check_fit(trace, placement, names=("the trace", f"the {placement.method or 'given'} placement"), hint=hint)
    if tables is not None:
        check_fit(trace, tables, names=("the trace", "the tables"), hint=hint)


def batch_starts(trace: RoutingTrace, config: EvalConfig) -> np.ndarray:
    """First token of each batch a rank's rows count from: TP's batches; DP: the whole stream
    (requests are not cut into engine steps here)."""
    if config.mode != ServingMode.TP:
        return np.zeros(1, np.int64)
    return trace.offsets[:-1] if config.batch_tokens == 0 else np.arange(0, trace.num_tokens, config.batch_tokens)


def request_devices(trace: RoutingTrace, rank: np.ndarray) -> np.ndarray:
    """``[T, L]``: every token of request ``r`` on ``rank[r]`` at every layer."""
    return np.repeat(rank, np.diff(trace.offsets))[:, None].repeat(trace.num_layers, 1)


def decode_weight(profile: RoutingTrace | None, config: "EvalConfig") -> float:
    """Decode work per request: ``config.dp_decode_weight``, else the profile's mean generated
    tokens per request where it recorded decode, else :data:`.scheduling.DEFAULT_DECODE_WEIGHT`."""
    if config.dp_decode_weight is not None:
        return float(config.dp_decode_weight)
    if profile is not None and profile.is_decode is not None and profile.is_decode.any():
        return float(profile.is_decode.sum() / max(profile.num_requests, 1))
    return scheduling.DEFAULT_DECODE_WEIGHT


def tp_devices(trace, counts, tables, ep_size, config):
    """``([T, L] device per token and layer, mean per-batch token imbalance)``.

    Batches are ``config.batch_tokens`` consecutive tokens, or the trace's requests when it is 0
    (a step-ordered live capture, where each "request" is one engine step).
    """
    T, L = trace.num_tokens, trace.num_layers
    starts = trace.offsets[:-1] if config.batch_tokens == 0 else np.arange(0, T, config.batch_tokens)
    ends = np.append(starts[1:], T)
    device = np.empty((T, L), np.int64)
    if tables is None:
        for s, e in zip(starts, ends):
            device[s:e] = scheduling.contiguous_slices(e - s, ep_size)[:, None]
        return device, _batch_imbalance_kernel(device, starts.astype(np.int64), ep_size)
    if config.tp_history not in ("experts", "devices"):
        raise ValueError(f"tp_history must be 'experts' or 'devices', got {config.tp_history!r}")
    rows = tables.token_rows(trace.tokens)
    t2d = tables.t2d_score.astype(np.float32)
    if config.tp_history == "experts" and tables.transition is not None:
        evidence, log_prior = tables.log_evidence(), tables.log_expert_prior()
        holds = tables.placement.holds().astype(np.float32)
        weights = np.asarray(config.tp_evidence_weights, np.float64)
        experts = trace.experts.astype(np.int64)

        def layer_scores(l):
            return scheduling.tp_expert_scores(rows, previous_experts(experts, l), t2d[l], tables.oov_score[l],
                                               evidence[l], log_prior[l], holds[l], weights)
    else:
        major = majority_device(counts)
        history = np.full((T, L), -1, np.int64)
        history[:, 2:] = major[:, :-2] * ep_size + major[:, 1:-1]

        def layer_scores(l):
            return scheduling.tp_layer_scores(rows, history[:, l], t2d[l], tables.oov_score[l], tables.markov[l],
                                              scheduling.COMBINE_PRODUCT)

    def decide_layer(l):
        scores = layer_scores(l)
        for s, e in zip(starts, ends):
            device[s:e, l] = scheduling.align(scores[s:e], scheduling.slice_capacity(e - s, ep_size))

    for_each_layer(L, decide_layer, layer_threads(config.threads, L))
    return device, _batch_imbalance_kernel(device, starts.astype(np.int64), ep_size)


#: at most this many layers at once (each holds its ``[T, E]`` scores and ``[T, 2, K]`` history)
MAX_LAYER_THREADS = 8


def layer_threads(threads: int | None, num_layers: int) -> int:
    """``threads`` (:attr:`EvalConfig.threads`) resolved: ``None`` is one per CPU this process
    may run on, at most :data:`MAX_LAYER_THREADS`; never more than the layers."""
    if threads is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = min(cpus, MAX_LAYER_THREADS)
    return max(1, min(int(threads), num_layers))


def for_each_layer(num_layers: int, work, threads: int) -> None:
    """``work(l)`` for every layer, on ``threads`` threads: the layers' decisions are independent
    and their Numba kernels release the GIL (the result does not depend on the number of
    threads)."""
    if threads <= 1:
        for l in range(num_layers):
            work(l)
        return
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="semmoe-eval") as pool:
        list(pool.map(work, range(num_layers)))  # list(): re-raise a layer's exception here


def previous_experts(experts: np.ndarray, layer: int) -> np.ndarray:
    """``[T, 2, K]`` int64: each token's experts at ``layer - 1`` and ``layer - 2`` (``-1`` before
    the first layer), the history :func:`.scheduling.tp_expert_scores` takes. experts ``[T, L, K]``."""
    T, _, K = experts.shape
    prev = np.full((T, 2, K), -1, np.int64)
    for j in (1, 2):
        if layer - j >= 0:
            prev[:, j - 1] = experts[:, layer - j]
    return prev


@numba.njit(cache=True)
def _batch_imbalance_kernel(device, starts, ep_size):
    T, L = device.shape
    total = 0.0
    n = 0
    for i in range(len(starts)):
        s = starts[i]
        e = starts[i + 1] if i + 1 < len(starts) else T
        for l in range(L):
            load = np.zeros(ep_size)
            for t in range(s, e):
                load[device[t, l]] += 1
            total += load.max() / load.mean()
            n += 1
    return total / n


def dp_ranks(trace, tables, ep_size, config):
    """``([R] rank per request, mean per-window max/mean token load)``."""
    lengths = np.diff(trace.offsets).astype(np.float64)
    R = trace.num_requests
    if tables is None:
        rank = scheduling.round_robin_assign(R, ep_size)
    else:
        votes = scheduling.request_votes(
            tables.token_rows(trace.tokens), trace.offsets, tables.t2d_score.astype(np.float32),
            tables.oov_score,
        )
        work = scheduling.request_work(lengths, decode_weight(None, config))
        rank = scheduling.dp_assign(votes, work, config.dp_balance, config.window(ep_size),
                                    config.round_robin_mask, config.dp_price_step)
    load = np.bincount(rank, weights=lengths, minlength=ep_size)
    return rank, float(load.max() / load.mean())


#: which steps ``max_batches`` keeps (:func:`sample_steps`)
SAMPLES = ("head", "spread")


def sample_steps(total: int, max_batches: int | None, sample: str = "head") -> np.ndarray:
    """``[S]`` int64 ascending indices of the steps replayed out of ``total``: all of them
    without ``max_batches``; else the first ``max_batches`` (``"head"``) or ``max_batches``
    spread evenly from the first step to the last (``"spread"``)."""
    if max_batches is None or max_batches >= total:
        return np.arange(total, dtype=np.int64)
    if sample == "head":
        return np.arange(max_batches, dtype=np.int64)
    return np.unique(np.linspace(0, total - 1, max_batches).round().astype(np.int64))


def dp_steps(trace: RoutingTrace, rank: np.ndarray, ranks: int, batch_tokens: int, max_batches: int | None,
             sample: str = "head"):
    """Lock-stepped DP batches of ``trace`` with ``rank`` ``[R]`` the DP rank of each request:
    each rank takes ``ceil(batch_tokens/ranks)`` tokens of its queue per step, for the steps
    :func:`sample_steps` keeps. Returns ``((rows [N] int64, offsets [S+1] int64), device [N, L]
    int16)``: the trace rows of every kept step, rank by rank, and the rank of each row."""
    L = trace.num_layers
    cap = scheduling.slice_capacity(batch_tokens, ranks)
    token_rank = np.repeat(rank, np.diff(trace.offsets))
    queues = [np.nonzero(token_rank == r)[0] for r in range(ranks)]  # arrival order
    steps = sample_steps(max(-(-len(q) // cap) for q in queues), max_batches, sample)
    rows, dev, offsets = [], [], [0]
    for s in steps:
        for r, q in enumerate(queues):
            part = q[s * cap:(s + 1) * cap]
            rows.append(part)
            dev.append(np.full((len(part), L), r, np.int16))
        offsets.append(offsets[-1] + sum(len(q[s * cap:(s + 1) * cap]) for q in queues))
    return (np.concatenate(rows).astype(np.int64), np.asarray(offsets, np.int64)), np.concatenate(dev)
