"""Delivered bytes of the DP knob choice: the all-to-all bytes every DP step of the whole
evaluation stream implies, Sem-MoE against vanilla (round-robin, identity placement), at two
pairs of the DP rule's knobs (``--dp-balance``, ``--dp-price-step``).

DeepSeek-V2-Lite dev trace, EP 8, 20% profiled per seed, 512-token lock-stepped steps (each rank
takes 64 tokens of its queue per step, as ``semmoe bench-ep --mode dp`` replays them); bytes are
the dispatch rows ``bench-ep`` sends (one per token and remote rank holding one of its experts,
the combine the same), counted from the routing without running ranks
(``bench_ep.plan.analytic_counts``, the count ``bench-ep`` checks its real all-to-alls against).
Replicas (R > 0) are chosen against the default rule in both rows (``SemMoEPolicy.solve``).
Prints, per knob pair and R, Sem-MoE's bytes over vanilla's per seed and their mean ± sd.
Current figures: benchmarks/RESULTS.md (section 4).

    .venv/bin/python scripts/dp_knob_bytes.py [--knobs 4,0.3 64,0.2] [--seeds 0,1,2,3,4]
"""

import argparse
import time
from pathlib import Path

import numpy as np

from vllm_semmoe.tools.bench_ep.plan import analytic_counts, plan_bench_ep
from vllm_semmoe.evaluation.evaluate import EvalConfig
from vllm_semmoe.core.capture_store import load_trace

TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "routing" / "dsv2lite_puffin-dev.npz"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument("--knobs", nargs="+", default=["4,0.3", "64,0.2"], help="BALANCE,PRICE_STEP pairs")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--redundant", default="0,1,2")
    args = parser.parse_args()
    trace = load_trace(args.trace)
    seeds = [int(s) for s in args.seeds.split(",")]
    start = time.time()
    for pair in args.knobs:
        balance, step = (float(x) for x in pair.split(","))
        config = EvalConfig(mode="dp", dp_balance=balance, dp_price_step=step)
        for R in (int(r) for r in args.redundant.split(",")):
            ratio, lar = [], []
            for seed in seeds:
                plan = plan_bench_ep(trace, 8, "dp", ["vanilla", "semmoe"], seed=seed, redundant=R, config=config)
                counts = {m: analytic_counts(plan, m) for m in ("vanilla", "semmoe")}
                ratio.append(counts["semmoe"]["rows"].sum() / counts["vanilla"]["rows"].sum())
                lar.append(counts["semmoe"]["local"] / counts["semmoe"]["activations"])
            print(f"knobs ({balance:g}, {step:g}) R={R}: bytes vs vanilla {np.mean(ratio):.4f} ± {np.std(ratio):.4f} "
                  f"(per seed {', '.join(f'{x:.4f}' for x in ratio)}), lar {np.mean(lar):.4f}", flush=True)
    print(f"({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
