"""What Sem-MoE's expert-load term costs in TP LAR (the bar: at most one point), per split seed.

For each seed the DeepSeek-V2-Lite dev trace's requests are split as ``semmoe eval
--profile-frac 0.2 --seeds ...`` splits them; Sem-MoE is solved on the profile (TP, EP 8) with
the default load term (the Lagrangian price ``policy.semmoe.DEFAULT_LOAD_PRICE``) and without
any (``load_slack=inf, load_price=0``), and both are evaluated on the other 80% with Sem-MoE's
tables, beside vanilla's expert imbalance. Prints per seed and mean ± sd (sample sd) of LAR,
expert imbalance and the cost. ``--load-slack S`` measures the hard bound ``S`` instead (no
price; the bound the price replaced is 0.05). Current figures: benchmarks/RESULTS.md (section 1)
and benchmarks/SEEDS.md.

    .venv/bin/python scripts/expert_load_cost.py [--trace PATH] [--seeds 0,1,2,3,4] [--load-slack S]
"""

import argparse
from pathlib import Path

import numpy as np

from vllm_semmoe.evaluation.evaluate import EvalConfig, compare_seeds
from vllm_semmoe.core.policy.semmoe import SemMoEPolicy
from vllm_semmoe.core.capture_store import load_trace

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "routing" / "dsv2lite_puffin-dev.npz"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--load-slack", type=float, default=None,
                        help="measure this hard bound (no price) instead of the default load term")
    args = parser.parse_args()
    loaded = SemMoEPolicy() if args.load_slack is None else SemMoEPolicy(load_slack=args.load_slack, load_price=0.0)
    policies = {"semmoe": loaded, "semmoe-noload": SemMoEPolicy(load_slack=np.inf, load_price=0.0)}
    seeds = [int(s) for s in args.seeds.split(",")]
    out = compare_seeds(load_trace(args.trace), 0.2, seeds, 8, ["vanilla", *policies], EvalConfig(mode="tp"),
                        policies=policies)
    figure = {(name, key): np.asarray(out[name][key]["per_seed"])
              for name in out for key in ("lar", "expert_imbalance")}
    columns = [figure["semmoe", "lar"], figure["semmoe", "expert_imbalance"], figure["semmoe-noload", "lar"],
               figure["semmoe-noload", "expert_imbalance"], figure["vanilla", "expert_imbalance"]]
    rows = np.stack(columns + [100 * (columns[2] - columns[0])], axis=1)  # [seeds, 6]
    for seed, row in zip(seeds, rows):
        print(f"seed {seed}: load term lar {row[0]:.4f} expert_imbalance {row[1]:.4f}; no load term lar {row[2]:.4f} "
              f"expert_imbalance {row[3]:.4f}; vanilla expert_imbalance {row[4]:.4f}; cost {row[5]:.2f} LAR points")
    mean, sd = rows.mean(axis=0), rows.std(axis=0, ddof=1) if len(rows) > 1 else np.zeros(6)
    names = ("load term lar", "load term expert_imbalance", "no load term lar", "no load term expert_imbalance",
             "vanilla expert_imbalance", "cost (LAR points)")
    print("; ".join(f"{n} {m:.4f}±{s:.4f}" for n, m, s in zip(names, mean, sd)))


if __name__ == "__main__":
    main()
