"""How Sem-MoE's expert-load bound (``policy.semmoe.DEFAULT_LOAD_SLACK``) was chosen: on the
profiled requests only, never on evaluation requests.

The seed-0 profile (20% of the DeepSeek-V2-Lite dev trace's requests) is split 50/50 again;
for each slack Sem-MoE is solved on one half (TP mode, EP 8) and its TP LAR and expert
imbalance measured on the other half, beside vanilla's expert imbalance there. The rule: the
finite slack whose expert imbalance comes closest to vanilla's (issue 10 asks for Sem-MoE's
expert imbalance at or below vanilla's at the least LAR cost; on this small split no slack gets
below it, so the closest is taken). Printed on 2026-11-30: vanilla 1.1154; slack 0.05: LAR 0.3762,
1.1316; 0.075: 0.3774, 1.1393; 0.1: 0.3796, 1.1490; 0.125: 0.3799, 1.1402; 0.15: 0.3782, 1.1532;
no bound: 0.3889, 1.1636 → 0.05.

    .venv/bin/python scripts/tune_load_slack.py [--trace PATH]
"""

import argparse
from pathlib import Path

import numpy as np

from vllm_semmoe.evaluate import EvalConfig, evaluate
from vllm_semmoe.policy import get_policy
from vllm_semmoe.policy.semmoe import SemMoEPolicy
from vllm_semmoe.tables import build_tables
from vllm_semmoe.trace import load_trace

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "routing" / "dsv2lite_puffin-dev.npz"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--slacks", default="0.05,0.075,0.1,0.125,0.15,inf")
    args = parser.parse_args()
    profile, _ = load_trace(args.trace).split(0.2, 0)
    fit, check = profile.split(0.5, 0)
    config = EvalConfig(mode="tp")
    vanilla = evaluate(check, get_policy("vanilla").solve(fit, 8), None, config)["expert_imbalance"]
    print(f"vanilla expert_imbalance {vanilla:.4f}")
    closest = {}
    for slack in (float(x) for x in args.slacks.split(",")):
        placement = SemMoEPolicy(load_slack=slack).solve(fit, 8, mode="tp", seed=0)
        row = evaluate(check, placement, build_tables(fit, placement, mode="tp"), config)
        print(f"load_slack {slack}: lar {row['lar']:.4f}, expert_imbalance {row['expert_imbalance']:.4f}",
              flush=True)
        if np.isfinite(slack):
            closest[slack] = abs(row["expert_imbalance"] - vanilla)
    print(f"chosen: {min(closest, key=closest.get)}")


if __name__ == "__main__":
    main()
