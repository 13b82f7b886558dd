"""Remote (token, rank) pairs of bench-ep's TP plan without running the exchange: what an EP
all-to-all must send (one row per token and MoE layer to every other rank holding one of its
experts), for the scheduler as it is now. ``r̄`` = pairs per token-layer (README, TP bytes rule).

    .venv/bin/python scripts/remote_pairs.py [--trace PATH] [--max-batches 20] [--redundant R]

Current figures: benchmarks/RESULTS.md (section 4, TP mode against stock TP + EP).
"""

import argparse
from pathlib import Path

from vllm_semmoe.tools.bench_ep.plan import analytic_counts, plan_bench_ep
from vllm_semmoe.core.capture_store import load_trace

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "routing" / "dsv2lite_puffin-dev.npz"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--max-batches", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--redundant", type=int, default=0, help="replica slots per rank (semmoe)")
    args = parser.parse_args()
    plan = plan_bench_ep(load_trace(args.trace), args.ranks, "tp", ["vanilla", "semmoe"],
                         max_batches=args.max_batches, redundant=args.redundant)
    for method in plan.methods:
        counts = analytic_counts(plan, method)  # the send set bench-ep checks its real exchange against
        pairs, token_layers = int(counts["rows"].sum()), counts["tokens"] * plan.num_layers
        print(f"{method}: {pairs} remote pairs over {token_layers} token-layers (r̄ {pairs / token_layers:.3f}), "
              f"LAR {counts['local'] / counts['activations']:.4f}")


if __name__ == "__main__":
    main()
