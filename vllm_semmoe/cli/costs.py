"""``semmoe cost``: the MoE-layer cost model (:mod:`vllm_semmoe.evaluation.cost_model`) on real routing.

Every method is solved on the profile split, its data schedule replayed on the rest exactly as
``bench-ep`` replays it (the same plan), and the per-step dispatch rows and per-rank expert
work it implies are turned into modelled time on each named hardware set. (``bench-ep``
checks that the bytes its real all-to-alls move equal these routing-implied counts.)
"""

from __future__ import annotations

import time

from ..core.modes import MODES
from .offline import DEFAULT_TRACE_HINT, method_list, method_names
from .output import (Progress, add_json_argument, add_redundant_argument, add_sample_argument, non_negative_int,
                     positive_int, write_json)


def cmd_cost(args) -> int:
    from ..tools.bench_ep import analytic_counts, plan_bench_ep
    from ..evaluation.cost_model import HARDWARE, MoEShape, cost_table, format_cost_table
    from ..evaluation.cost_grid import plan_traffic

    hardware = list(HARDWARE) if args.hardware == "all" else [h.strip() for h in args.hardware.split(",")]
    unknown = [h for h in hardware if h not in HARDWARE]
    if unknown:
        raise ValueError(f"--hardware: unknown {', '.join(unknown)}; choose from all, {', '.join(HARDWARE)}")
    if args.grid:
        return cmd_cost_grid(args, hardware)
    shape = MoEShape(hidden=args.hidden, expert_intermediate=args.expert_intermediate)
    start = time.perf_counter()
    trace = load_fitting_trace(args.trace, args.ep, args.layers)
    plan = plan_bench_ep(trace, args.ep, args.mode, args.method, layers=args.layers,
                         batch_tokens=args.batch_tokens, max_batches=args.max_batches,
                         profile_frac=args.profile_frac, seed=args.seed, redundant=args.redundant,
                         progress=Progress(), sample=args.sample)
    counts = {m: analytic_counts(plan, m) for m in plan.methods}
    table = cost_table({m: plan_traffic(plan, m, hardware) for m in plan.methods}, shape, hardware, mode=args.mode)
    print(f"cost model: EP {args.ep}, {args.mode.upper()} mode, {plan.num_layers} MoE layers, "
          f"{counts[plan.methods[0]]['tokens']} tokens in batches of {args.batch_tokens}")
    print(format_cost_table(table, shape))
    if args.json:
        write_json(args.json, {
            "mode": args.mode, "ep": args.ep, "seed": args.seed, "batch_tokens": args.batch_tokens,
            "sample": args.sample,
            "redundant": args.redundant,
            "layers": plan.num_layers, "shape": {"hidden": shape.hidden,
                                                 "expert_intermediate": shape.expert_intermediate},
            "hardware": {h: vars(HARDWARE[h]) for h in hardware},
            "methods": {m: {"lar": c["local"] / max(c["activations"], 1),
                            "dispatch_rows_per_token": float(c["rows"].sum() / max(c["tokens"], 1)),
                            "redundant": plan.placements[m].redundant, "solve_s": round(plan.solve_s[m], 3)}
                        for m, c in counts.items()},
            "cost": table, "wall_s": round(time.perf_counter() - start, 1),
        })
    return 0


def load_fitting_trace(path: str, ep: int, layers: int | None, *, ep_option: str = "--ep"):
    """The ``--trace`` of ``cost`` / ``bench-ep``, checked against the EP size and ``--layers``
    before anything is solved (:func:`vllm_semmoe.core.trace.check_fit`)."""
    from ..core.placement import PlacementError, check_ep_size
    from ..core.trace import check_fit
    from ..core.capture_store import load_trace

    trace = load_trace(path)
    try:
        check_ep_size(trace.num_experts, ep, option=ep_option)
    except PlacementError as exc:
        raise PlacementError(f"--trace {path}: {exc}") from None
    if layers is not None and layers > trace.num_layers:
        check_fit(trace, {"layers": layers}, names=(f"--trace {path}", f"--layers {layers}"),
                  hint=f"--layers keeps the first N MoE layers; choose at most {trace.num_layers}")
    return trace


def cmd_cost_grid(args, hardware) -> int:
    """``semmoe cost --grid``: every mode, method, R, step size, width and hardware set."""
    from ..evaluation.cost_grid import GRID_METHODS, format_grid, run_grid

    start = time.perf_counter()
    trace = load_fitting_trace(args.trace, args.ep, args.layers)
    methods = [m for m in GRID_METHODS if m == "vanilla" or m in args.method]  # vanilla: the ratios' base
    result = run_grid(trace, args.ep, profile_frac=args.profile_frac, seed=args.seed, methods=methods,
                      hardware=hardware, layers=args.layers, max_batches=args.max_batches, sample=args.sample,
                      progress=Progress())
    result["wall_s"] = round(time.perf_counter() - start, 1)
    print(format_grid(result))
    if args.json:
        write_json(args.json, result)
    return 0


def add_parsers(sub) -> None:
    """Register ``cost`` on the ``semmoe`` sub-parser set."""
    from ..evaluation.cost_model import DSV2_LITE, HARDWARE

    p = sub.add_parser("cost", help="modelled MoE-layer time per method on named hardware (cost model)",
                       description=__doc__)
    p.add_argument("--trace", required=True, help=f"routing trace .npz (e.g. {DEFAULT_TRACE_HINT})")
    p.add_argument("--ep", type=positive_int, default=8, help="expert-parallel size (default 8)")
    p.add_argument("--mode", default="tp", choices=MODES, help="serving mode (default tp)")
    p.add_argument("--method", default="all", type=method_list,
                   help=f"'all' or comma-separated of: {', '.join(method_names())} (default all)")
    p.add_argument("--hardware", default="all",
                   help=f"'all' or comma-separated of: {', '.join(HARDWARE)} (default all)")
    p.add_argument("--hidden", type=positive_int, default=DSV2_LITE.hidden,
                   help=f"model hidden size (default {DSV2_LITE.hidden}, DeepSeek-V2-Lite)")
    p.add_argument("--expert-intermediate", type=positive_int, default=DSV2_LITE.expert_intermediate,
                   help=f"routed expert intermediate size (default {DSV2_LITE.expert_intermediate})")
    p.add_argument("--batch-tokens", type=positive_int, default=512, help="tokens per step (default 512)")
    p.add_argument("--max-batches", type=positive_int, default=None,
                   help="replay at most this many steps (default all)")
    add_sample_argument(p)
    p.add_argument("--layers", type=positive_int, default=None, help="keep the first N MoE layers (default all)")
    p.add_argument("--profile-frac", type=float, default=0.2, help="profile share of the request split (default 0.2)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="split and solver seed (default 0)")
    add_redundant_argument(p)
    add_json_argument(p, "the modelled times")
    p.add_argument("--grid", action="store_true",
                   help="model the whole grid instead: modes tp and dp, methods vanilla/eplb/moetuner/semmoe "
                        "(and stock TP), R 0-2, steps of 128 and 4096 tokens, DeepSeek-V2-Lite's and V3's widths, "
                        "every hardware set; --json writes {\"rows\": [...]}, one flat row per cell "
                        "(--mode, --batch-tokens, --redundant, --hidden and --expert-intermediate are ignored)")
    p.set_defaults(func=cmd_cost)
