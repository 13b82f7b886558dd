"""Offline evaluation of placements and schedules on a routing trace.

Every figure is counted per (token, layer, expert) activation:

- ``lar``: share of activations whose expert sits on the device the token is processed on;
- ``lar_token``: share of (token, layer) pairs with at least one local expert;
- ``oracle_lar``: the same placement with a perfect, unconstrained device choice (TP: per token
  and layer; DP: per request, one device for all layers) — the ceiling of data scheduling;
- ``imbalance``: max/mean tokens per device (TP: per batch and layer, averaged; DP: prompt
  tokens per rank over the whole evaluation); ``expert_imbalance``: max/mean expert activations
  served per device, averaged over layers (with replicas, an activation is served by the copy on
  the token's device if there is one, else by the copy :meth:`.placement.Placement.serving_device`
  picks, the rule ``bench-ep`` moves tokens by).
- DP only, the lock-step balance over windows of ``W = 32 × ranks`` consecutive requests
  (:func:`.scheduling.window_imbalance`), with work = prompt tokens + a decode weight
  (:func:`.scheduling.request_work`): ``window_imbalance`` of the method's rank choice, and on
  the same arrivals ``window_imbalance_least_loaded`` (online least-loaded, no locality) and
  ``window_imbalance_round_robin``; ``request_imbalance``: the same windows counting requests.

Multi-seed runs (:func:`compare_seeds`) report every figure as ``{"mean", "sd", "per_seed"}``.

Data scheduling per mode: with tables, Sem-MoE's (:mod:`.scheduling`); without, the engines'
default — TP: the reduce-scatter's contiguous slices; DP: requests dealt round-robin.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from dataclasses import dataclass

import numba
import numpy as np

from . import scheduling
from .modes import ServingMode, serving_mode
from .placement import Placement
from .policy import get_policy
from .tables import SemMoETables, build_tables, majority_device, placement_device_counts
from .trace import RoutingTrace

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


def evaluate(trace: RoutingTrace, placement: Placement, tables: SemMoETables | None,
             config: EvalConfig) -> dict:
    """Metrics of ``placement`` on ``trace``, scheduled with ``tables`` (or the default)."""
    mode = serving_mode(config.mode)
    E = placement.ep_size
    counts = placement_device_counts(trace.experts, placement)  # [T, L, E]
    extra = {}
    if mode == ServingMode.TP:
        device, imbalance = _tp_devices(trace, counts, tables, E, config)
        oracle = counts.max(axis=2).sum()
    else:
        rank, imbalance = _dp_ranks(trace, tables, E, config)
        extra = dp_balance(trace, rank, E, config)
        device = _request_devices(trace, rank)
        per_request = np.add.reduceat(counts.sum(axis=1, dtype=np.int64), trace.offsets[:-1], axis=0)
        oracle = per_request.max(axis=1).sum()
    local = np.take_along_axis(counts, device[:, :, None], axis=2)[:, :, 0]
    activations = counts.size // E * trace.top_k
    if placement.redundant:
        serving = placement.serving_device(trace.experts, device)  # [T, L, K]
        expert_load = np.stack([np.bincount(serving[:, l].ravel(), minlength=E) for l in range(trace.num_layers)])
    else:
        expert_load = counts.sum(axis=0, dtype=np.int64)  # [L, E]
    out = {
        "lar": float(local.sum() / activations),
        "lar_token": float((local > 0).mean()),
        "oracle_lar": float(oracle / activations),
        "imbalance": float(imbalance),
        "expert_imbalance": float((expert_load.max(axis=1) / expert_load.mean(axis=1)).mean()),
        "lar_per_layer": (local.sum(axis=0) / (trace.num_tokens * trace.top_k)).tolist(),  # [L]
        **extra,
    }
    if config.mode == ServingMode.DP:
        out["rank_load_curve"] = rank_load_curve(rank, np.diff(trace.offsets), E)
    return out


def scheduled_devices(trace: RoutingTrace, placement: Placement, tables: SemMoETables | None,
                      config: EvalConfig) -> np.ndarray:
    """``[T, L]`` int64 device each token is processed on at each layer under ``config``'s
    data scheduling (Sem-MoE's with ``tables``, else the engines' default)."""
    if config.mode == ServingMode.TP:
        counts = placement_device_counts(trace.experts, placement)
        return _tp_devices(trace, counts, tables, placement.ep_size, config)[0]
    return _request_devices(trace, _dp_ranks(trace, tables, placement.ep_size, config)[0])


def _request_devices(trace: RoutingTrace, rank: np.ndarray) -> np.ndarray:
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


def dp_balance(trace: RoutingTrace, rank: np.ndarray, ep_size: int, config: "EvalConfig") -> dict:
    """Lock-step balance of a DP rank choice ``rank [R]`` beside the locality-blind references
    on the same arrivals (see module docstring for the keys)."""
    work = scheduling.request_work(np.diff(trace.offsets), decode_weight(None, config))
    W = config.window(ep_size)
    least = scheduling.least_loaded_assign(work, ep_size, W)
    robin = scheduling.round_robin_assign(len(work), ep_size)
    return {
        "window_imbalance": scheduling.window_imbalance(rank, work, ep_size, W),
        "window_imbalance_least_loaded": scheduling.window_imbalance(least, work, ep_size, W),
        "window_imbalance_round_robin": scheduling.window_imbalance(robin, work, ep_size, W),
        "request_imbalance": scheduling.window_imbalance(rank, np.ones(len(work)), ep_size, W),
    }


def rank_load_curve(rank: np.ndarray, lengths: np.ndarray, ep_size: int, points: int = 50) -> dict:
    """DP per-rank load over time: cumulative prompt tokens per rank after request ``i``.

    Args: ``rank`` ``[R]`` rank of each request (arrival order), ``lengths`` ``[R]`` its tokens.
    Returns ``{"requests": [P] request counts, "tokens": [P, E] cumulative tokens per rank}``
    at ``P <= points`` evenly spaced requests (for plots; the last point is the total).
    """
    per_rank = np.zeros((len(rank), ep_size), np.int64)
    per_rank[np.arange(len(rank)), rank] = lengths
    cumulative = per_rank.cumsum(axis=0)
    at = np.unique(np.linspace(0, len(rank) - 1, min(points, len(rank))).round().astype(np.int64))
    return {"requests": (at + 1).tolist(), "tokens": cumulative[at].tolist()}


def _tp_devices(trace, counts, tables, ep_size, config):
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


def _dp_ranks(trace, tables, ep_size, config):
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


def compare_methods(profile: RoutingTrace, trace: RoutingTrace, ep_size: int, methods: list[str],
                    config: EvalConfig, *, seed: int = 0, redundant: int = 0, progress=None,
                    solve_cache=None, embedding: np.ndarray | None = None,
                    policies: dict | None = None) -> dict[str, dict]:
    """Solve every method on ``profile`` and evaluate it on ``trace`` side by side.

    Each row holds :func:`evaluate`'s figures for the method as deployed (``semmoe`` with its
    tables; the baselines with the engines' default data scheduling), plus
    ``lar_with_semmoe_sched`` (the same placement under Sem-MoE's scheduler, which separates
    placement quality from scheduling), ``a2a_ratio`` (remote activations relative to
    ``vanilla``), ``solve_s``, ``redundant`` (R, replica slots per device the method used: those
    that support replication get ``redundant``, the others 0) and ``experts_per_device``
    (physical expert slots per rank, ``N/E + R``: expert memory per rank in experts).

    ``solve_cache``: optional ``callable(key: str, solve: () -> Placement) -> Placement`` that
    may return a stored placement for ``key`` instead of solving (tests cache solves with it).
    ``embedding``: optional ``[V, H]`` model embedding; unseen tokens then use their nearest
    profiled neighbour (:func:`.tables.nearest_profiled_rows`).
    ``policies``: optional ``{method: PlacementPolicy}`` solving those rows instead of the
    registry's policy of that name, e.g. a Sem-MoE variant under its own row (and cache) name;
    a row is deployed with its tables when its policy is Sem-MoE's.
    """
    config = _with_decode_weight(config, profile)
    rows = {}
    for name in methods:
        policy = (policies or {}).get(name) or get_policy(name)
        R = redundant if policy.supports_redundant else 0
        start = time.perf_counter()

        def solve(policy=policy, R=R):
            return policy.solve(profile, ep_size, mode=config.mode, seed=seed, redundant=R, progress=progress)

        if solve_cache is None:
            placement = solve()
        else:
            key = f"{name}-{profile.fingerprint()}-ep{ep_size}-{config.mode}-s{seed}-r{R}"
            placement = solve_cache(key, solve)
        solve_s = time.perf_counter() - start
        tables = build_tables(profile, placement, mode=config.mode, embedding=embedding)
        scheduled = evaluate(trace, placement, tables, config)
        row = scheduled if policy.name == "semmoe" else evaluate(trace, placement, None, config)
        row = dict(row, lar_with_semmoe_sched=scheduled["lar"], solve_s=solve_s, redundant=R,
                   experts_per_device=placement.experts_per_device)
        rows[name] = row
    vanilla = rows.get("vanilla") or evaluate(
        trace, get_policy("vanilla").solve(profile, ep_size), None, config
    )
    for row in rows.values():
        row["a2a_ratio"] = (1.0 - row["lar"]) / (1.0 - vanilla["lar"])
    return rows


def _with_decode_weight(config: EvalConfig, profile: RoutingTrace) -> EvalConfig:
    """``config`` with the decode weight resolved from the profile (see :func:`decode_weight`)."""
    from dataclasses import replace

    return replace(config, dp_decode_weight=decode_weight(profile, config))


def compare_seeds(trace: RoutingTrace, profile_frac: float, seeds: list[int], ep_size: int,
                  methods: list[str], config: EvalConfig, *, redundant: int = 0, progress=None,
                  solve_cache=None, policies: dict | None = None) -> dict[str, dict]:
    """:func:`compare_methods` on the request split of every seed (profile ``profile_frac``,
    evaluate the rest; the seed also seeds the solvers), aggregated by :func:`aggregate_seeds`."""
    per_seed = []
    for seed in seeds:
        profile, held_out = trace.split(profile_frac, seed)
        per_seed.append(compare_methods(profile, held_out, ep_size, methods, config, seed=seed,
                                        redundant=redundant, progress=progress, solve_cache=solve_cache,
                                        policies=policies))
    return aggregate_seeds(per_seed)


def aggregate_seeds(per_seed: list[dict[str, dict]]) -> dict[str, dict]:
    """``[{method: {key: value}}]`` per seed → ``{method: {key: {"mean", "sd", "per_seed"}}}``.

    ``sd`` is the sample standard deviation (``ddof=1``; 0 for one seed). A list-valued figure
    (``lar_per_layer``) is aggregated element-wise; any other figure (``rank_load_curve``) keeps
    only ``per_seed``.
    """
    out = {}
    for name in per_seed[0]:
        out[name] = {}
        for key in per_seed[0][name]:
            values = [rows[name][key] for rows in per_seed]
            if isinstance(values[0], (int, float, np.floating, np.integer)):
                values = [float(v) for v in values]
            elif not (isinstance(values[0], list) and all(isinstance(v, (int, float)) for v in values[0])):
                out[name][key] = {"per_seed": values}
                continue
            arr = np.asarray(values, np.float64)
            sd = np.std(arr, axis=0, ddof=1) if len(values) > 1 else np.zeros_like(arr[0])
            out[name][key] = {"mean": np.mean(arr, axis=0).tolist(), "sd": np.asarray(sd).tolist(),
                              "per_seed": values}
    return out


def placement_cache(directory: str):
    """A ``solve_cache`` for :func:`compare_methods` that stores placements as ``.npz`` files
    under ``directory``, keyed by the solve's inputs and a hash of the solver's source files
    (so an edited solver never reads a stale placement)."""
    import hashlib
    import os
    from pathlib import Path

    from . import policy as policy_pkg

    here = Path(__file__).parent
    policy_dir = Path(policy_pkg.__file__).parent
    baseline = [p for p in sorted(policy_dir.glob("*.py")) if p.name != "semmoe.py"]
    # Sem-MoE's solve also simulates the online scheduler with tables (replicas for locality)
    semmoe = baseline + [policy_dir / "semmoe.py"] + [here / f for f in
                                                      ("scheduling.py", "tables.py", "evaluate.py", "affinity.py")]

    def digest(files):
        return hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()[:12]

    codes = {"semmoe": digest(semmoe), "": digest(baseline)}

    def cached(key: str, solve):
        code = codes["semmoe"] if key.startswith("semmoe-") else codes[""]
        path = os.path.join(directory, f"{key}-{code}.npz")
        if os.path.exists(path):
            with np.load(path) as data:
                replicas = data["replicas"] if data["replicas"].shape[2] else None
                return Placement(data["expert_device"], int(data["ep_size"]), str(data["method"]), replicas)
        placement = solve()
        os.makedirs(directory, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp.npz"
        np.savez(tmp, expert_device=placement.expert_device, replicas=placement.replicas,
                 ep_size=placement.ep_size, method=placement.method)
        os.replace(tmp, path)
        return placement

    return cached
