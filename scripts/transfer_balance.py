"""Expert load on data the profile did not see: placements solved on 300 ShareGPT prompts of the
embedded model, evaluated on 300 other ShareGPT prompts, MMLU and WikiText-2 (the captures of
``scripts/transfer_embedded.sh``), EP 8, both modes, R = 0-2 replica slots per rank.

Rows: vanilla; EPLB at R; Sem-MoE at R with its replicas chosen for locality (``semmoe``) and for
load where the tokens are (``semmoe-hot``, the time objective's ``hot`` variant). Columns per
evaluated set: ``expert_imbalance`` (max/mean activations served per rank, mean over layers) and
LAR. Run ``scripts/transfer_embedded.sh`` first (or point ``--captures`` at its folder).

    .venv/bin/python scripts/transfer_balance.py [--captures DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os

from vllm_semmoe.core.capture_store import load_trace
from vllm_semmoe.core.policy.semmoe import SemMoEPolicy
from vllm_semmoe.core.schedulers import EvalConfig
from vllm_semmoe.evaluation.evaluate import compare_methods

TARGETS = ("sharegpt_other", "mmlu", "wikitext")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--captures", default=os.environ.get("SEMMOE_TRANSFER_DIR",
                                                             os.path.expanduser("~/.cache/vllm-semmoe/transfer")))
    parser.add_argument("--ep", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    missing = [n for n in ("sharegpt",) + TARGETS if not os.path.exists(os.path.join(args.captures, f"{n}.npz"))]
    if missing:
        raise SystemExit(f"transfer_balance: no capture {', '.join(missing)} in {args.captures}; "
                         "run scripts/transfer_embedded.sh first")
    profile = load_trace(os.path.join(args.captures, "sharegpt.npz"))
    targets = {n: load_trace(os.path.join(args.captures, f"{n}.npz")) for n in TARGETS}
    out = {}
    print(f"{'mode':<5}{'method':<12}{'R':>2}" + "".join(f"{n + ' imb':>20}{'lar':>8}" for n in TARGETS))
    for mode in ("tp", "dp"):
        config = EvalConfig(mode=mode)
        for R in (0, 1, 2):
            methods = ["vanilla"] if R == 0 else []
            methods += ["eplb", "semmoe"] + (["semmoe-hot"] if R else [])
            rows = {n: compare_methods(profile, t, args.ep, methods, config, redundant=R,
                                       policies={"semmoe-hot": SemMoEPolicy(replicas="load")})
                    for n, t in targets.items()}
            for method in methods:
                cells = {n: {"expert_imbalance": rows[n][method]["expert_imbalance"], "lar": rows[n][method]["lar"]}
                         for n in TARGETS}
                out[f"{mode}/{method}/R{R}"] = cells
                print(f"{mode:<5}{method:<12}{R:>2}" + "".join(
                    f"{cells[n]['expert_imbalance']:>20.3f}{cells[n]['lar']:>8.4f}" for n in TARGETS), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ep": args.ep, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
