"""Sem-MoE's data schedulers, one object per serving mode, and their runs over a whole trace.

- :class:`TpScheduler` (Attention-TP): one MoE layer's decision for a batch of tokens, the
  device of each token and the permutation of the shuffled collectives, from the tables and the
  tokens' routing at the two previous layers (the history it defines, :meth:`TpScheduler.history`).
- :class:`DpScheduler` (Attention-DP): one request's rank, from its prompt's votes against the
  ranks' load.

The engine (:mod:`vllm_semmoe.vllm_adapter`), an outside router (:mod:`.route`) and every offline
figure decide through them. Over a trace: :func:`scheduled_devices`, ``[T, L]`` the device each
token is processed on at each layer, with its two modes :func:`tp_devices` (batches of
``EvalConfig.batch_tokens`` tokens in arrival order; without tables the reduce-scatter's
contiguous slices) and :func:`dp_ranks` (each request on one rank for all layers; without tables
round-robin), shared by the offline evaluator, ``bench-ep``, the cost model and the replica
choice of the Sem-MoE policy.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Mapping
from dataclasses import dataclass

import numba
import numpy as np

from . import scheduling
from .modes import ServingMode
from .placement import Placement
from .tables import SemMoETables
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
    # most MAX_LAYER_THREADS; 1 where the caller shares its CPUs, e.g. an engine replaying its capture)

    def window(self, ep_size: int) -> int:
        return scheduling.balance_window(ep_size) if self.dp_window is None else int(self.dp_window)


def scheduled_devices(trace: RoutingTrace, placement: Placement, tables: SemMoETables | None,
                      config: EvalConfig) -> np.ndarray:
    """``[T, L]`` int64 device each token is processed on at each layer under ``config``'s
    data scheduling (Sem-MoE's with ``tables``, else the engines' default)."""
    check_inputs_fit(trace, placement, tables)
    if config.mode == ServingMode.TP:
        return tp_devices(trace, tables, placement.ep_size, config)[0]
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


def scheduling_tables(tables: SemMoETables | None) -> SemMoETables | None:
    """The tables an engine schedules data with: Sem-MoE's own; ``None`` for a baseline
    placement's tables (or none), which leave the engines' default (vLLM's contiguous slices,
    its DP balancer)."""
    return tables if tables is not None and tables.placement.method == "semmoe" else None


#: what the TP scheduler conditions on besides T2D (:attr:`EvalConfig.tp_history`)
TP_HISTORIES = ("experts", "devices")


@dataclass(frozen=True)
class TpLayerTables:
    """One MoE layer's tables as the TP decision reads them (:class:`TpScheduler`)."""

    t2d: np.ndarray  # [J, E] float32 T2D scores of the layer
    oov: np.ndarray  # [E] the layer prior over devices (tokens without a row)
    holds: np.ndarray  # [N, E] float32, 1 where device e holds a copy of expert n
    evidence: np.ndarray | None = None  # X table: [2, N, N] float32 log(X / p)
    log_prior: np.ndarray | None = None  # X table: [N] float32 log p
    markov: np.ndarray | None = None  # A table: [E*E, E]


class TpScheduler:
    """Sem-MoE's Attention-TP decision, one MoE layer and batch at a time: the offline evaluator
    (:func:`tp_devices`), ``bench-ep``, the cost model and the engine's token shuffle
    (:class:`~vllm_semmoe.vllm_adapter.tp_shuffle.TpShuffleLayer`) all decide through it; its
    PyTorch twin on an accelerator's tensors is :class:`vllm_semmoe.kernels.scheduling_torch.TorchTpScheduler`.

    Per layer ``l``: each token's device scores from its table row and its *history* at layers
    ``l-1`` and ``l-2`` (:meth:`scores`), aligned to equal slices of ``ceil(B/E)`` tokens
    (:func:`.scheduling.align`), and the permutation the shuffled collectives apply
    (:meth:`decide`). The history of a routed layer is :meth:`history`: with the X table (where
    the tables have it and ``history="experts"``) the token's logical experts there
    (:func:`.scheduling.tp_expert_scores`), else the device holding most of them, for the
    paper's A table (:func:`.scheduling.tp_layer_scores`). Without tables (``None``, see
    :func:`scheduling_tables`): the reduce-scatter's contiguous slices.

    Per-layer arrays are prepared on first use and kept; layers may be decided on threads.
    """

    def __init__(self, tables: SemMoETables | None, *, history: str = "experts",
                 weights=scheduling.TP_EVIDENCE_WEIGHTS):
        if history not in TP_HISTORIES:
            raise ValueError(f"tp_history must be 'experts' or 'devices', got {history!r}")
        self.tables = tables
        #: whether the history is the X table's experts (else the A table's majority devices)
        self.uses_experts = tables is not None and history == "experts" and tables.transition is not None
        self.weights = np.asarray(weights, np.float64)
        self._holds: np.ndarray | None = None
        self._layers: dict[int, TpLayerTables] = {}

    @property
    def schedules(self) -> bool:
        """Whether tokens are scheduled by the tables (else contiguous slices)."""
        return self.tables is not None

    def layer_tables(self, layer: int) -> TpLayerTables:
        """Layer ``layer``'s arrays (prepared once)."""
        found = self._layers.get(layer)
        if found is not None:
            return found
        tables = self.tables
        if self._holds is None:
            self._holds = tables.placement.holds().astype(np.float32)
        common = dict(t2d=tables.t2d_score[layer].astype(np.float32), oov=tables.oov_score[layer],
                      holds=self._holds[layer])
        if self.uses_experts:
            arrays = TpLayerTables(**common, evidence=tables.log_evidence()[layer],
                                   log_prior=tables.log_expert_prior()[layer])
        else:
            arrays = TpLayerTables(**common, markov=tables.markov[layer])
        self._layers[layer] = arrays
        return arrays

    def rows(self, tokens) -> np.ndarray:
        """``[B]`` int64 table row of each token id (``-1``: unseen; any when there are no tables)."""
        if self.tables is None:
            return np.full(len(tokens), -1, np.int64)
        return self.tables.token_rows(tokens)

    def history(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """What the next layers' decisions keep of layer ``layer``'s routing ``experts`` ``[B, K]``
        (logical ids): the experts themselves (``[B, K]`` int64, X table), or the device holding
        most of them (``[B]`` int64, first on ties; copies count, home or replica)."""
        experts = np.asarray(experts, np.int64)
        if self.uses_experts or self.tables is None:
            return experts
        holds = self.layer_tables(layer).holds
        return np.argmax(holds[experts].sum(axis=1), axis=1)

    def previous(self, layer: int, routed: Mapping[int, np.ndarray], num_tokens: int) -> np.ndarray:
        """The history input of layer ``layer``'s decision from ``routed`` (layer -> its
        :meth:`history`, for the batch's ``num_tokens`` tokens; a layer absent, or of another
        batch size, is unknown): X table, ``[B, 2, K]`` int64 experts at ``layer - 1`` and
        ``layer - 2`` (``-1``: unknown); A table, ``[B]`` int64 ``d2 * E + d1`` of the two majority
        devices (``-1`` unless both are known)."""
        def known(j):
            found = routed.get(layer - j) if layer - j >= 0 else None
            return found if found is not None and len(found) == num_tokens else None

        if self.uses_experts:
            prev = np.full((num_tokens, 2, self.tables.top_k), -1, np.int64)
            for j in (1, 2):
                found = known(j)
                if found is not None:
                    prev[:, j - 1] = found
            return prev
        d1, d2 = known(1), known(2)
        if d1 is None or d2 is None:
            return np.full(num_tokens, -1, np.int64)
        return d2 * self.tables.ep_size + d1

    def scores(self, layer: int, rows: np.ndarray, previous: np.ndarray) -> np.ndarray:
        """``[B, E]`` float32 device scores of the tokens at layer ``layer``."""
        arrays = self.layer_tables(layer)
        if self.uses_experts:
            return scheduling.tp_expert_scores(rows, previous, arrays.t2d, arrays.oov, arrays.evidence,
                                               arrays.log_prior, arrays.holds, self.weights)
        return scheduling.tp_layer_scores(rows, previous, arrays.t2d, arrays.oov, arrays.markov,
                                          scheduling.COMBINE_PRODUCT)

    def devices(self, layer: int, rows: np.ndarray, previous: np.ndarray | None, num_ranks: int,
                starts: np.ndarray | None = None) -> np.ndarray:
        """``[B]`` int64 device of each token at layer ``layer``, every batch ``[starts[i],
        starts[i+1])`` (default: one batch) on its own equal slices."""
        B = len(rows)
        starts = np.zeros(1, np.int64) if starts is None else starts
        ends = np.append(starts[1:], B)
        device = np.empty(B, np.int64)
        scores = self.scores(layer, rows, previous) if self.schedules else None
        for s, e in zip(starts, ends):
            if scores is None:
                device[s:e] = scheduling.contiguous_slices(e - s, num_ranks)
            else:
                device[s:e] = scheduling.align(scores[s:e], scheduling.slice_capacity(e - s, num_ranks))
        return device

    def decide(self, layer: int, rows: np.ndarray, previous: np.ndarray | None, num_ranks: int):
        """One batch at layer ``layer``: ``(device [B], slot_token [E*cap], token_slot [B],
        capacity)``, the slices and permutation of the shuffled collectives
        (:func:`.scheduling.shuffle_permutation`); identical on every rank for the same inputs."""
        device = self.devices(layer, rows, previous, num_ranks)
        cap = scheduling.slice_capacity(len(rows), num_ranks)
        slot_token, token_slot = scheduling.shuffle_permutation(device, num_ranks, cap)
        return device, slot_token, token_slot, cap


def tp_devices(trace: RoutingTrace, tables: SemMoETables | None, ep_size: int, config: EvalConfig):
    """``([T, L] device per token and layer, mean per-batch token imbalance)`` of
    :class:`TpScheduler` over the whole trace.

    Batches are ``config.batch_tokens`` consecutive tokens, or the trace's requests when it is 0
    (a step-ordered live capture, where each "request" is one engine step).
    """
    T, L = trace.num_tokens, trace.num_layers
    starts = (trace.offsets[:-1] if config.batch_tokens == 0 else np.arange(0, T, config.batch_tokens)).astype(np.int64)
    scheduler = TpScheduler(tables, history=config.tp_history, weights=config.tp_evidence_weights)
    device = np.empty((T, L), np.int64)
    rows = scheduler.rows(trace.tokens)
    if not scheduler.schedules:
        device[:] = scheduler.devices(0, rows, None, ep_size, starts)[:, None]
        return device, _batch_imbalance_kernel(device, starts, ep_size)
    routed = {l: scheduler.history(l, trace.experts[:, l]) for l in range(L)}

    def decide_layer(l):
        device[:, l] = scheduler.devices(l, rows, scheduler.previous(l, routed, T), ep_size, starts)

    for_each_layer(L, decide_layer, layer_threads(config.threads, L))
    return device, _batch_imbalance_kernel(device, starts, ep_size)


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


class DpScheduler:
    """Sem-MoE's Attention-DP decision: the rank of a request, from its prompt's T2D votes on
    each DP rank against the ranks' load (:func:`.scheduling.dp_choose_balanced`). The engine's
    router (:class:`~vllm_semmoe.vllm_adapter.dp_routing.DpRouter`), an outside router's ranking
    (:func:`.route.rank_dp_ranks`) and the offline evaluator (:func:`dp_ranks`) all decide
    through it.

    Args:
        tables: tables whose EP devices split evenly over ``num_ranks`` DP ranks (default: one
            device per rank); DP rank ``r`` owns devices ``r * ranks_per_dp ..``.
        balance, price_step: the balance knobs of :func:`.scheduling.dp_choose_balanced`.
        decode_weight: work of a request beyond its prompt (:func:`.scheduling.request_work`).
        ranks: the DP ranks the decision chooses among, ascending (default: all ``num_ranks``), as
            where a balancer sees only some ranks (vLLM's hybrid load balancing: each node's API
            server balances its own). Votes, loads, prices and the choice are then indexed by
            position in ``ranks`` (vLLM's local engine index), not by DP rank.

    ``price`` ``[len(ranks)]``: the per-rank prices of the online decisions (:meth:`choose`).
    """

    def __init__(self, tables: SemMoETables, num_ranks: int | None = None, *,
                 balance: float = DEFAULT_DP_BALANCE, price_step: float = DEFAULT_DP_PRICE_STEP,
                 decode_weight: float = scheduling.DEFAULT_DECODE_WEIGHT, ranks=None):
        num_ranks = tables.ep_size if num_ranks is None else int(num_ranks)
        if num_ranks < 1 or tables.ep_size % num_ranks:
            raise ValueError(f"tables for EP {tables.ep_size} cannot be split over {num_ranks} DP ranks")
        self.tables = tables
        self.num_ranks, self.ranks_per_dp = num_ranks, tables.ep_size // num_ranks
        self.ranks = np.arange(num_ranks) if ranks is None else np.asarray(ranks, np.int64).reshape(-1)
        if (not len(self.ranks) or self.ranks.min() < 0 or self.ranks.max() >= num_ranks
                or np.any(np.diff(self.ranks) <= 0)):
            raise ValueError(f"ranks {self.ranks.tolist()} are not DP ranks of {num_ranks}")
        self.balance, self.price_step, self.decode_weight = float(balance), float(price_step), float(decode_weight)
        self.t2d = tables.t2d_score.astype(np.float32)
        self.price = np.zeros(len(self.ranks))

    def request_votes(self, tokens: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """``[R, len(ranks)]`` float64 T2D votes of each request (tokens ``offsets[r]:offsets[r+1]``)
        on each of :attr:`ranks`: its predicted local expert activations there
        (:func:`.scheduling.request_votes` summed over the rank's EP devices)."""
        per_device = scheduling.request_votes(self.tables.token_rows(tokens), np.asarray(offsets, np.int64),
                                              self.t2d, self.tables.oov_score)
        per_rank = per_device.reshape(len(per_device), self.num_ranks, self.ranks_per_dp).sum(axis=2)
        return per_rank if len(self.ranks) == self.num_ranks else per_rank[:, self.ranks]

    def votes(self, token_ids) -> np.ndarray:
        """``[len(ranks)]`` float64 votes of one prompt (its token ids, as the engine tokenizes it)."""
        tokens = np.asarray(token_ids, np.int64).reshape(-1)
        return self.request_votes(tokens, np.array([0, len(tokens)]))[0]

    def work(self, prompt_tokens: int) -> float:
        """A request's work: its prompt plus the decode weight (:func:`.scheduling.request_work`)."""
        return float(scheduling.request_work([prompt_tokens], self.decode_weight)[0])

    def values(self, votes: np.ndarray, load: np.ndarray, mean_work: float, work: float,
               price: np.ndarray | None = None) -> np.ndarray:
        """``[num_ranks]`` the value :meth:`choose` maximises on each rank (prices: ``price``, else
        :attr:`price`; nothing is updated)."""
        return scheduling.dp_balanced_values(votes, load, mean_work, work, self.balance,
                                             self.price if price is None else price)

    def choose(self, votes: np.ndarray, load: np.ndarray, mean_work: float, work: float) -> int:
        """One online decision: the rank maximising :meth:`values` (ties: the lowest; a rank with
        ``-inf`` votes is excluded), whose price then rises (:attr:`price` is updated).

        Args:
            votes: ``[num_ranks]`` (:meth:`votes`); load: ``[num_ranks]`` work on each rank now;
            mean_work: the mean work of a request; work: this request's (:meth:`work`).
        """
        return int(scheduling.dp_choose_balanced(np.asarray(votes, np.float64), np.asarray(load, np.float64),
                                                 float(mean_work), float(work), self.balance, self.price,
                                                 self.price_step))

    def assign(self, trace: RoutingTrace, window: int, round_robin_mask: bool = False) -> np.ndarray:
        """``[R]`` int64 rank of every request of ``trace`` in arrival order: :meth:`choose` with
        each rank's work over the last ``window`` requests, prices from zero
        (:func:`.scheduling.dp_assign`; ``round_robin_mask``: the paper's mask instead)."""
        work = scheduling.request_work(np.diff(trace.offsets).astype(np.float64), self.decode_weight)
        return scheduling.dp_assign(self.request_votes(trace.tokens, trace.offsets), work, self.balance, window,
                                    round_robin_mask, self.price_step)


def dp_ranks(trace: RoutingTrace, tables: SemMoETables | None, ep_size: int, config: EvalConfig):
    """``([R] rank per request, largest over mean token load of the ranks over the whole
    trace)``: :class:`DpScheduler` on the trace's arrivals (without tables: round-robin)."""
    lengths = np.diff(trace.offsets).astype(np.float64)
    if tables is None:
        rank = scheduling.round_robin_assign(trace.num_requests, ep_size)
    else:
        scheduler = DpScheduler(tables, ep_size, balance=config.dp_balance, price_step=config.dp_price_step,
                                decode_weight=decode_weight(None, config))
        rank = scheduler.assign(trace, config.window(ep_size), config.round_robin_mask)
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


def tp_steps(trace: RoutingTrace, batch_tokens: int, max_batches: int | None, sample: str = "head"):
    """TP batches of ``trace``: step ``b`` is tokens ``[b * batch_tokens, (b + 1) * batch_tokens)``
    of the stream, for the steps :func:`sample_steps` keeps. Returns ``(rows [N] int64, offsets
    [S+1] int64, covering)``: the trace rows of every kept step and the requests covering them
    (the trace to schedule: a batch's schedule depends on its own tokens only)."""
    steps = sample_steps(-(-trace.num_tokens // batch_tokens), max_batches, sample)
    n_tok = min(trace.num_tokens, (int(steps[-1]) + 1) * batch_tokens)
    n_req = int(np.searchsorted(trace.offsets, n_tok, side="left"))  # requests covering n_tok tokens
    covering = trace.select_requests(np.arange(max(n_req, 1)))
    parts = [np.arange(b * batch_tokens, min((b + 1) * batch_tokens, n_tok), dtype=np.int64) for b in steps]
    offsets = np.cumsum([0] + [len(p) for p in parts]).astype(np.int64)
    return np.concatenate(parts), offsets, covering


def dp_steps(trace: RoutingTrace, rank: np.ndarray, ranks: int, batch_tokens: int, max_batches: int | None,
             sample: str = "head", steady: bool = False):
    """Lock-stepped DP batches of ``trace`` with ``rank`` ``[R]`` the DP rank of each request:
    each rank takes ``ceil(batch_tokens/ranks)`` tokens of its queue per step, for the steps
    :func:`sample_steps` keeps. Returns ``((rows [N] int64, offsets [S+1] int64), device [N, L]
    int16)``: the trace rows of every kept step, rank by rank, and the rank of each row.

    ``steady=False``: the stream drains: every token once, until the longest queue is empty
    (the last steps have idle ranks). ``steady=True``: a deployment under load, every rank full
    at every step: ``ceil(tokens / (cap × ranks))`` steps, the fewest that hold the stream with
    every rank full (the same for every rank choice); a rank whose queue runs out starts it again
    from its first token, and a longer queue is cut there. Step times are comparable across rank
    choices only this way: drained, a choice that leaves one queue longer runs more, emptier,
    cheaper steps for the same tokens."""
    L = trace.num_layers
    cap = scheduling.slice_capacity(batch_tokens, ranks)
    token_rank = np.repeat(rank, np.diff(trace.offsets))
    queues = [np.nonzero(token_rank == r)[0] for r in range(ranks)]  # arrival order
    total = -(-trace.num_tokens // (cap * ranks)) if steady else max(-(-len(q) // cap) for q in queues)
    steps = sample_steps(total, max_batches, sample)
    rows, dev, offsets = [], [], [0]
    for s in steps:
        for r, q in enumerate(queues):
            if steady and len(q):
                part = q[np.arange(s * cap, (s + 1) * cap) % len(q)]
            else:
                part = q[s * cap:(s + 1) * cap]
            rows.append(part)
            dev.append(np.full((len(part), L), r, np.int16))
        offsets.append(offsets[-1] + sum(len(p) for p in rows[-ranks:]))
    return (np.concatenate(rows).astype(np.int64), np.asarray(offsets, np.int64)), np.concatenate(dev)
