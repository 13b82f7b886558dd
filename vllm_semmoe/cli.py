"""The ``semmoe`` command line.

Offline: ``analyze``, ``solve``, ``eval``. With vLLM: ``profile`` (capture routing), ``serve``
(vLLM's OpenAI server with the plugin), ``demo`` (the whole pipeline on the embedded model).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

DEFAULT_TRACE_HINT = "../shared/data/routing/dsv2lite_puffin-dev.npz"
METHODS = ("vanilla", "round_robin", "eplb", "moetuner", "semmoe")


def _progress(done: int, total: int, message: str) -> None:
    """One updating stderr line for long solves (only on a terminal, else one line at the end)."""
    if sys.stderr.isatty():
        print(f"\r[semmoe] {message}: {done}/{total}", end="\n" if done >= total else "", file=sys.stderr, flush=True)
    elif done >= total:
        print(f"[semmoe] {message}: {done}/{total}", file=sys.stderr, flush=True)


def _write_json(path: str, payload: dict) -> None:
    if path == "-":
        json.dump(payload, sys.stdout, indent=2)
        print()
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    print(f"wrote {path}", file=sys.stderr)


def _load_split(args):
    """(profile, evaluation) traces from ``--profile/--eval`` or ``--profile-frac/--seed``."""
    from .trace import load_trace

    profile = load_trace(args.profile)
    if args.eval:
        if args.profile_frac is not None:
            raise SystemExit("semmoe: give either --eval or --profile-frac, not both")
        return profile, load_trace(args.eval)
    return profile.split(args.profile_frac if args.profile_frac is not None else 0.2, args.seed)


# ---- analyze -----------------------------------------------------------------------------------
def cmd_analyze(args) -> int:
    from .affinity import affinity_report
    from .trace import load_trace

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
        _write_json(args.json, next(iter(reports.values())) if len(reports) == 1 else reports)
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
    from .policy import get_policy
    from .tables import build_tables
    from .trace import load_trace

    trace = load_trace(args.trace)
    profile = trace.split(args.profile_frac, args.seed)[0] if args.profile_frac else trace
    start = time.perf_counter()
    placement = get_policy(args.method).solve(profile, args.ep, mode=args.mode, seed=args.seed, progress=_progress)
    solve_s = time.perf_counter() - start
    tables = build_tables(profile, placement, mode=args.mode)
    tables.save(args.out)
    print(
        f"{args.method} placement for {placement.num_layers} layers x {placement.num_experts} experts "
        f"on EP {args.ep} ({args.mode} mode) solved in {solve_s:.1f} s; tables in {args.out}"
    )
    return 0


# ---- eval --------------------------------------------------------------------------------------
COLUMNS = ("lar", "lar_token", "oracle_lar", "lar_with_semmoe_sched", "a2a_ratio", "imbalance",
           "expert_imbalance", "solve_s")


def cmd_eval(args) -> int:
    from .evaluate import EvalConfig, compare_methods

    profile, trace = _load_split(args)
    methods = list(METHODS) if args.method == "all" else args.method.split(",")
    config = EvalConfig(mode=args.mode, batch_tokens=args.batch_tokens, dp_window=args.dp_window,
                        dp_eps=args.dp_eps, dp_price_step=args.dp_price_step,
                        round_robin_mask=args.round_robin_mask)
    rows = compare_methods(profile, trace, args.ep, methods, config, seed=args.seed, progress=_progress)
    print(format_eval_table(rows, args, profile, trace))
    if args.json:
        _write_json(args.json, {
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
        lines.append(f"{name:<12}" + "".join(f"{row[c]:>{max(len(c), 9) + 2}.4f}" for c in COLUMNS))
    return "\n".join(lines)


# ---- vLLM jobs ---------------------------------------------------------------------------------
DEFAULT_SHAREGPT = os.path.join("..", "shared", "data", "text", "sharegpt_4k.jsonl.gz")


def _default_model() -> str:
    from .assets import tiny_moe_path

    return tiny_moe_path()


def cmd_profile(args) -> int:
    from .vllm_adapter.workflows import profile

    profile(args.model or _default_model(), args.dataset, args.num_prompts, args.out, skip=args.skip,
            max_tokens=args.max_tokens, max_model_len=args.max_model_len, tables=args.tables)
    return 0


def cmd_demo(args) -> int:
    from .vllm_adapter.workflows import demo

    result = demo(args.model or _default_model(), args.dataset, args.workdir, ep_size=args.ep,
                  profile_prompts=args.profile_prompts, eval_prompts=args.eval_prompts, skip=args.skip,
                  max_tokens=args.max_tokens)
    rows = result["methods"]
    print(f"Sem-MoE demo: {os.path.basename(result['model'])}, EP {result['ep_size']} (simulated on one device), "
          f"TP mode; profiled {result['profile']['prompts']} ShareGPT prompts, served {result['eval']['prompts']} others")
    print(f"{'method':<10}{'live_lar':>10}{'predicted_lar':>15}{'live-predicted':>16}{'tokens':>8}")
    for name, row in rows.items():
        print(f"{name:<10}{row['live_lar']:>10.4f}{row['predicted_lar']:>15.4f}"
              f"{row['live_lar'] - row['predicted_lar']:>+16.4f}{row['tokens']:>8}")
    gain = rows["semmoe"]["live_lar"] / rows["vanilla"]["live_lar"]
    print(f"Sem-MoE live LAR is {gain:.2f}x vanilla's; finished in {result['wall_s']:.0f} s")
    if args.json:
        _write_json(args.json, result)
    return 0


def cmd_bench_serve(args) -> int:
    from .vllm_adapter.bench_serve import run_bench_serve

    result = run_bench_serve(args.model or _default_model(), args.dataset, args.workdir, dp=args.dp,
                             policy=args.policy, num_prompts=args.num_prompts, concurrency=args.concurrency,
                             max_tokens=args.max_tokens, profile_trace=args.profile_trace,
                             dp_slack=args.dp_slack, dp_price_step=args.dp_price_step)
    print(f"bench-serve: policy {result['policy']}, DP {result['dp']} + EP, {result['num_prompts']} ShareGPT "
          f"prompts at concurrency {result['concurrency']}")
    print(f"  ok {result['ok']}, failed {result['failed']}; live LAR {result['live_lar']:.4f}; "
          f"prompt tokens per rank {result['rank_prompt_tokens']} (max/mean {result['rank_imbalance']:.3f}); "
          f"TTFT p50 {result['ttft_p50_s']:.3f} s; throughput {result['throughput_tok_s']:.1f} tok/s")
    if args.json:
        _write_json(args.json, result)
    return 0 if result["failed"] == 0 else 1


def serve_command(argv: list[str]) -> list[str]:
    """``semmoe serve MODEL [vllm serve args] [--tables DIR] [--mode M] [--capture PATH]
    [--dp-slack S] [--dp-price-step P]`` → the
    ``vllm serve`` command line with ``--additional-config`` carrying the plugin settings."""
    import json as _json

    rest, semmoe, additional = [], {}, {}
    it = iter(argv)
    for arg in it:
        key, eq, value = arg.partition("=")
        if key in ("--tables", "--mode", "--capture", "--dp-slack", "--dp-price-step"):
            name = key[2:].replace("-", "_")
            semmoe[name] = value if eq else next(it, None)
            if semmoe[name] is None:
                raise SystemExit(f"semmoe serve: {key} needs a value")
            if name in ("dp_slack", "dp_price_step"):
                semmoe[name] = float(semmoe[name])
        elif key == "--additional-config":
            additional = _json.loads(value if eq else next(it))
        else:
            rest.append(arg)
    if not rest or rest[0].startswith("-"):
        raise SystemExit("usage: semmoe serve MODEL [vllm serve options] [--tables DIR] [--mode tp|dp|placement-only]")
    if semmoe:
        additional = {**additional, "semmoe": {**additional.get("semmoe", {}), **semmoe}}
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", *rest]
    if additional:
        cmd += ["--additional-config", _json.dumps(additional)]
    return cmd


def cmd_serve(argv: list[str]) -> int:
    from .vllm_adapter.engine import cpu_defaults

    cmd = serve_command(argv)
    cpu_defaults()
    print("[semmoe] " + " ".join(cmd), file=sys.stderr, flush=True)
    os.execv(cmd[0], cmd)
    return 0  # not reached


# ---- parser ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="semmoe", description="Sem-MoE expert placement and scheduling for vLLM.")
    parser.add_argument("--version", action="version", version=f"vllm-semmoe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("analyze", help="token→expert affinity evidence of routing traces (side by side)")
    p.add_argument("trace", nargs="+", help=f"routing trace .npz (e.g. {DEFAULT_TRACE_HINT})")
    p.add_argument("--min-count", type=int, default=20, help="only tokens seen at least this often (default 20)")
    p.add_argument("--json", help="also write the table as JSON to this path ('-' = stdout)")
    p.set_defaults(func=cmd_analyze)

    p = sub.add_parser("solve", help="solve an expert placement and write the lookup tables")
    p.add_argument("--trace", required=True, help="profiling routing trace .npz")
    p.add_argument("--ep", type=int, required=True, help="expert-parallel size E")
    p.add_argument("--method", default="semmoe", choices=METHODS)
    p.add_argument("--mode", default="tp", choices=("tp", "dp"), help="serving mode the tables are for")
    p.add_argument("--profile-frac", type=float, default=None,
                   help="profile only on this seeded fraction of the requests (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output directory for tables.npz + manifest.json")
    p.set_defaults(func=cmd_solve)

    p = sub.add_parser("eval", help="compare placements and schedules on held-out routing")
    p.add_argument("--profile", required=True, help="routing trace to profile on")
    p.add_argument("--eval", help="routing trace to evaluate on (default: split --profile by request)")
    p.add_argument("--profile-frac", type=float, default=None, help="profile share of a request split (default 0.2)")
    p.add_argument("--seed", type=int, default=0, help="split and solver seed")
    p.add_argument("--ep", type=int, default=8)
    p.add_argument("--mode", default="tp", choices=("tp", "dp"))
    p.add_argument("--method", default="all", help=f"'all' or comma-separated of: {', '.join(METHODS)}")
    p.add_argument("--batch-tokens", type=int, default=512, help="TP: tokens per forward batch (default 512)")
    p.add_argument("--dp-window", type=int, default=512, help="DP: requests remembered by the hard guard")
    p.add_argument("--dp-eps", type=float, default=float("inf"), help="DP: hard guard slack (default off)")
    p.add_argument("--dp-price-step", type=float, default=0.03, help="DP: rank-price step of the balance rule")
    p.add_argument("--round-robin-mask", action="store_true", help="DP: the paper's round-robin mask instead")
    p.add_argument("--json", help="write the figures as JSON to this path ('-' = stdout)")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("profile", help="capture live routing of prompts through vLLM into a trace")
    p.add_argument("--model", help="model path (default: the embedded tiny MoE)")
    p.add_argument("--dataset", required=True, help="ShareGPT or MMLU .jsonl(.gz), or plain text (.gz)")
    p.add_argument("--num-prompts", type=int, required=True)
    p.add_argument("--skip", type=int, default=0, help="skip this many prompts of the dataset first")
    p.add_argument("--out", required=True, help="routing trace .npz to write")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per prompt (decode is captured too)")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--tables", help="also apply this placement while profiling")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("serve", help="vLLM's OpenAI server with the plugin: semmoe serve MODEL [vllm args] --tables DIR",
                       add_help=False)
    p.set_defaults(func=None)

    p = sub.add_parser("bench-serve", help="DP serving benchmark: Sem-MoE vs vLLM request routing")
    p.add_argument("--model", help="model path (default: the embedded tiny MoE)")
    p.add_argument("--dataset", default=DEFAULT_SHAREGPT, help="ShareGPT .jsonl(.gz)")
    p.add_argument("--dp", type=int, default=2, help="data-parallel size (expert parallel over all ranks)")
    p.add_argument("--policy", choices=("semmoe", "vllm"), default="semmoe")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--profile-trace", help="routing trace to solve on (default: profile 300 ShareGPT prompts)")
    p.add_argument("--dp-slack", type=float, default=None, help="semmoe: queue-score guard slack (requests)")
    p.add_argument("--dp-price-step", type=float, default=None, help="semmoe: token-balance price step")
    p.add_argument("--workdir", default=os.path.join("out", "bench_serve"))
    p.add_argument("--json", help="write the figures as JSON to this path ('-' = stdout)")
    p.set_defaults(func=cmd_bench_serve)

    from .bench_ep import add_bench_ep_arguments, cmd_bench_ep

    p = sub.add_parser("bench-ep", help="EP MoE-layer all-to-all benchmark replaying real routing (torch.distributed)")
    add_bench_ep_arguments(p)
    p.set_defaults(func=cmd_bench_ep)

    p = sub.add_parser("demo", help="the whole pipeline on the embedded model: profile, solve, serve, live vs predicted LAR")
    p.add_argument("--model", help="model path (default: the embedded tiny MoE)")
    p.add_argument("--dataset", default=DEFAULT_SHAREGPT, help="ShareGPT .jsonl(.gz)")
    p.add_argument("--ep", type=int, default=8)
    p.add_argument("--profile-prompts", type=int, default=300)
    p.add_argument("--eval-prompts", type=int, default=100)
    p.add_argument("--skip", type=int, default=3000, help="first prompt used (the tiny model never trained on 3000+)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--workdir", default=os.path.join("out", "demo"))
    p.add_argument("--json", help="write the figures as JSON to this path ('-' = stdout)")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .placement import PlacementError
    from .tables import TablesError
    from .trace import TraceError
    from .vllm_adapter.config import SemMoEConfigError

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return cmd_serve(argv[1:])
    args = build_parser().parse_args(argv)
    if getattr(args, "method", None) and args.command == "eval" and args.method != "all":
        unknown = [m for m in args.method.split(",") if m not in METHODS]
        if unknown:
            build_parser().error(f"unknown method(s) {', '.join(unknown)}; choose from all, {', '.join(METHODS)}")
    if getattr(args, "ep", None) is not None and args.ep < 1:
        build_parser().error(f"--ep must be >= 1, got {args.ep}")
    try:
        return args.func(args)
    except (TraceError, TablesError, PlacementError, SemMoEConfigError, FileNotFoundError, ValueError) as exc:
        print(f"semmoe: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

