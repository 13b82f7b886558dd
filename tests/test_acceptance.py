"""The offline-scheduling acceptance figures on the real DeepSeek-V2-Lite trace (EP 8).

Same computation as ``semmoe eval --profile dsv2lite_puffin-dev.npz --profile-frac 0.2
--seed 0 --ep 8 --mode tp|dp --method vanilla,eplb,moetuner,semmoe``.
"""

import pytest

from vllm_semmoe.evaluate import EvalConfig, compare_methods

METHODS = ["vanilla", "eplb", "moetuner", "semmoe"]


@pytest.fixture(scope="module")
def split(dev_trace):
    return dev_trace.split(0.2, seed=0)


def test_tp_mode(split):
    rows = compare_methods(*split, 8, METHODS, EvalConfig(mode="tp"), seed=0)
    assert abs(rows["vanilla"]["lar"] - 0.125) < 0.005
    assert rows["semmoe"]["lar"] >= 0.38
    assert rows["semmoe"]["imbalance"] <= 1.0 + 1e-9  # align: equal slices
    for other in ("eplb", "moetuner"):
        assert rows["semmoe"]["lar"] > rows[other]["lar"]
        assert rows["semmoe"]["lar"] > rows[other]["lar_with_semmoe_sched"]


def test_dp_mode(split):
    rows = compare_methods(*split, 8, METHODS, EvalConfig(mode="dp"), seed=0)
    assert abs(rows["vanilla"]["lar"] - 0.125) < 0.005
    assert rows["semmoe"]["lar"] >= 0.17
    assert rows["semmoe"]["imbalance"] <= 1.10
    for other in ("eplb", "moetuner"):
        assert rows["semmoe"]["lar"] > rows[other]["lar"]
        assert rows["semmoe"]["lar"] > rows[other]["lar_with_semmoe_sched"]

