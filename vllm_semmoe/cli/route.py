"""``semmoe route``: Sem-MoE's DP rank choice for one request, for a router outside vLLM.

    semmoe route --tables DIR (--prompt TEXT --tokenizer MODEL | --token-ids 1,2,3)
                 [--dp N] [--loads W,W,...] [--mean-work W] [--json [PATH]]

Prints every DP rank, best first, with its score (the prompt's predicted local expert
activations on the rank less the price of the rank's in-flight work;
:func:`vllm_semmoe.core.route.rank_dp_ranks`), and the ``X-data-parallel-rank`` header that pins the
request to the best rank on a vLLM API server. ``--json`` alone writes only the JSON, to stdout.
No vLLM is needed (``--prompt`` needs ``transformers`` for the tokenizer).
"""

from __future__ import annotations

import argparse

from .output import number_list, positive_int, write_json


def _token_ids(text: str) -> list[int]:
    """argparse type of ``--token-ids``: comma-separated integers >= 0."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids >= 0, got {text!r}")
    return values


def prompt_token_ids(prompt: str, tokenizer: str) -> list[int]:
    """``prompt`` as vLLM's completions endpoint tokenizes it (the model's special tokens added)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise SystemExit("semmoe: error: --prompt needs the transformers package (installed with vLLM); "
                         "install it or pass --token-ids") from None
    return list(AutoTokenizer.from_pretrained(tokenizer).encode(prompt))


def cmd_route(args) -> int:
    from ..core.modes import ServingMode
    from ..core.route import rank_dp_ranks
    from ..core.tables import load_tables

    if (args.prompt is None) == (args.token_ids is None):
        raise SystemExit("semmoe: error: give the request as --prompt TEXT (with --tokenizer MODEL) or as "
                         "--token-ids 1,2,3, one of the two")
    if args.prompt is not None and not args.tokenizer:
        raise SystemExit("semmoe: error: --prompt needs --tokenizer MODEL (the served model's path or name)")
    tables = load_tables(args.tables)
    if tables.mode != ServingMode.DP:
        raise SystemExit(f"semmoe: error: {args.tables} holds tables for mode {tables.mode!r}; rank choice "
                         "needs tables solved with --mode dp (semmoe solve --mode dp)")
    tokens = args.token_ids if args.token_ids is not None else prompt_token_ids(args.prompt, args.tokenizer)
    ranking = rank_dp_ranks(tables, tokens, num_ranks=args.dp, loads=args.loads, mean_work=args.mean_work,
                            balance=args.balance, decode_weight=args.decode_weight)
    payload = {"rank": ranking[0].rank, "header": {"X-data-parallel-rank": str(ranking[0].rank)},
               "tokens": len(tokens), "ranks": [r.as_dict() for r in ranking]}
    if args.json != "-":
        print(f"{len(tokens)} prompt tokens; DP ranks best first (score = votes - load price):")
        print(f"{'rank':>6}{'score':>14}{'votes':>14}{'load':>12}")
        for r in ranking:
            print(f"{r.rank:>6}{r.score:>14.4f}{r.votes:>14.4f}{r.load:>12.1f}")
        print(f"X-data-parallel-rank: {ranking[0].rank}")
    if args.json:
        write_json(args.json, payload)
    return 0


def add_parsers(sub) -> None:
    """Register ``route`` on the ``semmoe`` sub-parser set."""
    from ..core.scheduling import DEFAULT_DECODE_WEIGHT, DEFAULT_DP_BALANCE

    p = sub.add_parser("route", help="Sem-MoE's DP rank choice for one request (for a router outside vLLM)",
                       description="Score every DP rank for one request as Sem-MoE's DP router does (the "
                                   "prompt's predicted local expert activations less the price of the rank's "
                                   "in-flight work), best first, and print the X-data-parallel-rank header that "
                                   "pins the request to the best rank on a vLLM API server.")
    p.add_argument("--tables", required=True, help="tables directory from semmoe solve --mode dp")
    p.add_argument("--prompt", default=None, help="the request's prompt text (tokenized with --tokenizer)")
    p.add_argument("--tokenizer", default=None, metavar="MODEL",
                   help="with --prompt: the served model (path or name) whose tokenizer vLLM uses")
    p.add_argument("--token-ids", type=_token_ids, default=None, metavar="1,2,3",
                   help="the request's prompt token ids instead of --prompt")
    p.add_argument("--dp", type=positive_int, default=None,
                   help="DP ranks the tables' EP devices are split over (default: the tables' EP size, TP 1)")
    p.add_argument("--loads", type=number_list, default=None, metavar="W,W,...",
                   help="in-flight work per DP rank in tokens (prompt plus generated tokens of its unfinished "
                        "requests); default: none")
    p.add_argument("--mean-work", type=float, default=None,
                   help="mean work of a request in tokens (prompt + decode weight), the load price's scale "
                        "(default: this request's own work)")
    p.add_argument("--balance", type=float, default=DEFAULT_DP_BALANCE,
                   help="the engine's dp_balance: votes a request gives up per unit of work per mean request "
                        "of load above the least-loaded rank")
    p.add_argument("--decode-weight", type=float, default=DEFAULT_DECODE_WEIGHT,
                   help="the engine's dp_decode_weight: a request's expected generated tokens")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="also write the ranking as JSON to PATH; without PATH only the JSON, to stdout")
    p.set_defaults(func=cmd_route)
