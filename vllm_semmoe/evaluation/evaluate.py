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
  picks, the rule ``bench-ep`` moves tokens by; the ``eplb`` method's replicated placement
  without tables is served as vLLM's EPLB serves it, each copy picked by a hash of the token's
  row in its rank's batch wherever the token is, :func:`.policy.eplb.vllm_serving_device`, and
  ``lar`` counts the activations whose picked copy is on the token's device).
- DP only, the lock-step balance over windows of ``W = 32 × ranks`` consecutive requests
  (:func:`.scheduling.window_imbalance`), with work = prompt tokens + a decode weight
  (:func:`.scheduling.request_work`): ``window_imbalance`` of the method's rank choice, and on
  the same arrivals ``window_imbalance_<balancer>`` of each locality-blind balancer of
  :data:`DP_BASELINES` (online least-loaded by work, round-robin, SGLang's ``total_requests`` and
  ``total_tokens`` load-balance methods), and ``lar_<balancer>``: the LAR of the same placement
  with that balancer's rank choice; ``request_imbalance``: the same windows counting requests.

Multi-seed runs (:func:`compare_seeds`) report every figure as ``{"mean", "sd", "per_seed"}``.

Data scheduling per mode: with tables, Sem-MoE's (:mod:`.scheduling`); without, the engines'
default — TP: the reduce-scatter's contiguous slices; DP: requests dealt round-robin.
"""

from __future__ import annotations

import os
import time

import numpy as np

from ..core import scheduling
from ..core.modes import ServingMode, serving_mode
from ..core.placement import Placement
from ..core.policy import get_policy
from ..core.policy.eplb import rank_rows, served_by_vllm_eplb, vllm_serving_device
from ..core.capture_store import read_segment, segment_path
from ..core.schedulers import (EvalConfig, batch_starts, check_inputs_fit, decode_weight, dp_ranks,
                               request_devices, scheduling_tables, tp_devices)
from ..core.tables import SemMoETables, build_tables, device_counts, placement_device_counts
from ..core.trace import RoutingTrace, check_fit


def evaluate(trace: RoutingTrace, placement: Placement, tables: SemMoETables | None,
             config: EvalConfig) -> dict:
    """Metrics of ``placement`` on ``trace``, scheduled with ``tables`` (or the default).
    Raises :class:`.trace.TraceMismatch` if they are for different model shapes."""
    check_inputs_fit(trace, placement, tables)
    mode = serving_mode(config.mode)
    E = placement.ep_size
    counts = placement_device_counts(trace.experts, placement)  # [T, L, E]
    extra = {}
    if mode == ServingMode.TP:
        device, imbalance = tp_devices(trace, tables, E, config)
        oracle = counts.max(axis=2).sum()
    else:
        rank, imbalance = dp_ranks(trace, tables, E, config)
        baselines = dp_baseline_ranks(trace, E, config)
        extra = dp_balance(trace, rank, E, config, baselines)
        device = request_devices(trace, rank)
        per_request = np.add.reduceat(counts.sum(axis=1, dtype=np.int64), trace.offsets[:-1], axis=0)
        oracle = per_request.max(axis=1).sum()
    local, serving = _local_activations(trace, placement, tables, config, counts, device)
    activations = counts.size // E * trace.top_k
    if serving is not None:
        expert_load = np.stack([np.bincount(serving[:, l].ravel(), minlength=E) for l in range(trace.num_layers)])
    else:
        expert_load = counts.sum(axis=0, dtype=np.int64)  # [L, E]
    if mode != ServingMode.TP:
        for name, blind in baselines.items():
            blind_local = _local_activations(trace, placement, tables, config, counts,
                                             request_devices(trace, blind))[0]
            extra[f"lar_{name}"] = float(blind_local.sum() / activations)
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


def _local_activations(trace, placement, tables, config, counts, device):
    """``([T, L] activations served on the token's device, [T, L, K] serving device or None)``
    of ``device [T, L]`` under ``placement`` (``counts``: its :func:`.tables.placement_device_counts`);
    the serving device only for a replicated placement (see module docstring)."""
    local = np.take_along_axis(counts, device[:, :, None], axis=2)[:, :, 0]
    if not placement.redundant:
        return local, None
    if tables is None and served_by_vllm_eplb(placement):  # vLLM's EPLB: copies by token hash
        serving = vllm_serving_device(placement.physical_to_logical(), placement.ep_size, trace.experts,
                                      rank_rows(device, batch_starts(trace, config)))
        return (serving == device[:, :, None]).sum(axis=2), serving
    return local, placement.serving_device(trace.experts, device)  # [T, L, K]


#: The locality-blind DP balancers every DP rank choice is reported beside (:func:`dp_baseline_ranks`).
DP_BASELINES = ("least_loaded", "round_robin", "sglang_total_requests", "sglang_total_tokens")


def dp_baseline_ranks(trace: RoutingTrace, ep_size: int, config: "EvalConfig") -> dict[str, np.ndarray]:
    """``{balancer: [R] rank per request}`` for every :data:`DP_BASELINES` balancer on the trace's
    arrivals: least-loaded by work (:func:`.scheduling.least_loaded_assign`), round-robin, and
    SGLang's ``total_requests`` / ``total_tokens`` (:func:`.scheduling.sglang_total_requests_assign`,
    :func:`.scheduling.sglang_total_tokens_assign`: requests, prompt tokens), all over the
    balance window's in-flight requests."""
    lengths = np.diff(trace.offsets)
    work = scheduling.request_work(lengths, decode_weight(None, config))
    W = config.window(ep_size)
    return {
        "least_loaded": scheduling.least_loaded_assign(work, ep_size, W),
        "round_robin": scheduling.round_robin_assign(len(work), ep_size),
        "sglang_total_requests": scheduling.sglang_total_requests_assign(len(work), ep_size, W),
        "sglang_total_tokens": scheduling.sglang_total_tokens_assign(lengths.astype(np.float64), ep_size, W),
    }


def dp_balance(trace: RoutingTrace, rank: np.ndarray, ep_size: int, config: "EvalConfig",
               baselines: dict[str, np.ndarray] | None = None) -> dict:
    """Lock-step balance of a DP rank choice ``rank [R]`` beside the locality-blind references
    on the same arrivals (see module docstring for the keys); ``baselines``: their
    :func:`dp_baseline_ranks` where the caller has them."""
    work = scheduling.request_work(np.diff(trace.offsets), decode_weight(None, config))
    W = config.window(ep_size)
    out = {"window_imbalance": scheduling.window_imbalance(rank, work, ep_size, W)}
    baselines = dp_baseline_ranks(trace, ep_size, config) if baselines is None else baselines
    for name, blind in baselines.items():
        out[f"window_imbalance_{name}"] = scheduling.window_imbalance(blind, work, ep_size, W)
    out["request_imbalance"] = scheduling.window_imbalance(rank, np.ones(len(work)), ep_size, W)
    return out


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
    check_fit(profile, trace, names=("the profile trace", "the evaluation trace"),
              hint="profile and evaluate on routing of the same model")
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
            placement = solve_cache(solve_key(name, profile, ep_size, config.mode, seed, R), solve)
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


def solve_key(name: str, profile: RoutingTrace, ep_size: int, mode: str, seed: int = 0, redundant: int = 0) -> str:
    """The ``solve_cache`` key of method ``name``'s solve on ``profile`` (see :func:`compare_methods`)."""
    return f"{name}-{profile.fingerprint()}-ep{ep_size}-{mode}-s{seed}-r{redundant}"


def _with_decode_weight(config: EvalConfig, profile: RoutingTrace) -> EvalConfig:
    """``config`` with the decode weight resolved from the profile (see :func:`decode_weight`)."""
    from dataclasses import replace

    return replace(config, dp_decode_weight=decode_weight(profile, config))


def compare_seeds(trace: RoutingTrace, profile_frac: float, seeds: list[int], ep_size: int,
                  methods: list[str], config: EvalConfig, *, redundant: int = 0, progress=None,
                  solve_cache=None, policies: dict | None = None, hold_out_tuning: bool = True) -> dict[str, dict]:
    """:func:`compare_methods` on the request split of every seed (profile ``profile_frac`` of the
    trace's requests, evaluate the rest; the seed also seeds the solvers), aggregated by
    :func:`aggregate_seeds`. With ``hold_out_tuning`` (the default) no split uses the tuning
    split's requests, the ones the knobs were chosen on (:data:`.trace.TUNING_FRAC`)."""
    per_seed = []
    for seed in seeds:
        profile, held_out = trace.split(profile_frac, seed, hold_out_tuning=hold_out_tuning)
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


#: steps of a capture replayed at once (:func:`replay_capture`; bounds memory however long the capture)
REPLAY_STEPS = 256
REPLAY_TOKENS = 1 << 16


class StepReplay:
    """:func:`evaluate` replayed on an engine's forward steps, as the engine batched them, against
    ``tables``' placement, accumulated chunk by chunk (the steps themselves are not kept).

    Not a live measurement: it recomputes what the scheduler would do from the captured routing
    (the capture summary's ``replayed``). What the engine really did is in the engines' own
    counters (``moe_traffic``: bytes and local / remote activations counted in the MoE layers).

    Data-parallel serving (``dp_size > 1``): every token of the engine lives on DP rank
    ``dp_rank``, whose EP devices are ``dp_rank * E/dp_size ..``; an activation is local when its
    expert sits on one of them. Otherwise tokens are scheduled per forward step as the engine
    schedules them (:func:`.schedulers.scheduling_tables`: Sem-MoE's TP scheduler with Sem-MoE's
    tables, else vLLM's contiguous slices), exactly as :func:`evaluate` does for a trace with one
    batch per step; the figures equal ``evaluate`` on all steps at once.
    """

    def __init__(self, tables: SemMoETables, *, vocab_size: int, dp_rank: int = 0, dp_size: int = 1):
        self.tables, self.vocab_size = tables, vocab_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        L, E = tables.num_layers, tables.ep_size
        self.steps = self.tokens = 0
        self.local = self.activations = 0.0
        self.local_tokens = self.oracle = self.imbalance_sum = 0.0
        self.expert_load = np.zeros((L, E), np.int64)

    def add(self, tokens: np.ndarray, experts: np.ndarray, step_lengths: list[int]) -> None:
        """tokens ``[n]``, experts ``[n, L, K]`` logical ids, step_lengths: tokens per step."""
        tables = self.tables
        n, L, K = experts.shape
        self.steps += len(step_lengths)
        self.tokens += n
        self.activations += n * L * K
        counts = device_counts(experts, tables.placement.expert_device, tables.ep_size)  # [n, L, E]
        self.expert_load += counts.sum(axis=0, dtype=np.int64)
        if self.dp_size > 1:
            group = tables.ep_size // self.dp_size
            self.local += int(counts[:, :, self.dp_rank * group : (self.dp_rank + 1) * group].sum())
            return
        steps = RoutingTrace.from_arrays(tokens.astype(np.int32), experts, np.concatenate([[0], np.cumsum(step_lengths)]),
                                         vocab_size=self.vocab_size, num_experts=tables.num_experts)
        # one thread: it runs in an engine's process, whose siblings may be flushing too
        result = evaluate(steps, tables.placement, scheduling_tables(tables),
                          EvalConfig(mode=ServingMode.TP, batch_tokens=0, threads=1))
        self.local += result["lar"] * n * L * K
        self.local_tokens += result["lar_token"] * n * L
        self.oracle += result["oracle_lar"] * n * L * K
        self.imbalance_sum += result["imbalance"] * len(step_lengths) * L

    def result(self) -> dict:
        """The figures so far (``{}`` before any step)."""
        if not self.steps:
            return {}
        lar = self.local / self.activations
        if self.dp_size > 1:
            local = int(self.local)
            out = {"lar": lar, "local_activations": local, "remote_activations": int(self.activations) - local}
        else:
            load = self.expert_load
            L = load.shape[0]
            out = {"lar": lar, "lar_token": self.local_tokens / (self.tokens * L),
                   "oracle_lar": self.oracle / self.activations, "imbalance": self.imbalance_sum / (self.steps * L),
                   "expert_imbalance": float((load.max(axis=1) / np.maximum(load.mean(axis=1), 1e-12)).mean())}
        out["steps"] = self.steps
        out["tokens"] = self.tokens
        return out


def replay_capture(path: str, tables: SemMoETables, *, dp_rank: int = 0, dp_size: int = 1) -> dict:
    """:class:`StepReplay` of the steps DP rank ``dp_rank``'s engine appended to the capture at
    ``path`` (its segment, :func:`.capture_store.segment_path`, read as it is now: a running
    engine's too), in chunks of :data:`REPLAY_STEPS` steps or :data:`REPLAY_TOKENS` tokens.
    ``{}`` when the segment holds no step. Raises :class:`.trace.TraceError` for a damaged segment."""
    header, steps, _ = read_segment(segment_path(path, dp_rank))
    if header is None:
        return {}
    replay = StepReplay(tables, vocab_size=int(header["vocab_size"]), dp_rank=dp_rank, dp_size=dp_size)
    chunk: list[dict] = []
    pending = 0
    for i, step in enumerate(steps):
        chunk.append(step)
        pending += len(step["token"])
        if len(chunk) >= REPLAY_STEPS or pending >= REPLAY_TOKENS or i == len(steps) - 1:
            replay.add(np.concatenate([s["token"] for s in chunk]).astype(np.int64),
                       np.concatenate([s["experts"] for s in chunk]).astype(np.int64), [len(s["token"]) for s in chunk])
            chunk, pending = [], 0
    return replay.result()


def placement_cache(directory: str):
    """A ``solve_cache`` for :func:`compare_methods` that stores placements as ``.npz`` files
    under ``directory``, keyed by the solve's inputs and a hash of the solver's source files
    (so an edited solver never reads a stale placement)."""
    import hashlib
    from pathlib import Path

    from ..core import policy as policy_pkg

    policy_dir = Path(policy_pkg.__file__).parent
    core = policy_dir.parent
    baseline = [p for p in sorted(policy_dir.glob("*.py")) if p.name != "semmoe.py"]
    # Sem-MoE's solve also simulates the online scheduler with tables (replicas for locality)
    semmoe = baseline + [policy_dir / "semmoe.py"] + [core / f for f in
                                                      ("scheduling.py", "schedulers.py", "tables.py", "affinity.py")]

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
