import pytest

from vllm_semmoe.evaluate import EvalConfig, compare_methods, evaluate
from vllm_semmoe.policy import get_policy
from vllm_semmoe.tables import build_tables


@pytest.fixture(scope="module")
def split(small_trace):
    return small_trace.split(0.3, seed=0)


def test_vanilla_default_scheduling_is_one_over_e(split):
    profile, trace = split
    for mode in ("tp", "dp"):
        row = evaluate(trace, get_policy("vanilla").solve(profile, 8), None, EvalConfig(mode=mode))
        assert abs(row["lar"] - 0.125) < 0.01
        assert row["lar"] <= row["oracle_lar"] and 0 < row["lar_token"] <= 1


def test_tp_slices_are_equal(split):
    profile, trace = split
    placement = get_policy("semmoe").solve(profile, 8)
    row = evaluate(trace, placement, build_tables(profile, placement), EvalConfig(mode="tp", batch_tokens=256))
    # the last batch of a trace may hold fewer than E tokens per device; all others are exact
    assert row["imbalance"] < 1.01
    assert row["lar"] <= row["oracle_lar"]


def test_semmoe_beats_the_baselines_on_real_routing(split):
    profile, trace = split
    rows = compare_methods(profile, trace, 8, ["vanilla", "eplb", "moetuner", "semmoe"], EvalConfig(mode="tp"))
    assert rows["semmoe"]["lar"] > 1.5 * rows["eplb"]["lar"]
    assert rows["semmoe"]["lar_with_semmoe_sched"] > rows["eplb"]["lar_with_semmoe_sched"]
    assert rows["semmoe"]["a2a_ratio"] < 0.9 and rows["vanilla"]["a2a_ratio"] == 1.0
    assert set(rows["semmoe"]) >= {"lar", "lar_token", "oracle_lar", "a2a_ratio", "imbalance",
                                   "expert_imbalance", "solve_s", "lar_with_semmoe_sched"}


def test_bad_mode(split):
    profile, trace = split
    with pytest.raises(ValueError, match="mode must be"):
        evaluate(trace, get_policy("vanilla").solve(profile, 8), None, EvalConfig(mode="ep"))
