"""Offline evaluation of placements and schedules on a routing trace.

Every figure is counted per (token, layer, expert) activation:

- ``lar``: share of activations whose expert sits on the device the token is processed on;
- ``lar_token``: share of (token, layer) pairs with at least one local expert;
- ``oracle_lar``: the same placement with a perfect, unconstrained device choice (TP: per token
  and layer; DP: per request, one device for all layers) — the ceiling of data scheduling;
- ``imbalance``: max/mean tokens per device (TP: per batch and layer, averaged; DP: prompt
  tokens per rank over the whole evaluation); ``expert_imbalance``: max/mean expert activations per device, averaged over layers.

Data scheduling per mode: with tables, Sem-MoE's (:mod:`.scheduling`); without, the engines'
default — TP: the reduce-scatter's contiguous slices; DP: requests dealt round-robin.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numba
import numpy as np

from . import scheduling
from .placement import Placement
from .policy import get_policy
from .tables import SemMoETables, build_tables, device_counts, majority_device
from .trace import RoutingTrace


@dataclass(frozen=True)
class EvalConfig:
    """How the online side is simulated."""

    mode: str = "tp"  # "tp" or "dp"
    batch_tokens: int = 512  # TP: tokens per forward batch (requests packed in arrival order);
    # 0 = one batch per request of the trace (a live capture in engine-step order)
    dp_window: int = 512  # DP: requests remembered by the hard guard
    dp_eps: float = float("inf")  # DP: optional hard guard on token load over the window (off)
    dp_price_step: float = 0.03  # DP: rank-price step (balances load by preference strength)
    round_robin_mask: bool = False  # DP: the paper's mask instead of the token-load rule


def evaluate(trace: RoutingTrace, placement: Placement, tables: SemMoETables | None,
             config: EvalConfig) -> dict:
    """Metrics of ``placement`` on ``trace``, scheduled with ``tables`` (or the default)."""
    if config.mode not in ("tp", "dp"):
        raise ValueError(f"mode must be 'tp' or 'dp', got {config.mode!r}")
    E = placement.ep_size
    counts = device_counts(trace.experts, placement.expert_device, E)  # [T, L, E]
    if config.mode == "tp":
        device, imbalance = _tp_devices(trace, counts, tables, E, config.batch_tokens)
        oracle = counts.max(axis=2).sum()
    else:
        rank, imbalance = _dp_ranks(trace, tables, E, config)
        device = np.repeat(rank, np.diff(trace.offsets))[:, None].repeat(trace.num_layers, 1)
        per_request = np.add.reduceat(counts.sum(axis=1, dtype=np.int64), trace.offsets[:-1], axis=0)
        oracle = per_request.max(axis=1).sum()
    local = np.take_along_axis(counts, device[:, :, None], axis=2)[:, :, 0]
    activations = counts.size // E * trace.top_k
    expert_load = counts.sum(axis=0, dtype=np.int64)  # [L, E]
    out = {
        "lar": float(local.sum() / activations),
        "lar_token": float((local > 0).mean()),
        "oracle_lar": float(oracle / activations),
        "imbalance": float(imbalance),
        "expert_imbalance": float((expert_load.max(axis=1) / expert_load.mean(axis=1)).mean()),
        "lar_per_layer": (local.sum(axis=0) / (trace.num_tokens * trace.top_k)).tolist(),  # [L]
    }
    if config.mode == "dp":
        out["rank_load_curve"] = rank_load_curve(rank, np.diff(trace.offsets), E)
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


def _tp_devices(trace, counts, tables, ep_size, batch_tokens):
    """``([T, L] device per token and layer, mean per-batch token imbalance)``.

    Batches are ``batch_tokens`` consecutive tokens, or the trace's requests when it is 0
    (a step-ordered live capture, where each "request" is one engine step).
    """
    T, L = trace.num_tokens, trace.num_layers
    starts = trace.offsets[:-1] if batch_tokens == 0 else np.arange(0, T, batch_tokens)
    ends = np.append(starts[1:], T)
    device = np.empty((T, L), np.int64)
    if tables is None:
        for s, e in zip(starts, ends):
            device[s:e] = scheduling.contiguous_slices(e - s, ep_size)[:, None]
    else:
        rows = tables.token_rows(trace.tokens)
        major = majority_device(counts)
        history = np.full((T, L), -1, np.int64)
        history[:, 2:] = major[:, :-2] * ep_size + major[:, 1:-1]
        t2d = tables.t2d_score.astype(np.float32)
        for l in range(L):
            for s, e in zip(starts, ends):
                device[s:e, l], _, _ = scheduling.tp_schedule(
                    rows[s:e], history[s:e, l], t2d[l], tables.oov_score[l], tables.markov[l], ep_size
                )
    return device, _batch_imbalance_kernel(device, starts.astype(np.int64), ep_size)


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
        rank = np.arange(R) % ep_size
    else:
        votes = scheduling.request_votes(
            tables.token_rows(trace.tokens), trace.offsets, tables.t2d_score.astype(np.float32),
            tables.oov_score,
        )
        rank = scheduling.dp_assign(votes, lengths, config.dp_price_step, config.dp_eps, config.dp_window,
                                    config.round_robin_mask)
    load = np.bincount(rank, weights=lengths, minlength=ep_size)
    return rank, float(load.max() / load.mean())


def compare_methods(profile: RoutingTrace, trace: RoutingTrace, ep_size: int, methods: list[str],
                    config: EvalConfig, *, seed: int = 0, progress=None) -> dict[str, dict]:
    """Solve every method on ``profile`` and evaluate it on ``trace`` side by side.

    Each row holds :func:`evaluate`'s figures for the method as deployed (``semmoe`` with its
    tables; the baselines with the engines' default data scheduling), plus
    ``lar_with_semmoe_sched`` (the same placement under Sem-MoE's scheduler, which separates
    placement quality from scheduling), ``a2a_ratio`` (remote activations relative to
    ``vanilla``) and ``solve_s``.
    """
    rows = {}
    for name in methods:
        start = time.perf_counter()
        placement = get_policy(name).solve(profile, ep_size, mode=config.mode, seed=seed, progress=progress)
        solve_s = time.perf_counter() - start
        tables = build_tables(profile, placement, mode=config.mode)
        scheduled = evaluate(trace, placement, tables, config)
        row = scheduled if name == "semmoe" else evaluate(trace, placement, None, config)
        row = dict(row, lar_with_semmoe_sched=scheduled["lar"], solve_s=solve_s)
        rows[name] = row
    vanilla = rows.get("vanilla") or evaluate(
        trace, get_policy("vanilla").solve(profile, ep_size), None, config
    )
    for row in rows.values():
        row["a2a_ratio"] = (1.0 - row["lar"]) / (1.0 - vanilla["lar"])
    return rows
