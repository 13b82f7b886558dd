"""How Sem-MoE's expert-load term is chosen: first a hard bound (``load_slack``), then the
Lagrangian θ held to it (``policy.semmoe.DEFAULT_LOAD_PRICE``); on the tuning split only
(``vllm_semmoe.core.trace.TUNING_FRAC``), which no evaluation uses.

The tuning split (20% of the DeepSeek-V2-Lite dev trace's requests) is split 50/50 (``--splits``
seeds); ``--no-hold-out-tuning`` uses the seed-0 profile instead (its requests are in other
seeds' evaluation sets). For each slack Sem-MoE is solved on one half (TP mode, EP 8) and its TP
LAR and expert imbalance measured on the other half, beside vanilla's expert imbalance there.
The rule: the finite slack whose expert imbalance comes closest to vanilla's (the aim is
Sem-MoE's expert imbalance at or below vanilla's at the least LAR cost; when no slack gets below
it, the closest is taken). Every ``--slacks`` run has no price (``load_price=0``); the bound the
price is held to is :data:`BOUND_SLACK`.

``--restarts 0,3,6,10`` compares the co-clustering's random restarts (beside the run from the
previous layer's clusters; 0 = that run alone) at the bound and without it, on ``--splits``.

``--prices`` also tries the Lagrangian θ (``SemMoEPolicy(load_slack=inf, load_price=θ)``)
and picks the smallest θ (most LAR) whose mean held-out expert imbalance over ``--splits`` is
at or below the chosen slack's. The held-out imbalance is not monotone in θ at this scale
(neighbours differ by a few thousandths), so a coarse grid can land on a worse θ than a fine one.

``--fit-frac`` solves each split on another share of the profile (default 0.5).

The current choices and the grids' figures: benchmarks/SEEDS.md ("Load bound and θ" and
"Restarts", under the knobs chosen on the tuning split).

    .venv/bin/python scripts/tune_load_slack.py [--trace PATH] [--splits 0,...] [--fit-frac 0.5]
        [--slacks 0.05,...] [--prices 0.15,...] [--restarts 0,3,...] [--no-hold-out-tuning]
"""

import argparse
from pathlib import Path

import numpy as np

from vllm_semmoe.evaluation.evaluate import EvalConfig, evaluate
from vllm_semmoe.core.policy import get_policy
from vllm_semmoe.core.policy.semmoe import SemMoEPolicy
from vllm_semmoe.core.tables import build_tables
from vllm_semmoe.core.capture_store import load_trace

BOUND_SLACK = 0.05  # the hard bound the slack rule chose; ``--restarts`` compares at it
DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "routing" / "dsv2lite_puffin-dev.npz"


def held_out(profile, splits, policy, config, fit_frac=0.5) -> tuple[float, float]:
    """Mean (TP LAR, expert imbalance) over the ``splits`` of ``profile``, solved on a
    ``fit_frac`` share of its requests and measured on the rest."""
    rows = []
    for k in splits:
        fit, check = profile.split(fit_frac, k)
        placement = policy.solve(fit, 8, mode="tp", seed=0)
        row = evaluate(check, placement, build_tables(fit, placement, mode="tp"), config)
        rows.append((row["lar"], row["expert_imbalance"]))
    return tuple(np.mean(rows, axis=0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--slacks", default="0.05,0.075,0.1,0.125,0.15,inf")
    parser.add_argument("--splits", default="0", help="seeds of the profile splits, averaged")
    parser.add_argument("--fit-frac", type=float, default=0.5,
                        help="share of the profile's requests each split solves on (the rest is held out)")
    parser.add_argument("--prices", default="", help="Lagrangian θ values to try (no hard bound)")
    parser.add_argument("--restarts", default="",
                        help="co-clustering restarts to compare at slack BOUND_SLACK and without the bound "
                             "(0: every layer after the first only from the previous layer's clusters)")
    parser.add_argument("--hold-out-tuning", action=argparse.BooleanOptionalAction, default=True,
                        help="tune on the tuning split (default) or, with --no-hold-out-tuning, on the seed-0 profile")
    args = parser.parse_args()
    trace = load_trace(args.trace)
    profile = trace.tuning_split()[0] if args.hold_out_tuning else trace.split(0.2, 0)[0]
    where = "the tuning split" if args.hold_out_tuning else "the seed-0 profile"
    print(f"tuning on {profile.num_requests} requests ({where})")
    splits = [int(x) for x in args.splits.split(",")]
    config = EvalConfig(mode="tp")
    vanilla = np.mean([evaluate(check, get_policy("vanilla").solve(fit, 8), None, config)["expert_imbalance"]
                       for fit, check in (profile.split(args.fit_frac, k) for k in splits)])
    print(f"vanilla expert_imbalance {vanilla:.4f}")
    if args.restarts:
        for restarts in (int(x) for x in args.restarts.split(",")):
            for slack in (BOUND_SLACK, np.inf):
                policy = SemMoEPolicy(load_slack=slack, load_price=0.0, restarts=restarts)
                lar, imbalance = held_out(profile, splits, policy, config, args.fit_frac)
                print(f"restarts {restarts}, load_slack {slack}: lar {lar:.4f}, expert_imbalance {imbalance:.4f}",
                      flush=True)
        return
    slack_rows = {}
    for slack in (float(x) for x in args.slacks.split(",")):
        lar, imbalance = held_out(profile, splits, SemMoEPolicy(load_slack=slack, load_price=0.0), config,
                                    args.fit_frac)
        print(f"load_slack {slack}: lar {lar:.4f}, expert_imbalance {imbalance:.4f}", flush=True)
        if np.isfinite(slack):
            slack_rows[slack] = imbalance
    chosen = min(slack_rows, key=lambda s: abs(slack_rows[s] - vanilla))
    print(f"chosen: {chosen}")
    if args.prices:
        price_rows = {}
        for price in sorted(float(x) for x in args.prices.split(",")):
            lar, imbalance = held_out(profile, splits, SemMoEPolicy(load_slack=np.inf, load_price=price), config,
                                        args.fit_frac)
            print(f"load_price {price}: lar {lar:.4f}, expert_imbalance {imbalance:.4f}", flush=True)
            price_rows[price] = imbalance
        ok = [p for p, imbalance in price_rows.items() if imbalance <= slack_rows[chosen]]
        print(f"load_price at or below slack {chosen}'s expert imbalance: {min(ok) if ok else 'none'}")


if __name__ == "__main__":
    main()
