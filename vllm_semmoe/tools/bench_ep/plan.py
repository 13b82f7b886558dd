"""Planning (parent process): solve every method on the profile split and lay out, per method,
the token rows of every step and the rank of each token at each layer; and what that routing
implies without running anything (:func:`analytic_counts`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np

from ...core.capture_store import as_trace
from ...core.schedulers import SAMPLES, dp_steps, tp_steps
from ...core.trace import first_layers
from ...evaluation.cost_model import step_counts

DEFAULT_METHODS = ("vanilla", "eplb", "semmoe")


@dataclass
class BenchPlan:
    """What every rank replays: the tokens of every batch and the rank of each per layer.

    Attributes:
        mode, ranks: serving mode and EP size.
        experts: ``[M, L, K]`` routed expert ids of every token used by any method.
        token_gid: ``[M]`` index of each of those tokens in the evaluation trace (seeds its
            hidden state and gate weights).
        methods: method names, in run order.
        placements: method → its solved :class:`~vllm_semmoe.core.placement.Placement` (home ranks
            and, with ``R`` redundant slots, ``R`` replicas per rank and layer).
        step_rows: method → ``(rows [P], offsets [S+1])``: rows of ``experts`` in batch ``s``.
        step_device: method → ``[P, L]`` int16 rank of each batch row per layer.
        step_serving: method → ``[P, L, K]`` int16 rank computing each activation of each
            batch row (:meth:`~vllm_semmoe.core.placement.Placement.serving_device`; EPLB's replicas
            as vLLM's EPLB picks them, :func:`vllm_semmoe.core.policy.eplb.vllm_serving_device`).
        eval_tokens, profile_tokens: sizes of the split.
        solve_s: method → seconds to solve its placement.
    """

    mode: str
    ranks: int
    experts: np.ndarray
    token_gid: np.ndarray
    methods: list
    placements: dict = field(default_factory=dict)
    step_rows: dict = field(default_factory=dict)
    step_device: dict = field(default_factory=dict)
    step_serving: dict = field(default_factory=dict)
    eval_tokens: int = 0
    profile_tokens: int = 0
    solve_s: dict = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return self.experts.shape[1]

    @property
    def top_k(self) -> int:
        return self.experts.shape[2]

    def num_steps(self, method: str) -> int:
        return len(self.step_rows[method][1]) - 1


def plan_bench_ep(trace, ranks: int, mode: str, methods, *, layers: int | None = None,
                  batch_tokens: int = 512, max_batches: int | None = None, profile_frac: float = 0.2,
                  seed: int = 0, redundant: int = 0, progress=None, config=None,
                  sample: str = "head") -> BenchPlan:
    """Solve every method on the profile part of ``trace`` and schedule the rest.

    ``max_batches`` replays that many steps of the evaluation stream: with ``sample="head"``
    its first ones, with ``"spread"`` ones spread evenly over the whole stream
    (:func:`sample_steps`; every step scheduled as in the whole run).

    ``trace`` is a path or a :class:`~vllm_semmoe.core.trace.RoutingTrace`; ``layers`` keeps the
    first that many MoE layers (before solving). ``redundant``: replica slots per rank ``R``
    for the methods that replicate (``semmoe``; the others keep ``R = 0``, as in
    :func:`~vllm_semmoe.evaluation.evaluate.compare_methods`). ``config``: the
    :class:`~vllm_semmoe.evaluation.evaluate.EvalConfig` the online scheduling runs with (default: its
    defaults; e.g. other DP knobs); its mode and batch size are this call's. The replicas are
    chosen against the default rule either way (``SemMoEPolicy.solve``). Deterministic for a seed.
    """
    from ...core import schedulers as ev
    from ...core.modes import ServingMode, serving_mode
    from ...core.policy import get_policy
    from ...core.policy.base import check_redundant
    from ...core.policy.eplb import rank_rows, served_by_vllm_eplb, vllm_serving_device
    from ...core.tables import build_tables

    mode = serving_mode(mode)
    config = replace(config or ev.EvalConfig(), mode=mode, batch_tokens=batch_tokens)
    methods = list(methods)
    if not methods:
        raise ValueError("no methods given")
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"max_batches must be >= 1, got {max_batches}")
    if sample not in SAMPLES:
        raise ValueError(f"sample must be one of {', '.join(SAMPLES)}, got {sample!r}")
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    full = first_layers(as_trace(trace), layers)
    if full.num_experts % ranks:
        raise ValueError(f"{full.num_experts} experts cannot be split evenly over {ranks} ranks")
    check_redundant(redundant, full.num_experts, ranks)
    profile, rest = full.split(profile_frac, seed)
    E = ranks
    plan_rows, plan_dev, placements, solve_s = {}, {}, {}, {}
    if mode == ServingMode.TP:
        tp_rows, offsets, sub = tp_steps(rest, batch_tokens, max_batches, sample)
    for i, name in enumerate(methods):
        if progress:
            progress(i, len(methods), f"solving {name}")
        start = time.perf_counter()
        policy = get_policy(name)
        R = redundant if policy.supports_redundant else 0
        placements[name] = placement = policy.solve(profile, ranks, mode=mode, seed=seed, redundant=R)
        solve_s[name] = time.perf_counter() - start
        tables = build_tables(profile, placement, mode=mode) if name == "semmoe" else None
        if mode == ServingMode.TP:
            device, _ = ev.tp_devices(sub, tables, E, config)
            plan_rows[name] = (tp_rows, offsets)
            plan_dev[name] = device[tp_rows].astype(np.int16)
        else:
            rank, _ = ev.dp_ranks(rest, tables, E, config)
            plan_rows[name], plan_dev[name] = dp_steps(rest, rank, E, batch_tokens, max_batches, sample)
    if progress:
        progress(len(methods), len(methods), "solving")
    used = np.unique(np.concatenate([plan_rows[m][0] for m in methods]))
    source = rest if mode == ServingMode.DP else sub
    plan = BenchPlan(mode=mode, ranks=ranks, experts=np.ascontiguousarray(source.experts[used]).astype(np.int16),
                     token_gid=used, methods=methods, placements=placements, solve_s=solve_s,
                     eval_tokens=rest.num_tokens, profile_tokens=profile.num_tokens)
    for m in methods:
        rows, off = plan_rows[m]
        plan.step_rows[m] = (np.searchsorted(used, rows).astype(np.int64), off)
        plan.step_device[m] = np.ascontiguousarray(plan_dev[m])
        if served_by_vllm_eplb(placements[m]):  # vLLM's EPLB: each copy by a hash of the token's row
            serving = vllm_serving_device(placements[m].physical_to_logical(), E, source.experts[rows],
                                          rank_rows(plan_dev[m], off[:-1]))
        else:
            serving = placements[m].serving_device(source.experts[rows], plan_dev[m])
        plan.step_serving[m] = serving.astype(np.int16)
    return plan


def analytic_counts(plan: BenchPlan, method: str) -> dict:
    """What the routing implies, without running anything.

    Returns ``rows [L, E, E]`` (rows each source rank must dispatch to each other rank:
    tokens with at least one expert there; ``step_rows [S, L, E, E]`` per step),
    ``activations_per_rank [S, L, E]`` ((token, expert) pairs each rank computes), ``local`` /
    ``activations`` (local and all (token, layer, expert) activations), ``tokens``
    (token-batches, counted once per batch). Counted by :func:`.cost_model.step_counts`.
    """
    rows_idx, offsets = plan.step_rows[method]
    dev = plan.step_device[method]  # [P, L]
    ed = plan.step_serving[method].astype(np.int64)  # [P, L, K]
    rows, activations = step_counts(ed, dev, offsets, plan.ranks)
    return {
        "rows": rows.sum(axis=0),
        "step_rows": rows,
        "activations_per_rank": activations,
        "local": int((ed == dev.astype(np.int64)[..., None]).sum()),
        "activations": int(ed.size),
        "tokens": int(len(rows_idx)),
    }
