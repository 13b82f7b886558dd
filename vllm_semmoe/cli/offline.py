"""Offline commands, no vLLM: ``analyze`` (affinity evidence), ``solve`` (placement → tables),
``eval`` (compare placements and schedules on held-out routing)."""

from __future__ import annotations

import argparse
import os
import time

from ..core.modes import MODES, ServingMode
from .output import (Progress, add_json_argument, add_redundant_argument, cell, non_negative_int, number_list,
                     positive_int, write_json)

DEFAULT_TRACE_HINT = "../shared/data/routing/dsv2lite_puffin-dev.npz"
COLUMNS = ("lar", "lar_token", "oracle_lar", "lar_with_semmoe_sched", "a2a_ratio", "imbalance",
           "expert_imbalance", "solve_s")
DP_COLUMNS = ("window_imbalance", "window_imbalance_least_loaded", "window_imbalance_round_robin",
              "window_imbalance_sglang_total_requests", "window_imbalance_sglang_total_tokens",
              "request_imbalance")
#: DP locality: each method's LAR under its own rank choice and under each locality-blind balancer
DP_LAR_COLUMNS = ("lar", "lar_least_loaded", "lar_round_robin", "lar_sglang_total_requests",
                  "lar_sglang_total_tokens")


def method_names() -> tuple[str, ...]:
    """The placement methods the CLI accepts: exactly the policy registry's names."""
    from ..core.policy import POLICIES

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
    from ..core.trace import check_fit
    from ..core.capture_store import load_trace

    profile = load_trace(args.profile)
    if args.eval:
        if args.profile_frac is not None:
            raise SystemExit("semmoe: give either --eval or --profile-frac, not both")
        trace = load_trace(args.eval)
        check_fit(profile, trace, names=(f"--profile {args.profile}", f"--eval {args.eval}"),
                  hint="profile and evaluate on traces of the same model")
        return profile, trace
    return profile.split(args.profile_frac if args.profile_frac is not None else 0.2, args.seed,
                         hold_out_tuning=args.hold_out_tuning)


def add_tuning_argument(p) -> None:
    """``--hold-out-tuning`` (default) / ``--no-hold-out-tuning`` of a command that splits a trace."""
    from ..core.trace import TUNING_FRAC

    p.add_argument("--hold-out-tuning", action=argparse.BooleanOptionalAction, default=True,
                   help=f"split only the requests outside the tuning split ({TUNING_FRAC * 100:.0f}%% of the trace's "
                        "requests, fixed; the knobs were chosen on it), so no figure is measured on them "
                        "(default: on; the rule: vllm_semmoe.core.trace.TUNING_FRAC)")


# ---- analyze -----------------------------------------------------------------------------------
def cmd_analyze(args) -> int:
    from ..core.affinity import affinity_report
    from ..core.capture_store import load_trace

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
    """Plain-text table of :func:`vllm_semmoe.core.affinity.affinity_report` (p25/p50/p75)."""
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
    from ..core.policy import get_policy
    from ..core.tables import build_tables
    from ..core.capture_store import load_trace

    trace = load_trace(args.trace)
    embedding = _embedding(args, [(f"--trace {args.trace}", trace)])
    profile = (trace.split(args.profile_frac, args.seed, hold_out_tuning=args.hold_out_tuning)[0]
               if args.profile_frac else trace)
    start = time.perf_counter()
    if args.placement:
        if args.redundant:
            raise SystemExit("semmoe: --redundant applies to a solved placement, not to --placement FILE")
        placement = placement_from_file(args, profile)
    elif args.objective == "time":
        placement, note = solve_for_time_target(args, profile)
    else:
        placement = get_policy(args.method).solve(profile, args.ep, mode=args.mode, seed=args.seed,
                                                  redundant=args.redundant, progress=Progress())
    solve_s = time.perf_counter() - start
    tables = build_tables(profile, placement, mode=args.mode, embedding=embedding)
    tables.save(args.out)
    replicas = (f", {placement.redundant} redundant slot(s) per device ({placement.experts_per_device} "
                f"physical experts per rank)" if placement.redundant else "")
    print(
        f"{placement.method} placement for {placement.num_layers} layers x {placement.num_experts} experts "
        f"on EP {args.ep} ({args.mode} mode{replicas}) solved in {solve_s:.1f} s; tables in {args.out}"
    )
    if args.objective == "time":
        print(note)
    if args.json:
        write_json(args.json, dict(tables.manifest(), solve_s=solve_s, out=args.out,
                                   profile_requests=profile.num_requests, profile_tokens=profile.num_tokens))
    return 0


def solve_for_time_target(args, profile):
    """``solve --objective time``: the placement :mod:`vllm_semmoe.evaluation.time_objective` picks for the
    target (``--hardware``, ``--batch-tokens``, ``--hidden`` / ``--expert-intermediate``), and one
    line saying which variant won, every candidate's modelled time and how to serve it."""
    from ..evaluation.cost_model import MoEShape
    from ..evaluation.time_objective import SCHEDULED, Target, solve_for_time

    if args.method != "semmoe":
        raise SystemExit(f"semmoe: --objective time chooses among Sem-MoE's variants; drop --method {args.method}")
    target = Target(args.hardware, args.batch_tokens, MoEShape(args.hidden, args.expert_intermediate))
    choice, placement, _ = solve_for_time(profile, args.ep, args.mode, args.redundant, target, seed=args.seed,
                                          progress=Progress())
    serve = (f"serve with --mode {args.mode}" if choice.variant in SCHEDULED else
             "no data scheduling pays on this target: serve the placement with scheduling off "
             "(placement-only)")
    return placement, f"time objective: {choice.summary()}; {serve}"


def placement_from_file(args, profile):
    """``solve --placement FILE``: an engine's static layout (what ``semmoe export`` writes, or
    SGLang's / vLLM's own EPLB output) instead of a solver's, checked against the trace's shape."""
    from ..tools.interop import load_placement_file
    from ..core.trace import check_fit

    loaded = load_placement_file(args.placement, args.ep, dense_layers=args.dense_layers)
    check_fit(profile, loaded, names=(f"--trace {args.trace}", f"--placement {args.placement}"),
              hint="both must come from the same model; SGLang files count dense layers too (--dense-layers)")
    return loaded.placement(method=f"{loaded.fmt}-file")


# ---- eval --------------------------------------------------------------------------------------
def seed_list(value: str) -> list[int]:
    """argparse type of ``eval --seeds``: comma-separated integers, e.g. ``0,1,2,3,4``."""
    try:
        seeds = [int(s) for s in value.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds takes comma-separated integers, got {value!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"--seeds needs distinct integers, got {value!r}")
    return seeds


def cmd_eval(args) -> int:
    from dataclasses import replace

    from ..evaluation.evaluate import EvalConfig, aggregate_seeds, compare_methods

    if args.seeds and args.eval:
        raise SystemExit("semmoe: --seeds re-splits --profile per seed; it cannot be used with --eval")
    config = EvalConfig(mode=args.mode, batch_tokens=args.batch_tokens, dp_window=args.dp_window,
                        dp_balance=args.dp_balance, dp_price_step=args.dp_price_step, tp_history=args.tp_history,
                        round_robin_mask=args.round_robin_mask, dp_decode_weight=args.dp_decode_weight)
    seeds = args.seeds or [args.seed]
    embedding = _embedding(args)
    per_seed, curve_per_seed, split = [], [], None
    for seed in seeds:
        args.seed = seed
        profile, trace = load_split(args)
        if embedding is not None:
            held_out = f"--eval {args.eval}" if args.eval else f"--profile {args.profile}"
            check_embedding_fit(embedding, args, [(f"--profile {args.profile}", profile), (held_out, trace)])
        split = split or (profile, trace)
        per_seed.append(compare_methods(profile, trace, args.ep, args.method, config, seed=seed,
                                        redundant=args.redundant, progress=Progress(),
                                        embedding=embedding))
        if args.dp_balance_curve:
            curve_per_seed.append(_dp_curve(profile, trace, args, config, seed))
    rows = aggregate_seeds(per_seed) if args.seeds else per_seed[0]
    print(format_eval_table(rows, args, *split))
    if args.mode == ServingMode.DP:
        print(format_dp_table(rows))
    curve = None
    if args.dp_balance_curve:
        curve = aggregate_seeds(curve_per_seed) if args.seeds else curve_per_seed[0]
        print(format_curve(curve))
    if args.json:
        payload = {"mode": args.mode, "ep": args.ep, "redundant": args.redundant,
                   "oov": "nearest" if embedding is not None else "prior",
                   "config": replace(config).__dict__, "methods": rows}
        if not args.eval:
            payload["tuning_split_held_out"] = args.hold_out_tuning
        if args.seeds:
            payload["seeds"] = seeds
        else:
            payload.update(seed=seeds[0], profile_tokens=split[0].num_tokens, eval_tokens=split[1].num_tokens)
        if curve is not None:
            payload["dp_curve"] = curve
        write_json(args.json, payload)
    return 0


def _embedding(args, traces=()):
    """The ``--oov-neighbours`` checkpoint's input embedding matrix, or ``None``; checked against
    ``traces`` (``(name, trace)`` pairs) by :func:`check_embedding_fit`."""
    if not getattr(args, "oov_neighbours", None):
        return None
    from ..core.affinity import checkpoint_embedding

    embedding = checkpoint_embedding(args.oov_neighbours)
    check_embedding_fit(embedding, args, traces)
    return embedding


def check_embedding_fit(embedding, args, traces) -> None:
    """Every trace's token ids have a row in the ``--oov-neighbours`` checkpoint's embedding;
    ``traces``: ``(name, trace)`` pairs."""
    from ..core.trace import check_fit

    for name, trace in traces:
        check_fit(trace, embedding, names=(name, f"--oov-neighbours {args.oov_neighbours}"),
                  hint="give the checkpoint of the model that produced the trace")


def _dp_curve(profile, trace, args, config, seed) -> dict:
    """Sem-MoE's DP LAR and balance for every knob value of ``--dp-balance-curve`` (one solve)."""
    from dataclasses import replace

    from ..evaluation.evaluate import compare_methods

    solved = {}

    def once(key, solve):
        if "p" not in solved:
            solved["p"] = solve()
        return solved["p"]

    curve = {}
    for knob in args.dp_balance_curve:
        row = compare_methods(profile, trace, args.ep, ["semmoe"], replace(config, dp_balance=knob), seed=seed,
                              redundant=args.redundant, solve_cache=once, embedding=_embedding(args))["semmoe"]
        curve[f"balance={knob:g}"] = {k: row[k] for k in ("lar", *DP_COLUMNS)}
    return curve


def _mean(value):
    """A figure, or the mean of a multi-seed ``{"mean", "sd", "per_seed"}`` figure."""
    return value["mean"] if isinstance(value, dict) else value


def _cell(value, width: int) -> str:
    if isinstance(value, dict):  # mean ± sd
        return f"{value['mean']:.4f}±{value['sd']:.4f}".rjust(width)
    return cell(value, width)


def format_eval_table(rows: dict, args, profile, trace) -> str:
    multi = bool(getattr(args, "seeds", None))
    if multi:
        head = (f"EP {args.ep}, {args.mode.upper()} mode; seeds {','.join(map(str, args.seeds))} "
                f"(profile {args.profile_frac or 0.2:.0%} of requests per seed); mean ± sd over seeds")
    else:
        head = (f"EP {args.ep}, {args.mode.upper()} mode; profile {profile.num_requests} requests / "
                f"{profile.num_tokens} tokens, evaluation {trace.num_requests} requests / {trace.num_tokens} tokens")
    if getattr(args, "redundant", 0):
        head += f"; {args.redundant} redundant slot(s) per device where the method replicates"
    from ..core.capture_store import coverage_text

    head += f"\nrouting coverage: profile {coverage_text(profile)}; evaluation {coverage_text(trace)}"
    if hasattr(args, "hold_out_tuning") and not getattr(args, "eval", None):
        head += ("\nthe tuning split (the requests the knobs were chosen on) is held out: no profile or evaluation "
                 "request is from it" if args.hold_out_tuning else
                 "\nthe tuning split is NOT held out (--no-hold-out-tuning): figures include the requests the "
                 "knobs were chosen on")
    width = lambda c: max(len(c), 15 if multi else 9) + 2  # noqa: E731
    lines = [head, f"{'method':<12}" + "".join(f"{c:>{width(c)}}" for c in COLUMNS)]
    for name, row in rows.items():
        lines.append(f"{name:<12}" + "".join(_cell(row.get(c), width(c)) for c in COLUMNS))
    return "\n".join(lines)


def format_dp_table(rows: dict) -> str:
    """DP lock-step balance: work per rank over windows of 32 x ranks requests, of each method's
    rank choice and of the locality-blind balancers (least-loaded, round-robin, SGLang's
    ``total_requests`` and ``total_tokens``); then the LAR of each method's placement under its
    own rank choice and under each of those balancers."""
    width = lambda c: max(len(c), 15) + 2  # noqa: E731
    lines = ["DP balance over windows of 32 x ranks requests (work = prompt tokens + decode weight):",
             f"{'method':<12}" + "".join(f"{c:>{width(c)}}" for c in DP_COLUMNS)]
    for name, row in rows.items():
        lines.append(f"{name:<12}" + "".join(_cell(row.get(c), width(c)) for c in DP_COLUMNS))
    lines += ["DP locality: LAR of each placement under its own rank choice (lar) and under each "
              "locality-blind balancer:",
              f"{'method':<12}" + "".join(f"{c:>{width(c)}}" for c in DP_LAR_COLUMNS)]
    for name, row in rows.items():
        lines.append(f"{name:<12}" + "".join(_cell(row.get(c), width(c)) for c in DP_LAR_COLUMNS))
    return "\n".join(lines)


def format_curve(curve: dict) -> str:
    """Sem-MoE's LAR against its window imbalance, one line per value of the DP knob."""
    lines = ["locality vs balance (semmoe, DP knob --dp-balance):",
             f"{'knob':<12}{'lar':>17}{'window_imbalance':>19}{'/ least-loaded':>16}{'request_imbalance':>19}"]
    for knob, row in curve.items():
        ratio = _mean(row["window_imbalance"]) / _mean(row["window_imbalance_least_loaded"])
        lines.append(f"{knob:<12}{_cell(row['lar'], 17)}{_cell(row['window_imbalance'], 19)}{ratio:>16.4f}"
                     f"{_cell(row['request_imbalance'], 19)}")
    return "\n".join(lines)


# ---- parsers -----------------------------------------------------------------------------------
def add_parsers(sub) -> None:
    """Register ``analyze``, ``solve`` and ``eval`` on the ``semmoe`` sub-parser set."""
    from ..core.schedulers import DEFAULT_DP_BALANCE, DEFAULT_DP_PRICE_STEP

    methods = method_names()

    p = sub.add_parser("analyze", help="token→expert affinity evidence of routing traces (side by side)")
    p.add_argument("trace", nargs="+", help=f"routing trace .npz (e.g. {DEFAULT_TRACE_HINT})")
    p.add_argument("--min-count", type=positive_int, default=20,
                   help="only tokens seen at least this often (default 20)")
    add_json_argument(p, "the table")
    p.set_defaults(func=cmd_analyze)

    p = sub.add_parser("solve", help="solve an expert placement and write the lookup tables")
    p.add_argument("--trace", required=True, help="profiling routing trace .npz")
    p.add_argument("--ep", type=positive_int, required=True, help="expert-parallel size E")
    p.add_argument("--method", default="semmoe", choices=methods, help="placement method")
    p.add_argument("--mode", default="tp", choices=MODES, help="serving mode the tables are for")
    p.add_argument("--profile-frac", type=float, default=None,
                   help="profile only on this seeded fraction of the requests (default: all)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="split and solver seed")
    add_tuning_argument(p)
    add_redundant_argument(p)
    p.add_argument("--oov-neighbours", metavar="MODEL_DIR", default=None,
                   help="map tokens never profiled to their nearest profiled token in this checkpoint's "
                        "input-embedding space (the paper's rule; default: the layer prior)")
    p.add_argument("--out", required=True, help="output directory for tables.npz + manifest.json")
    p.add_argument("--placement", help="take the placement from this SGLang --init-expert-location or vLLM "
                                       "offline-EPLB file instead of solving (--method is then ignored)")
    p.add_argument("--dense-layers", type=non_negative_int, default=0,
                   help="with an SGLang --placement file: leading model layers without experts to skip")
    p.add_argument("--objective", choices=("locality", "time"), default="locality",
                   help="locality: the paper's co-clustering (default); time: of Sem-MoE's variants and the "
                        "balanced fallbacks, the one with the least modelled MoE-layer step time on the "
                        "target below (vllm_semmoe.evaluation.time_objective)")
    p.add_argument("--hardware", default="deepep-normal-1node",
                   help="--objective time: hardware set of the cost model (see `semmoe cost --hardware`)")
    p.add_argument("--batch-tokens", type=positive_int, default=4096,
                   help="--objective time: tokens per step over all ranks (default 4096, prefill-sized)")
    p.add_argument("--hidden", type=positive_int, default=2048, help="--objective time: model hidden size")
    p.add_argument("--expert-intermediate", type=positive_int, default=1408,
                   help="--objective time: expert intermediate size")
    add_json_argument(p, "the tables' manifest and solve time")
    p.set_defaults(func=cmd_solve)

    p = sub.add_parser("eval", help="compare placements and schedules on held-out routing")
    p.add_argument("--profile", required=True, help="routing trace to profile on")
    p.add_argument("--eval", help="routing trace to evaluate on (default: split --profile by request)")
    p.add_argument("--profile-frac", type=float, default=None,
                   help="profile share of the trace's requests in a request split (default 0.2; drawn from "
                        "outside the tuning split, see --hold-out-tuning)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="split and solver seed")
    p.add_argument("--seeds", type=seed_list, default=None, metavar="S,S,...",
                   help="evaluate on every seed's split and report each figure as mean ± sd "
                        "(JSON: {'mean', 'sd', 'per_seed'}); e.g. 0,1,2,3,4")
    add_tuning_argument(p)
    add_redundant_argument(p)
    p.add_argument("--oov-neighbours", metavar="MODEL_DIR", default=None,
                   help="map tokens never profiled to their nearest profiled token in this checkpoint's "
                        "input-embedding space (the paper's rule; default: the layer prior)")
    p.add_argument("--ep", type=positive_int, default=8, help="expert-parallel size E")
    p.add_argument("--mode", default="tp", choices=MODES, help="serving mode simulated")
    p.add_argument("--method", default="all", type=method_list,
                   help=f"'all' or comma-separated of: {', '.join(methods)}")
    p.add_argument("--batch-tokens", type=positive_int, default=512, help="TP: tokens per forward batch (default 512)")
    p.add_argument("--tp-history", choices=("experts", "devices"), default="experts",
                   help="TP: what semmoe's scheduler conditions on besides T2D: the token's experts at the "
                        "two previous layers (the X table; default) or the paper's A table over the two "
                        "previous layers' majority devices")
    p.add_argument("--dp-window", type=positive_int, default=None,
                   help="DP: requests per balance window (default 32 x ranks)")
    p.add_argument("--dp-balance", type=float, default=DEFAULT_DP_BALANCE,
                   help="DP: proportional balance knob: votes per unit of work a request pays per mean request "
                        "of work a rank carries above the least-loaded one (with --dp-price-step 0, 0 is pure "
                        f"locality; large: least-loaded; default {DEFAULT_DP_BALANCE})")
    p.add_argument("--dp-price-step", type=float, default=DEFAULT_DP_PRICE_STEP,
                   help="DP: step of the per-rank prices learned online from the work each rank is given "
                        f"(0: none; default {DEFAULT_DP_PRICE_STEP})")
    p.add_argument("--dp-balance-curve", type=number_list, default=None, metavar="B,B,...",
                   help="DP: also report semmoe's LAR against window imbalance for each knob value")
    p.add_argument("--dp-decode-weight", type=float, default=None,
                   help="DP: decode work per request in tokens (default: the profile's mean output length, "
                        "128 where the profile has no decode tokens)")
    p.add_argument("--round-robin-mask", action="store_true", help="DP: the paper's round-robin mask instead")
    add_json_argument(p)
    p.set_defaults(func=cmd_eval)
