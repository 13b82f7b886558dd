"""How the TP scheduler's evidence weights (``scheduling.TP_EVIDENCE_WEIGHTS``) are chosen:
on the tuning split only (``vllm_semmoe.core.trace.TUNING_FRAC``), which no evaluation uses.

The tuning split (20% of the DeepSeek-V2-Lite dev trace's requests) is split 50/50; Sem-MoE is
solved and its tables built on one half, and the TP LAR of every weight triple in a small grid is
measured on the other half (EP 8, 512-token batches). Also printed: the paper's A-table rule
(``--tp-history devices``) on the same split. ``--no-hold-out-tuning`` tunes on the seed-0
profile instead (its requests are in other seeds' evaluation sets).

The current weights and the grid's figures: benchmarks/SEEDS.md ("TP evidence weights", under
the knobs chosen on the tuning split).

    .venv/bin/python scripts/tune_tp_evidence.py [--trace PATH] [--no-hold-out-tuning]
"""

import argparse
import itertools
from dataclasses import replace
from pathlib import Path

from vllm_semmoe.core import scheduling
from vllm_semmoe.evaluation.evaluate import EvalConfig, evaluate
from vllm_semmoe.core.policy import get_policy
from vllm_semmoe.core.tables import build_tables
from vllm_semmoe.core.capture_store import load_trace

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "routing" / "dsv2lite_puffin-dev.npz"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--hold-out-tuning", action=argparse.BooleanOptionalAction, default=True,
                        help="tune on the tuning split (default) or, with --no-hold-out-tuning, on the seed-0 profile")
    args = parser.parse_args()
    trace = load_trace(args.trace)
    profile = trace.tuning_split()[0] if args.hold_out_tuning else trace.split(0.2, 0)[0]
    where = "the tuning split" if args.hold_out_tuning else "the seed-0 profile"
    print(f"tuning on {profile.num_requests} requests ({where})")
    fit, check = profile.split(0.5, 0)
    placement = get_policy("semmoe").solve(fit, 8, mode="tp", seed=0)
    tables = build_tables(fit, placement, mode="tp")
    config = EvalConfig(mode="tp")
    print(f"A-table rule (devices): lar {evaluate(check, placement, tables, replace(config, tp_history='devices'))['lar']:.4f}")
    default = scheduling.TP_EVIDENCE_WEIGHTS
    results = {}
    for weights in itertools.product((0.3, 0.5, 0.7, 1.0), (0.3, 0.4, 0.5), (0.0, 0.2, 0.3)):
        results[weights] = evaluate(check, placement, tables, replace(config, tp_evidence_weights=weights))["lar"]
        print(f"weights {weights}: lar {results[weights]:.4f}", flush=True)
    best = max(results, key=results.get)
    print(f"best {best}: lar {results[best]:.4f}; default {default}: "
          f"{results.get(default, float('nan')):.4f}")


if __name__ == "__main__":
    main()
