"""``semmoe bench-ep``: the EP MoE-layer all-to-all benchmark (:mod:`vllm_semmoe.tools.bench_ep`)."""

from __future__ import annotations

import argparse

from ..tools.bench_ep.plan import DEFAULT_METHODS
from ..core.modes import MODES, ServingMode
from .output import (Progress, add_redundant_argument, add_sample_argument, non_negative_int, positive_int,
                     write_json)


def add_bench_ep_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``semmoe bench-ep``."""
    parser.add_argument("--trace", required=True, help="routing trace .npz (e.g. ../shared/data/routing/dsv2lite_puffin-dev.npz)")
    parser.add_argument("--ranks", type=positive_int, default=8, help="EP size = processes spawned (default 8)")
    parser.add_argument("--mode", choices=MODES, default=ServingMode.TP, help="serving mode replayed")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                        help="comma-separated placement methods (default vanilla,eplb,semmoe)")
    parser.add_argument("--hidden", type=positive_int, default=2048,
                        help="hidden size of the rows moved (default 2048)")
    parser.add_argument("--expert-dim", type=positive_int, default=64,
                        help="inner size of each expert's MLP (default 64)")
    parser.add_argument("--batch-tokens", type=positive_int, default=512, help="tokens per batch over all ranks")
    parser.add_argument("--max-batches", type=positive_int, default=None,
                        help="stop after this many batches (default all)")
    add_sample_argument(parser)
    parser.add_argument("--layers", type=positive_int, default=None,
                        help="benchmark the first N MoE layers (default all)")
    parser.add_argument("--profile-frac", type=float, default=0.2, help="profile share of the request split")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="split and solver seed")
    add_redundant_argument(parser)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                        help="default: nccl with a GPU per rank, else gloo")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                        help="dtype of the rows moved")
    parser.add_argument("--json", default=None, help="write the result here ('-' for stdout)")
    return parser


def cmd_bench_ep(args) -> int:
    """``semmoe bench-ep``: run, print the table, optionally write JSON."""
    from ..tools.bench_ep import BenchEPError, format_bench_ep, run_bench_ep
    from ..core.placement import PlacementError
    from ..core.trace import TraceError, TraceMismatch
    from .costs import load_fitting_trace

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        load_fitting_trace(args.trace, args.ranks, args.layers, ep_option="--ranks")
        result = run_bench_ep(args.trace, args.ranks, args.mode, methods, hidden=args.hidden,
                              expert_dim=args.expert_dim, layers=args.layers, batch_tokens=args.batch_tokens,
                              max_batches=args.max_batches, profile_frac=args.profile_frac, seed=args.seed,
                              redundant=args.redundant, sample=args.sample,
                              backend=args.backend, dtype=args.dtype, progress=Progress("bench-ep"))
    except (TraceMismatch, PlacementError):
        raise  # inputs that do not fit: `semmoe`'s one error line, exit 2
    except (TraceError, ValueError, BenchEPError) as exc:
        raise SystemExit(f"semmoe bench-ep: {exc}") from None
    print(format_bench_ep(result))
    if args.json:
        write_json(args.json, result)
    return 0
