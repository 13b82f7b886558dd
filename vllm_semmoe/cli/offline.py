"""Offline commands, no vLLM: ``analyze`` (affinity evidence), ``solve`` (placement → tables),
``eval`` (compare placements and schedules on held-out routing)."""

from __future__ import annotations

import argparse
import os
import time

from .output import Progress, add_json_argument, cell, write_json

DEFAULT_TRACE_HINT = "../shared/data/routing/dsv2lite_puffin-dev.npz"
COLUMNS = ("lar", "lar_token", "oracle_lar", "lar_with_semmoe_sched", "a2a_ratio", "imbalance",
           "expert_imbalance", "solve_s")


def method_names() -> tuple[str, ...]:
    """The placement methods the CLI accepts: exactly the policy registry's names."""
    from ..policy import POLICIES

    return tuple(POLICIES)


def method_list(value: str) -> list[str]:
    """argparse type of ``eval --method``: ``all`` or comma-separated registered names."""
    names = method_names()
    if value == "all":
        return list(names)
    methods = [m.strip() for m in value.split(",") if m.strip()]
    unknown = [m for m in methods if m not in names]
    if unknown or not methods:
        raise argparse.ArgumentTypeError(
            f"unknown method(s) {', '.join(unknown) or repr(value)}; choose from all, {', '.join(names)}")
    return methods


def load_split(args):
    """(profile, evaluation) traces from ``--profile/--eval`` or ``--profile-frac/--seed``."""
    from ..trace import load_trace

    profile = load_trace(args.profile)
    if args.eval:
        if args.profile_frac is not None:
            raise SystemExit("semmoe: give either --eval or --profile-frac, not both")
        return profile, load_trace(args.eval)
    return profile.split(args.profile_frac if args.profile_frac is not None else 0.2, args.seed)


# ---- analyze -----------------------------------------------------------------------------------
def cmd_analyze(args) -> int:
    from ..affinity import affinity_report
    from ..trace import load_trace

    reports = {}
    for path in args.trace:
        trace = load_trace(path)
        report = affinity_report(trace, min_count=args.min_count)
        report["trace"] = os.path.basename(path)
        report["shape"] = {"layers": trace.num_layers, "experts": trace.num_experts, "top_k": trace.top_k,
                           "tokens": trace.num_tokens, "requests": trace.num_requests}
        reports[path] = report
        print(format_affinity_table(report))
    if len(reports) > 1:
        print(format_affinity_comparison(list(reports.values())))
    if args.json:
        write_json(args.json, next(iter(reports.values())) if len(reports) == 1 else reports)
    return 0


def format_affinity_comparison(reports: list[dict]) -> str:
    """Side by side: per trace, the range over layers of each median, and the no-affinity level."""
    lines = ["", "side by side (range over layers of the per-layer median):",
             f"{'trace':<28}{'layers x experts, k':>20}{'F1 top-k':>16}{'top-k mass':>16}"
             f"{'next mass':>14}{'no affinity':>13}"]
    for r in reports:
        shape = r["shape"]
        dims = f"{shape['layers']} x {shape['experts']}, {shape['top_k']}"
        cells = []
        for key in ("f1", "topk_mass", "next_mass"):
            medians = [layer[key][1] for layer in r["layers"]]
            cells.append(f"{min(medians):.2f}-{max(medians):.2f}")
        lines.append(f"{r['trace']:<28}{dims:>20}{cells[0]:>16}{cells[1]:>16}{cells[2]:>14}"
                     f"{shape['top_k'] / shape['experts']:>13.3f}")
    return "\n".join(lines)


def format_affinity_table(report: dict) -> str:
    """Plain-text table of :func:`vllm_semmoe.affinity.affinity_report` (p25/p50/p75)."""
    lines = [
        f"{report.get('trace', '')}: {report['tokens_considered']} tokens seen >= {report['min_count']} times "
        f"({report['token_share']:.1%} of token occurrences); p25 / p50 / p75 over those tokens",
        f"{'layer':>5}  {'F1 top-k (leave-one-out)':>26}  {'top-k mass':>22}  {'hottest non-top-k':>22}",
    ]
    fmt = lambda q: " / ".join(f"{v:.3f}" for v in q)  # noqa: E731
    for row in report["layers"]:
        lines.append(f"{row['layer']:>5}  {fmt(row['f1']):>26}  {fmt(row['topk_mass']):>22}  {fmt(row['next_mass']):>22}")
    return "\n".join(lines)


# ---- solve -------------------------------------------------------------------------------------
def cmd_solve(args) -> int:
    from ..policy import get_policy
    from ..tables import build_tables
    from ..trace import load_trace

    trace = load_trace(args.trace)
    profile = trace.split(args.profile_frac, args.seed)[0] if args.profile_frac else trace
    start = time.perf_counter()
    if args.placement:
        placement = placement_from_file(args, profile)
    else:
        placement = get_policy(args.method).solve(profile, args.ep, mode=args.mode, seed=args.seed,
                                                  progress=Progress())
    solve_s = time.perf_counter() - start
    tables = build_tables(profile, placement, mode=args.mode)
    tables.save(args.out)
    print(
        f"{placement.method} placement for {placement.num_layers} layers x {placement.num_experts} experts "
        f"on EP {args.ep} ({args.mode} mode) solved in {solve_s:.1f} s; tables in {args.out}"
    )
    if args.json:
        write_json(args.json, dict(tables.manifest(), solve_s=solve_s, out=args.out,
                                   profile_requests=profile.num_requests, profile_tokens=profile.num_tokens))
    return 0


def placement_from_file(args, profile):
    """``solve --placement FILE``: an engine's static layout (what ``semmoe export`` writes, or
    SGLang's / vLLM's own EPLB output) instead of a solver's, checked against the trace's shape."""
    from ..interop import load_placement_file
    from ..placement import PlacementError

    loaded = load_placement_file(args.placement, args.ep, dense_layers=args.dense_layers,
                                 num_experts=profile.num_experts)
    if loaded.p2l.shape[0] != profile.num_layers:
        raise PlacementError(f"{args.placement}: {loaded.p2l.shape[0]} MoE layers but the trace has "
                             f"{profile.num_layers}; SGLang files count dense layers too (--dense-layers)")
    return loaded.placement(method=f"{loaded.fmt}-file")


# ---- eval --------------------------------------------------------------------------------------
def cmd_eval(args) -> int:
    from ..evaluate import EvalConfig, compare_methods

    profile, trace = load_split(args)
    config = EvalConfig(mode=args.mode, batch_tokens=args.batch_tokens, dp_window=args.dp_window,
                        dp_eps=args.dp_eps, dp_price_step=args.dp_price_step,
                        round_robin_mask=args.round_robin_mask)
    rows = compare_methods(profile, trace, args.ep, args.method, config, seed=args.seed, progress=Progress())
    print(format_eval_table(rows, args, profile, trace))
    if args.json:
        write_json(args.json, {
            "mode": args.mode, "ep": args.ep, "seed": args.seed,
            "profile_tokens": profile.num_tokens, "eval_tokens": trace.num_tokens,
            "config": config.__dict__, "methods": rows,
        })
    return 0


def format_eval_table(rows: dict, args, profile, trace) -> str:
    head = (f"EP {args.ep}, {args.mode.upper()} mode; profile {profile.num_requests} requests / "
            f"{profile.num_tokens} tokens, evaluation {trace.num_requests} requests / {trace.num_tokens} tokens")
    lines = [head, f"{'method':<12}" + "".join(f"{c:>{max(len(c), 9) + 2}}" for c in COLUMNS)]
    for name, row in rows.items():
        lines.append(f"{name:<12}" + "".join(cell(row.get(c), max(len(c), 9) + 2) for c in COLUMNS))
    return "\n".join(lines)


# ---- parsers -----------------------------------------------------------------------------------
def add_parsers(sub) -> None:
    """Register ``analyze``, ``solve`` and ``eval`` on the ``semmoe`` sub-parser set."""
    methods = method_names()

    p = sub.add_parser("analyze", help="token→expert affinity evidence of routing traces (side by side)")
    p.add_argument("trace", nargs="+", help=f"routing trace .npz (e.g. {DEFAULT_TRACE_HINT})")
    p.add_argument("--min-count", type=int, default=20, help="only tokens seen at least this often (default 20)")
    add_json_argument(p, "the table")
    p.set_defaults(func=cmd_analyze)

    p = sub.add_parser("solve", help="solve an expert placement and write the lookup tables")
    p.add_argument("--trace", required=True, help="profiling routing trace .npz")
    p.add_argument("--ep", type=int, required=True, help="expert-parallel size E")
    p.add_argument("--method", default="semmoe", choices=methods, help="placement method")
    p.add_argument("--mode", default="tp", choices=("tp", "dp"), help="serving mode the tables are for")
    p.add_argument("--profile-frac", type=float, default=None,
                   help="profile only on this seeded fraction of the requests (default: all)")
    p.add_argument("--seed", type=int, default=0, help="split and solver seed")
    p.add_argument("--out", required=True, help="output directory for tables.npz + manifest.json")
    p.add_argument("--placement", help="take the placement from this SGLang --init-expert-location or vLLM "
                                       "offline-EPLB file instead of solving (--method is then ignored)")
    p.add_argument("--dense-layers", type=int, default=0,
                   help="with an SGLang --placement file: leading model layers without experts to skip")
    add_json_argument(p, "the tables' manifest and solve time")
    p.set_defaults(func=cmd_solve)

    p = sub.add_parser("eval", help="compare placements and schedules on held-out routing")
    p.add_argument("--profile", required=True, help="routing trace to profile on")
    p.add_argument("--eval", help="routing trace to evaluate on (default: split --profile by request)")
    p.add_argument("--profile-frac", type=float, default=None, help="profile share of a request split (default 0.2)")
    p.add_argument("--seed", type=int, default=0, help="split and solver seed")
    p.add_argument("--ep", type=int, default=8, help="expert-parallel size E")
    p.add_argument("--mode", default="tp", choices=("tp", "dp"), help="serving mode simulated")
    p.add_argument("--method", default="all", type=method_list,
                   help=f"'all' or comma-separated of: {', '.join(methods)}")
    p.add_argument("--batch-tokens", type=int, default=512, help="TP: tokens per forward batch (default 512)")
    p.add_argument("--dp-window", type=int, default=512, help="DP: requests remembered by the hard guard (default 512)")
    p.add_argument("--dp-eps", type=float, default=float("inf"), help="DP: hard guard slack (default off)")
    p.add_argument("--dp-price-step", type=float, default=0.03, help="DP: rank-price step of the balance rule (default 0.03)")
    p.add_argument("--round-robin-mask", action="store_true", help="DP: the paper's round-robin mask instead")
    add_json_argument(p)
    p.set_defaults(func=cmd_eval)
