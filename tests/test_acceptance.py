"""Offline acceptance figures on the real DeepSeek-V2-Lite trace (EP 8).

Every figure is the mean over the request splits of seeds 0-4, and each asserted threshold also
holds on every single seed. The tuning split (20% of the requests, the ones every knob was chosen
on: ``vllm_semmoe.core.trace.TUNING_FRAC``) is in no split; of the other requests each seed profiles
20% of the trace's and evaluates the rest. Same computation as

    semmoe eval --profile ../shared/data/routing/dsv2lite_puffin-dev.npz --profile-frac 0.2 \\
        --seeds 0,1,2,3,4 --ep 8 --mode tp|dp [--redundant R]

Solves are cached under ``$SEMMOE_CACHE_DIR`` (default ``~/.cache/vllm-semmoe``)/solves, keyed
by the profile, the solve's parameters and a hash of the solver sources, so only the
evaluation runs again when the solver is unchanged. The multi-seed figures of :func:`tp` and
:func:`dp` are kept beside them (:func:`stored`), keyed by the trace, this file and every source
of the package's algorithms, evaluation and kernels: they are computed again after any edit of
the code that computes them. Runtime on the 2-core VM with nothing else running (the evaluation
decides layers on both cores): about 10 s with both kept, 80 s with the solves kept, 319 s cold
(25 Sem-MoE solves, MoETuner on seed 0; with the 5 solves without a load term and
``tests/test_placement.py``, 397 s cold).

The bars these figures do not reach on every held-out seed are the ``xfail(strict=True)`` tests at
the end: each documents its gap and fails loudly once the bar is met (then make it a plain test).
"""

import hashlib
import json
import os
from pathlib import Path

import numba
import numpy as np
import pytest

import vllm_semmoe
from vllm_semmoe.evaluation.evaluate import EvalConfig, compare_methods, compare_seeds
from vllm_semmoe.core.policy.semmoe import SemMoEPolicy
from vllm_semmoe.testing.checkpoints import cache_dir

SEEDS = [0, 1, 2, 3, 4]


def stored(name: str, trace, compute):
    """``compute()`` (JSON: keys become strings), read back from ``cache_dir()/acceptance``
    (:func:`vllm_semmoe.testing.checkpoints.cache_dir`) where an identical computation stored
    it: the key hashes ``name``, ``trace``'s fingerprint, this file,
    numpy's and numba's versions and every source file of the package's algorithms (``core``),
    evaluation and kernels, so an edit of any of them computes it again."""
    package = Path(vllm_semmoe.__file__).parent
    digest = hashlib.sha256(f"{name} {trace.fingerprint()} {np.__version__} {numba.__version__}".encode())
    for path in [Path(__file__)] + sorted(p for part in ("core", "evaluation", "kernels")
                                          for p in (package / part).rglob("*.py")):
        digest.update(os.path.relpath(path, package.parent).encode() + b"\0" + path.read_bytes())
    path = cache_dir() / "acceptance" / f"{name}-{digest.hexdigest()[:16]}.json"
    if path.exists():
        return json.loads(path.read_text())
    result = json.loads(json.dumps(compute()))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)
    return result


@pytest.fixture(scope="module")
def tp(dev_trace, solve_cache):
    """``{R: {method: {key: {"mean", "sd", "per_seed"}}}}`` in TP mode, R = 0, 1, 2."""
    def compute():
        out = {0: compare_seeds(dev_trace, 0.2, SEEDS, 8, ["vanilla", "eplb", "semmoe"], EvalConfig(mode="tp"),
                                solve_cache=solve_cache)}
        for R in (1, 2):
            out[R] = compare_seeds(dev_trace, 0.2, SEEDS, 8, ["semmoe"], EvalConfig(mode="tp"), redundant=R,
                                   solve_cache=solve_cache)
        return out

    return {int(R): rows for R, rows in stored("tp", dev_trace, compute).items()}


@pytest.fixture(scope="module")
def dp(dev_trace, solve_cache):
    """``{R: {method: {key: {"mean", "sd", "per_seed"}}}}`` in DP mode, R = 0, 1."""
    def compute():
        return {
            0: compare_seeds(dev_trace, 0.2, SEEDS, 8, ["vanilla", "eplb", "semmoe"], EvalConfig(mode="dp"),
                             solve_cache=solve_cache),
            1: compare_seeds(dev_trace, 0.2, SEEDS, 8, ["semmoe"], EvalConfig(mode="dp"), redundant=1,
                             solve_cache=solve_cache),
        }

    return {int(R): rows for R, rows in stored("dp", dev_trace, compute).items()}


def seeds(figure) -> np.ndarray:
    return np.asarray(figure["per_seed"])


def test_tp_lar_with_expert_load_at_or_below_vanilla(tp):
    """The TP bar: LAR >= 0.39 on every seed, expert imbalance below vanilla's on the seeds' mean
    (on every seed: the strict xfail at the end)."""
    ours, vanilla, eplb = tp[0]["semmoe"], tp[0]["vanilla"], tp[0]["eplb"]
    assert np.all(np.abs(seeds(vanilla["lar"]) - 0.125) < 0.005)
    assert np.all(seeds(ours["lar"]) >= 0.39)  # seeds 0-4: 0.3974-0.4022, mean 0.3999
    assert ours["expert_imbalance"]["mean"] < vanilla["expert_imbalance"]["mean"]  # 1.1018 vs 1.1270
    assert np.all(seeds(ours["imbalance"]) <= 1.0 + 1e-3)  # align: equal slices
    assert np.all(seeds(ours["lar"]) > seeds(eplb["lar_with_semmoe_sched"]) + 0.1)


def test_tp_expert_load_term_costs_at_most_one_point(dev_trace, solve_cache, tp):
    """The price of balance: the default expert-load term (the Lagrangian θ) against the
    same solver with none, TP LAR on the same splits, at most one point on the seeds' mean
    (``scripts/expert_load_cost.py`` prints the same figures)."""
    free = {"semmoe-noload": SemMoEPolicy(load_slack=np.inf, load_price=0.0)}
    rows = stored("tp-noload", dev_trace, lambda: compare_seeds(
        dev_trace, 0.2, SEEDS, 8, list(free), EvalConfig(mode="tp"), solve_cache=solve_cache, policies=free))
    cost = 100 * (seeds(rows["semmoe-noload"]["lar"]) - seeds(tp[0]["semmoe"]["lar"]))  # LAR points, per seed
    assert cost.mean() <= 1.0  # seeds 0-4: [0.81, 1.04, 0.77, 0.63, 1.07], mean 0.86
    assert np.all(cost <= 1.3) and np.all(cost > 0)


def test_tp_replication_for_locality(tp):
    """The replication bars: R = 1 LAR >= 0.43, R = 2 >= 0.46, every seed."""
    lar = {R: seeds(tp[R]["semmoe"]["lar"]) for R in (0, 1, 2)}
    assert np.all(lar[1] >= 0.43)  # seeds 0-4: 0.4406-0.4463, mean 0.4435
    assert np.all(lar[2] >= 0.46)  # seeds 0-4: 0.4760-0.4820, mean 0.4794
    assert np.all(lar[1] > lar[0] + 0.03) and np.all(lar[2] > lar[1] + 0.03)
    for R in (0, 1, 2):
        assert np.all(seeds(tp[R]["semmoe"]["experts_per_device"]) == 8 + R)
        assert np.all(seeds(tp[R]["semmoe"]["redundant"]) == R)


def _balance_ratio(row) -> np.ndarray:
    return seeds(row["window_imbalance"]) / seeds(row["window_imbalance_least_loaded"])


def test_dp_lock_step_balance_as_good_as_least_loaded(dp):
    """Lock-step balance within 1.05x the least-loaded balancer's on the seeds' mean (on every
    seed: the strict xfail at the end), always better than round-robin's."""
    ours = dp[0]["semmoe"]
    assert _balance_ratio(ours).mean() <= 1.05  # seeds 0-4: 1.001-1.052 (seed 1), mean 1.018
    assert np.all(seeds(ours["window_imbalance"]) < seeds(ours["window_imbalance_round_robin"]))
    assert np.all(seeds(ours["lar"]) >= 0.158)  # regression guard; seeds 0-4: 0.1605-0.1700, mean 0.1656
    for other in ("vanilla", "eplb"):
        assert np.all(seeds(ours["lar"]) > seeds(dp[0][other]["lar_with_semmoe_sched"]))


def test_dp_bar_with_one_replica_every_seed(dp):
    """The DP bar (LAR >= 0.175 at window imbalance <= 1.05 x least-loaded's) on every
    seed with R = 1 (9 physical experts per rank instead of 8), the knobs chosen on the tuning
    split (balance 32, price step 0.2). Without replicas the LAR misses (the strict xfail below)."""
    ours = dp[1]["semmoe"]
    assert np.all(seeds(ours["lar"]) >= 0.175)
    assert np.all(seeds(ours["lar"]) >= 0.185)  # regression guard; seeds 0-4: 0.1900-0.1992, mean 0.1951
    assert np.all(_balance_ratio(ours) <= 1.05)  # seeds 0-4: 0.992-1.043, mean 1.018


def test_placement_baselines_on_seed_0(dev_trace, solve_cache):
    """MoETuner (a slow MIP solve) against Sem-MoE on the seed-0 split, both modes."""
    profile, trace = dev_trace.split(0.2, seed=0, hold_out_tuning=True)
    for mode in ("tp", "dp"):
        rows = compare_methods(profile, trace, 8, ["moetuner", "semmoe"], EvalConfig(mode=mode), solve_cache=solve_cache)
        assert rows["semmoe"]["lar"] > rows["moetuner"]["lar"]
        assert rows["semmoe"]["lar"] > rows["moetuner"]["lar_with_semmoe_sched"]


def test_tp_scheduler_conditions_on_earlier_experts(dev_trace, solve_cache):
    """The X-table rule (T2D and the two previous layers' experts) against the paper's A table
    (two previous layers' majority devices), same placement and tables, seed 0."""
    profile, trace = dev_trace.split(0.2, seed=0, hold_out_tuning=True)
    rows = {history: compare_methods(profile, trace, 8, ["semmoe"], EvalConfig(mode="tp", tp_history=history),
                                     solve_cache=solve_cache)["semmoe"]["lar"] for history in ("experts", "devices")}
    assert rows["experts"] > rows["devices"] + 0.02  # 0.3993 vs 0.3739


# ---- bars not reached on every held-out seed (benchmarks/SEEDS.md) --------------------------
@pytest.mark.xfail(strict=True, reason="R = 0: DP LAR mean 0.1656 at lock-step balance (<= 1.05 x least-loaded)")
def test_dp_bar_lar_0175_without_replicas(dp):
    assert dp[0]["semmoe"]["lar"]["mean"] >= 0.175


@pytest.mark.xfail(strict=True, reason="seed 2: expert imbalance 1.1380 against vanilla's 1.1337 (held-out split)")
def test_tp_expert_imbalance_at_or_below_vanilla_every_seed(tp):
    assert np.all(seeds(tp[0]["semmoe"]["expert_imbalance"]) <= seeds(tp[0]["vanilla"]["expert_imbalance"]))


@pytest.mark.xfail(strict=True, reason="seed 1: window imbalance 1.052x least-loaded's at R = 0 (held-out split)")
def test_dp_balance_within_105_every_seed(dp):
    assert np.all(_balance_ratio(dp[0]["semmoe"]) <= 1.05)
