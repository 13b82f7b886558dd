"""Offline acceptance figures on the real DeepSeek-V2-Lite trace (EP 8, issue 10).

Every figure is the mean over the request splits of seeds 0-4 (20% of requests profiled, 80%
evaluated), and each asserted threshold also holds on every single seed. Same computation as

    semmoe eval --profile ../shared/data/routing/dsv2lite_puffin-dev.npz --profile-frac 0.2 \\
        --seeds 0,1,2,3,4 --ep 8 --mode tp|dp [--redundant R]

Solves are cached under ``$SEMMOE_CACHE_DIR`` (default ``~/.cache/vllm-semmoe``)/solves, keyed
by the profile, the solve's parameters and a hash of the solver sources, so only the
evaluation runs again when the solver is unchanged. Runtime on the 2-core VM with nothing else
running (the evaluation decides layers on both cores): 131 s with a warm cache, 319 s cold (25
Sem-MoE solves, MoETuner on seed 0; measured before the 5 solves without a load term were added:
with them, and with ``tests/test_placement.py``, 397 s cold on 2026-12-02).

Issue 10's bar that these figures do not reach (DP LAR without replicas) is the
``xfail(strict=True)`` test at the end: it documents the gap and fails loudly once the bar is met
(then make it a plain test).
"""

import os

import numpy as np
import pytest

from vllm_semmoe.evaluate import EvalConfig, compare_methods, compare_seeds, placement_cache
from vllm_semmoe.policy.semmoe import SemMoEPolicy

SEEDS = [0, 1, 2, 3, 4]
CACHE_DIR = os.environ.get("SEMMOE_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "vllm-semmoe"))


@pytest.fixture(scope="module")
def cache():
    return placement_cache(os.path.join(CACHE_DIR, "solves"))


@pytest.fixture(scope="module")
def tp(dev_trace, cache):
    """``{R: {method: {key: {"mean", "sd", "per_seed"}}}}`` in TP mode, R = 0, 1, 2."""
    out = {0: compare_seeds(dev_trace, 0.2, SEEDS, 8, ["vanilla", "eplb", "semmoe"], EvalConfig(mode="tp"),
                            solve_cache=cache)}
    for R in (1, 2):
        out[R] = compare_seeds(dev_trace, 0.2, SEEDS, 8, ["semmoe"], EvalConfig(mode="tp"), redundant=R,
                               solve_cache=cache)
    return out


@pytest.fixture(scope="module")
def dp(dev_trace, cache):
    """``{R: {method: {key: {"mean", "sd", "per_seed"}}}}`` in DP mode, R = 0, 1."""
    return {
        0: compare_seeds(dev_trace, 0.2, SEEDS, 8, ["vanilla", "eplb", "semmoe"], EvalConfig(mode="dp"),
                         solve_cache=cache),
        1: compare_seeds(dev_trace, 0.2, SEEDS, 8, ["semmoe"], EvalConfig(mode="dp"), redundant=1,
                         solve_cache=cache),
    }


def seeds(figure) -> np.ndarray:
    return np.asarray(figure["per_seed"])


def test_tp_lar_with_expert_load_at_or_below_vanilla(tp):
    """Issue 10's TP bar: LAR >= 0.39 with expert imbalance at or below vanilla's, every seed."""
    ours, vanilla, eplb = tp[0]["semmoe"], tp[0]["vanilla"], tp[0]["eplb"]
    assert np.all(np.abs(seeds(vanilla["lar"]) - 0.125) < 0.005)
    assert np.all(seeds(ours["lar"]) >= 0.39)  # seeds 0-4: 0.3963-0.4014, mean 0.3984
    # the price on expert load keeps every seed's expert imbalance at or below vanilla's
    assert np.all(seeds(ours["expert_imbalance"]) <= seeds(vanilla["expert_imbalance"]))
    assert np.all(seeds(ours["imbalance"]) <= 1.0 + 1e-3)  # align: equal slices
    assert np.all(seeds(ours["lar"]) > seeds(eplb["lar_with_semmoe_sched"]) + 0.1)


def test_tp_expert_load_term_costs_at_most_one_point(dev_trace, cache, tp):
    """Issue 10's price of balance: the default expert-load term (the Lagrangian θ) against the
    same solver with none, TP LAR on the same splits, at most one point on the seeds' mean
    (``scripts/expert_load_cost.py`` prints the same figures)."""
    free = {"semmoe-noload": SemMoEPolicy(load_slack=np.inf, load_price=0.0)}
    rows = compare_seeds(dev_trace, 0.2, SEEDS, 8, list(free), EvalConfig(mode="tp"), solve_cache=cache, policies=free)
    cost = 100 * (seeds(rows["semmoe-noload"]["lar"]) - seeds(tp[0]["semmoe"]["lar"]))  # LAR points, per seed
    assert cost.mean() <= 1.0  # seeds 0-4: [0.68, 1.03, 0.43, 0.80, 1.08], mean 0.80
    assert np.all(cost <= 1.3) and np.all(cost > 0)


def test_tp_replication_for_locality(tp):
    """Issue 10's replication bars: R = 1 LAR >= 0.43, R = 2 >= 0.46, every seed."""
    lar = {R: seeds(tp[R]["semmoe"]["lar"]) for R in (0, 1, 2)}
    assert np.all(lar[1] >= 0.43)  # seeds 0-4: 0.4386-0.4451, mean 0.4415
    assert np.all(lar[2] >= 0.46)  # seeds 0-4: 0.4732-0.4791, mean 0.4757
    assert np.all(lar[1] > lar[0] + 0.03) and np.all(lar[2] > lar[1] + 0.03)
    for R in (0, 1, 2):
        assert np.all(seeds(tp[R]["semmoe"]["experts_per_device"]) == 8 + R)
        assert np.all(seeds(tp[R]["semmoe"]["redundant"]) == R)


def _balance_ratio(row) -> np.ndarray:
    return seeds(row["window_imbalance"]) / seeds(row["window_imbalance_least_loaded"])


def test_dp_lock_step_balance_as_good_as_least_loaded(dp):
    ours = dp[0]["semmoe"]
    assert np.all(_balance_ratio(ours) <= 1.05)  # seeds 0-4: 0.998-1.045, mean 1.016
    assert np.all(seeds(ours["window_imbalance"]) < seeds(ours["window_imbalance_round_robin"]))
    assert np.all(seeds(ours["lar"]) >= 0.162)  # seeds 0-4: 0.1649-0.1670, mean 0.1661
    for other in ("vanilla", "eplb"):
        assert np.all(seeds(ours["lar"]) > seeds(dp[0][other]["lar_with_semmoe_sched"]))


def test_issue10_bar_dp_with_one_replica_every_seed(dp):
    """Issue 10's DP bar (LAR >= 0.175 at window imbalance <= 1.05 x least-loaded's) on every
    seed with R = 1 (9 physical experts per rank instead of 8), the knobs chosen on the profile
    (balance 4, price step 0.3). Without replicas the LAR misses (the strict xfail below)."""
    ours = dp[1]["semmoe"]
    assert np.all(seeds(ours["lar"]) >= 0.19)  # seeds 0-4: 0.1933-0.1962, mean 0.1950
    assert np.all(_balance_ratio(ours) <= 1.05)  # seeds 0-4: 1.014-1.043, mean 1.028


def test_placement_baselines_on_seed_0(dev_trace, cache):
    """MoETuner (a slow MIP solve) against Sem-MoE on the seed-0 split, both modes."""
    profile, trace = dev_trace.split(0.2, seed=0)
    for mode in ("tp", "dp"):
        rows = compare_methods(profile, trace, 8, ["moetuner", "semmoe"], EvalConfig(mode=mode), solve_cache=cache)
        assert rows["semmoe"]["lar"] > rows["moetuner"]["lar"]
        assert rows["semmoe"]["lar"] > rows["moetuner"]["lar_with_semmoe_sched"]


def test_tp_scheduler_conditions_on_earlier_experts(dev_trace, cache):
    """The X-table rule (T2D and the two previous layers' experts) against the paper's A table
    (two previous layers' majority devices), same placement and tables, seed 0."""
    profile, trace = dev_trace.split(0.2, seed=0)
    rows = {history: compare_methods(profile, trace, 8, ["semmoe"], EvalConfig(mode="tp", tp_history=history),
                                     solve_cache=cache)["semmoe"]["lar"] for history in ("experts", "devices")}
    assert rows["experts"] > rows["devices"] + 0.02  # 0.4014 vs 0.3753


# ---- issue 10's bar not reached (see benchmarks/SEEDS.md for why) ---------------------------
@pytest.mark.xfail(strict=True, reason="R = 0: DP LAR mean 0.1661 at lock-step balance (<= 1.05 x least-loaded)")
def test_issue10_bar_dp_lar_0175_without_replicas(dp):
    assert dp[0]["semmoe"]["lar"]["mean"] >= 0.175
