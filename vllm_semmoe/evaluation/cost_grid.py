"""The cost grid: every method, replica count, step size, model width and hardware set, modelled.

``semmoe cost --grid`` (:func:`run_grid`) solves each (mode, method, R) placement once on the
profile split, schedules the rest of the trace with it at every step size as a deployment
under load runs it (:func:`vllm_semmoe.evaluation.step_time.schedule`; TP: consecutive steps of
``B`` tokens as ``bench-ep`` replays them, Sem-MoE's scheduler with its tables, the baselines on
the reduce-scatter's contiguous slices; DP: requests on ranks by Sem-MoE's router or
round-robin, ranks in lock step with ``ceil(B/E)`` tokens each per step, every rank full),
counts every step (:func:`vllm_semmoe.evaluation.cost_model.step_traffic`; EPLB's replicas serve their
tokens as vLLM's EPLB picks them, :func:`vllm_semmoe.core.policy.eplb.vllm_serving_device`) and models it on every
hardware set and width (:mod:`vllm_semmoe.evaluation.cost_model`). TP mode also gets ``stock_tp``: stock
vLLM TP + EP on vanilla's placement (every rank holds every token, computes its own experts on
all of them, two all-reduces per layer, no exchange).

Sem-MoE's rows are the time objective's (:mod:`vllm_semmoe.evaluation.time_objective`): for each target
(hardware set, step size, width) the variant that was fastest on the profile, solved on the
whole profile and measured on the rest like every other method; its ``variant`` column names it
and ``time_objective`` in the result lists every choice.

Each cell is one flat row (times in µs per MoE layer per step, the mean over the steps and
layers of the evaluation stream):

- ``decision_us`` (TP rows scheduled with Sem-MoE's tables: the decision as measured on an H200,
  :data:`.cost_model.TP_DECISION_US`; zero elsewhere), ``collectives_us``, ``dispatch_us``,
  ``combine_us``, ``experts_us`` (the straggler rank's), ``total_us`` (their sum),
  ``experts_mean_us`` (expert work spread evenly);
- ``time_bound_us``: the same per-step totals spread evenly over ranks (the method's own
  locality without a straggler; ``total_us - time_bound_us`` is what the straggler costs);
- ``oracle_time_bound_us``, ``oracle_lar``: the same placement with each token (TP, per layer)
  or request (DP) on the rank holding most of its experts, spread evenly (the ceiling of data
  scheduling with a free decision, :mod:`vllm_semmoe.evaluation.evaluate`'s ``oracle_lar``);
- ``time_ratio_vs_vanilla``: ``total_us`` over vanilla's (R = 0) in the same mode, hardware,
  step size and width.

Pure NumPy on top of the solvers; nothing here imports vLLM.
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace

import numpy as np

from .cost_model import DSV2_LITE, DSV3_WIDTH, HARDWARE, MoEShape, StepTraffic, even_spread, step_traffic
from .step_time import Target, collectives_for, decides, node_groups, step_cost, stream_traffic

GRID_MODES = ("tp", "dp")
GRID_METHODS = ("vanilla", "eplb", "moetuner", "semmoe")
GRID_REDUNDANT = (0, 1, 2)
GRID_BATCHES = (128, 4096)  # decode-sized and prefill-sized steps (tokens per step over all ranks)
GRID_SHAPES = (DSV2_LITE, DSV3_WIDTH)  # V3's widths are a what-if on the trace's own experts and top-k
#: the columns every row has (the grid's documented flat-row contract), in order
ROW_KEYS = ("mode", "method", "redundant", "hardware", "calibrated", "nodes", "batch_tokens", "hidden",
            "expert_intermediate", "lar", "dispatch_us", "combine_us", "experts_us", "total_us", "time_bound_us",
            "time_ratio_vs_vanilla")
UNIT = "µs per MoE layer per step (mean over the evaluation stream's steps and the MoE layers)"


def grid_cells(methods=GRID_METHODS, redundant=GRID_REDUNDANT) -> tuple[list, list]:
    """``([(method, R)], [notes])``: every R for methods whose policy replicates, R = 0 for the
    others; a note names each (method, R > 0) the registry cannot solve."""
    from ..core.policy import get_policy

    cells, notes = [], []
    for method in methods:
        replicates = get_policy(method).supports_redundant
        for R in redundant:
            if R == 0 or replicates:
                cells.append((method, R))
            elif method != "vanilla":
                notes.append(f"{method} at R = {R}: the {method} policy does not replicate experts "
                             "(PlacementPolicy.supports_redundant is false); only R = 0 is in the grid")
    return cells, notes


def plan_traffic(plan, method: str, hardware=None) -> StepTraffic:
    """:class:`~vllm_semmoe.evaluation.cost_model.StepTraffic` of one method of a
    :class:`~vllm_semmoe.tools.bench_ep.BenchPlan` (the steps ``bench-ep`` replays)."""
    rows, offsets = plan.step_rows[method]
    return step_traffic(plan.step_serving[method], plan.step_device[method], offsets, plan.ranks,
                        experts=plan.experts[rows], node_groups=node_groups(hardware or HARDWARE))


def _stock_tp(serving, offsets, experts, E, groups) -> StepTraffic:
    """Stock TP + EP: every rank holds the step's tokens and computes its own experts on all of
    them; nothing is exchanged."""
    home = serving[:, :, 0]
    t = step_traffic(serving, home, offsets, E, experts=experts, node_groups=groups)
    zero = np.zeros_like(t.rank_rows)
    return replace(t, rank_rows=zero, expert_rows=zero, node_rows={g: np.zeros_like(v) for g, v in t.node_rows.items()},
                   local=int(serving.size), exchange=False)


def _cost_rows(base: dict, traffic: StepTraffic, bound: StepTraffic, oracle: StepTraffic | None,
               targets, collectives, decision: bool = False) -> list[dict]:
    """One row per target (hardware set and width at ``base``'s step size); ``decision``: the
    schedule decides every layer of every step (counted in the row and its bound, not the oracle's)."""
    out = []
    for t in targets:
        hw = HARDWARE[t.hardware]
        cost = step_cost(traffic, t, collectives, decision)
        row = {**base, "hardware": t.hardware, "calibrated": hw.calibrated, "nodes": hw.nodes, "unit": hw.unit,
               "hidden": t.shape.hidden, "expert_intermediate": t.shape.expert_intermediate, **cost,
               "time_bound_us": step_cost(bound, t, collectives, decision)["total_us"],
               "oracle_time_bound_us": step_cost(oracle, t, collectives)["total_us"] if oracle is not None else None,
               "time_ratio_vs_vanilla": None}
        out.append({**{k: row[k] for k in ROW_KEYS}, **row})  # the contract's columns first
    return out


def add_ratios(rows: list[dict]) -> list[dict]:
    """``time_ratio_vs_vanilla`` of every row: over vanilla R = 0 in the same mode, hardware,
    step size and width (None where the grid has no such vanilla row)."""
    key = lambda r: (r["mode"], r["hardware"], r["batch_tokens"], r["hidden"], r["expert_intermediate"])  # noqa: E731
    base = {key(r): r["total_us"] for r in rows if r["method"] == "vanilla" and r["redundant"] == 0}
    for r in rows:
        b = base.get(key(r))
        r["time_ratio_vs_vanilla"] = r["total_us"] / b if b else None
    return rows


def run_grid(trace, ep: int = 8, *, profile_frac: float = 0.2, seed: int = 0, modes=GRID_MODES,
             methods=GRID_METHODS, redundant=GRID_REDUNDANT, batches=GRID_BATCHES, shapes=GRID_SHAPES,
             hardware=None, layers: int | None = None, max_batches: int | None = None, sample: str = "head",
             progress=None) -> dict:
    """Model the whole grid on ``trace`` (a path or :class:`~vllm_semmoe.core.trace.RoutingTrace`).

    Returns ``{"rows": [flat row per cell], "notes": [...], "solve_s": {...}, "unit": ...,
    "hardware": {name: parameters}}``; rows in (mode, method, R, batch, hardware, width) order.
    """
    from ..core.capture_store import as_trace
    from ..core.trace import first_layers
    from ..core.modes import serving_mode
    from ..core.policy import get_policy
    from ..core.policy.base import check_redundant
    from .time_objective import choose, solve_variants

    hardware = tuple(HARDWARE) if hardware is None else tuple(hardware)
    unknown = [h for h in hardware if h not in HARDWARE]
    if unknown:
        raise ValueError(f"unknown hardware {', '.join(unknown)}; choose from {', '.join(HARDWARE)}")
    if not batches or min(batches) < 1:
        raise ValueError(f"batches must be step sizes >= 1, got {batches}")
    full = first_layers(as_trace(trace), layers)
    for R in redundant:
        check_redundant(R, full.num_experts, ep)
    profile, rest = full.split(profile_frac, seed)
    cells, notes = grid_cells(methods, redundant)
    groups = node_groups(hardware)
    targets = {b: [Target(h, b, shape) for h in hardware for shape in shapes] for b in batches}
    total = len(modes) * len(cells) * len(batches)
    done, rows, solve_s, chosen = 0, [], {}, {}

    def measured(placement, tables, mode, batch):
        s = stream_traffic(rest, placement, tables, mode, batch, groups, max_batches=max_batches, sample=sample,
                           oracle=True)
        return s, even_spread(s["traffic"]), even_spread(s["oracle"])

    for mode in modes:
        mode = serving_mode(mode)
        collectives = collectives_for(mode)
        for method, R in cells:
            if progress:
                progress(done, total, "cost grid")
            start = time.perf_counter()
            if method == "semmoe":  # the time objective: per target, the variant fastest on the profile
                choice = choose(profile, ep, mode, R, [t for b in batches for t in targets[b]], seed=seed,
                                max_batches=max_batches)
                variants = solve_variants(tuple(dict.fromkeys(c.variant for c in choice.values())), profile, ep,
                                          mode, R, seed=seed)
                chosen[f"{mode}/R{R}"] = {f"{t.hardware}/{t.batch_tokens}/{t.shape.hidden}": c.variant
                                          for t, c in choice.items()}
            else:
                placement = get_policy(method).solve(profile, ep, mode=mode, seed=seed, redundant=R)
                variants = {None: (placement, None)}
            solve_s[f"{mode}/{method}/R{R}"] = round(time.perf_counter() - start, 2)
            for batch in batches:
                for variant, (placement, tables) in variants.items():
                    s, bound, oracle = measured(placement, tables, mode, batch)
                    cell = [t for t in targets[batch] if variant is None or choice[t].variant == variant]
                    if not cell:
                        continue
                    base = {"mode": str(mode), "method": method, "redundant": R, "batch_tokens": batch,
                            "steps": s["steps"], "lar": s["traffic"].lar, "oracle_lar": s["oracle"].lar}
                    if variant is not None:
                        base["variant"] = variant
                    rows += _cost_rows(base, s["traffic"], bound, oracle, cell, collectives, decides(mode, tables))
                    if mode == "tp" and method == "vanilla" and R == 0:
                        stock = _stock_tp(s["serving"], s["offsets"], s["experts"], ep, groups)
                        rows += _cost_rows({**base, "method": "stock_tp", "lar": None, "oracle_lar": None}, stock,
                                           even_spread(stock), None, cell, "tp_allreduce")
                done += 1
                if progress:
                    progress(done, total, "cost grid")
    rows.sort(key=lambda r: (r["mode"], r["method"], r["redundant"], r["batch_tokens"], r["hardware"], r["hidden"]))
    return {"rows": add_ratios(rows), "notes": notes, "solve_s": solve_s, "time_objective": chosen, "unit": UNIT,
            "ep": ep, "seed": seed, "profile_frac": profile_frac, "layers": full.num_layers,
            "eval_tokens": rest.num_tokens, "profile_tokens": profile.num_tokens,
            "hardware": {h: asdict(HARDWARE[h]) for h in hardware}}


def semmoe_vs_baselines(rows: list[dict], calibrated_only: bool = True) -> dict:
    """Sem-MoE at each R against vanilla (R = 0) and EPLB at the same R, cell by cell: ``{"cells":
    n, "worst": largest ratio, "over": [(mode, R, hardware, batch, hidden, vs vanilla, vs EPLB)]
    where either ratio exceeds 1.005}`` (calibrated hardware sets only by default)."""
    key = lambda r: (r["mode"], r["hardware"], r["batch_tokens"], r["hidden"])  # noqa: E731
    total = {(r["method"], r["redundant"], *key(r)): r["total_us"] for r in rows}
    cells, worst, over = 0, 0.0, []
    for r in rows:
        if r["method"] != "semmoe" or (calibrated_only and not r["calibrated"]):
            continue
        van, eplb = total.get(("vanilla", 0, *key(r))), total.get(("eplb", r["redundant"], *key(r)))
        if van is None or eplb is None:
            continue
        cells += 1
        ratios = (r["total_us"] / van, r["total_us"] / eplb)
        worst = max(worst, *ratios)
        if max(ratios) > 1.005:
            over.append((r["mode"], r["redundant"], r["hardware"], r["batch_tokens"], r["hidden"], *ratios))
    return {"cells": cells, "worst": worst, "over": over}


def format_grid(result: dict) -> str:
    """Sem-MoE's best R against vanilla and EPLB per (hardware, mode, step size, width)."""
    rows = result["rows"]
    lines = [f"cost grid: EP {result['ep']}, {result['layers']} MoE layers, {len(rows)} rows; "
             f"times in {result['unit']}",
             f"{'hardware':<22}{'cal':>4}{'mode':>5}{'batch':>6}{'hidden':>7}  {'vanilla_us':>10}{'semmoe_R':>9}"
             f"{'variant':>10}{'vs_van':>8}{'vs_eplb':>8}{'stock_tp_x':>11}{'bound_x':>8}{'oracle_x':>9}"]
    index = {}
    for r in rows:
        index.setdefault((r["hardware"], r["mode"], r["batch_tokens"], r["hidden"]), []).append(r)
    for (hw, mode, batch, hidden), group in index.items():
        by = {(r["method"], r["redundant"]): r for r in group}
        van = by.get(("vanilla", 0))
        sem = [r for r in group if r["method"] == "semmoe"]
        if not van or not sem:
            continue
        best = min(sem, key=lambda r: r["total_us"])
        eplb = by.get(("eplb", best["redundant"])) or by.get(("eplb", 0))
        stock = by.get(("stock_tp", 0))
        oracle = min((r["oracle_time_bound_us"] for r in sem if r.get("oracle_time_bound_us") is not None),
                     default=float("nan"))
        lines.append(f"{hw:<22}{'yes' if HARDWARE[hw].calibrated else 'no':>4}{mode:>5}{batch:>6}{hidden:>7}  "
                     f"{van['total_us']:>10.1f}{best['redundant']:>9}{best.get('variant', ''):>10}"
                     f"{best['total_us'] / van['total_us']:>8.3f}"
                     f"{(best['total_us'] / eplb['total_us']) if eplb else float('nan'):>8.3f}"
                     f"{(stock['total_us'] / van['total_us']) if stock else float('nan'):>11.3f}"
                     f"{best['time_bound_us'] / van['total_us']:>8.3f}{oracle / van['total_us']:>9.3f}")
    check = semmoe_vs_baselines(rows)
    if check["cells"]:
        lines.append(f"Sem-MoE at every R against vanilla and against EPLB at the same R, calibrated sets: "
                     f"{len(check['over'])} of {check['cells']} cells slower by more than 0.5 %, "
                     f"worst ratio {check['worst']:.3f}")
        lines += [f"  slower: {m} R={R} {hw} {b}-token hidden {h}: {v:.3f}x vanilla, {e:.3f}x EPLB"
                  for m, R, hw, b, h, v, e in check["over"]]
    return "\n".join(lines + [f"note: {n}" for n in result.get("notes", [])])


__all__ = ["GRID_BATCHES", "GRID_METHODS", "GRID_MODES", "GRID_REDUNDANT", "GRID_SHAPES", "ROW_KEYS", "MoEShape",
           "add_ratios", "format_grid", "grid_cells", "plan_traffic", "run_grid", "semmoe_vs_baselines"]
