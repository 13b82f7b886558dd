"""Remote (token, rank) pairs of bench-ep's TP plan without running the exchange: what an EP
all-to-all must send (one row per token and MoE layer to every other rank holding one of its
experts), for the scheduler as it is now. ``r̄`` = pairs per token-layer (README, TP bytes rule).

    .venv/bin/python scripts/remote_pairs.py [--trace PATH] [--max-batches 20]

Printed on 2026-11-30 (X-table scheduler, seed 0, 20 batches of 512 tokens): vanilla 1,061,212
pairs over 266,240 token-layers (r̄ 3.986, LAR 0.1241); semmoe 696,135 (r̄ 2.615, LAR 0.4009).
"""

import argparse
from pathlib import Path

import numpy as np

from vllm_semmoe.bench_ep.plan import plan_bench_ep
from vllm_semmoe.trace import load_trace

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "routing" / "dsv2lite_puffin-dev.npz"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--max-batches", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=8)
    args = parser.parse_args()
    trace = load_trace(args.trace)
    plan = plan_bench_ep(trace, args.ranks, "tp", ["vanilla", "semmoe"], max_batches=args.max_batches)
    _, rest = trace.split(0.2, 0)
    for method in plan.methods:
        device = plan.step_device[method].astype(np.int64)  # [n, L] rank of each token at each layer
        experts = rest.experts[: device.shape[0]].astype(np.int64)  # [n, L, K]
        layers = experts.shape[1]
        where = plan.expert_device[method].astype(np.int64)[np.arange(layers)[None, :, None], experts]
        pairs = sum(int(((where == d).any(axis=2) & (device != d)).sum()) for d in range(args.ranks))
        print(f"{method}: {pairs} remote pairs over {device.size} token-layers (r̄ {pairs / device.size:.3f}), "
              f"LAR {(where == device[:, :, None]).mean():.4f}")


if __name__ == "__main__":
    main()
