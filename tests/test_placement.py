import numpy as np
import pytest

from vllm_semmoe.placement import Placement, PlacementError
from vllm_semmoe.policy import POLICIES, get_policy


@pytest.mark.parametrize("method", sorted(POLICIES))
@pytest.mark.parametrize("ep", [2, 4, 8])
def test_every_policy_is_balanced_and_a_permutation(small_trace, method, ep):
    mode = "dp" if ep == 4 else "tp"
    placement = get_policy(method).solve(small_trace, ep, mode=mode, seed=1)
    assert placement.expert_device.shape == (26, 64)
    for row in placement.expert_device:
        assert np.all(np.bincount(row, minlength=ep) == 64 // ep)
    p2l = placement.physical_to_logical()
    for row in p2l:
        assert sorted(row) == list(range(64))
    l2p = placement.logical_to_physical()
    np.testing.assert_array_equal(np.take_along_axis(l2p, p2l, axis=1), np.tile(np.arange(64), (26, 1)))
    # physical slot p lives on device p // (N/E)
    np.testing.assert_array_equal(
        np.take_along_axis(placement.expert_device, p2l, axis=1), np.tile(np.arange(64) // (64 // ep), (26, 1))
    )
    back = Placement.from_physical_to_logical(p2l, ep)
    np.testing.assert_array_equal(back.expert_device, placement.expert_device)


def test_policies_are_deterministic_for_a_seed(small_trace):
    a = get_policy("semmoe").solve(small_trace, 8, seed=5).expert_device
    b = get_policy("semmoe").solve(small_trace, 8, seed=5).expert_device
    np.testing.assert_array_equal(a, b)


def test_placement_rejects_unbalanced_and_bad_ids():
    with pytest.raises(PlacementError, match="layer 0: device 0 holds 3 experts, expected exactly 2"):
        Placement(np.array([[0, 0, 0, 1]]), 2)
    with pytest.raises(PlacementError, match="device ids"):
        Placement(np.array([[0, 1, 2, 5]]), 2)
    with pytest.raises(PlacementError, match="cannot be split evenly"):
        Placement(np.zeros((1, 6), int), 4)


def test_unknown_method_lists_valid_names():
    with pytest.raises(ValueError, match="choose from vanilla, round_robin, eplb, moetuner, semmoe"):
        get_policy("greedy")


def test_semmoe_rejects_unknown_mode(small_trace):
    with pytest.raises(ValueError, match="mode must be"):
        get_policy("semmoe").solve(small_trace, 8, mode="pp")


def test_eplb_balances_load_better_than_vanilla(small_trace):
    from vllm_semmoe.policy.simple import expert_loads

    loads = expert_loads(small_trace)

    def spread(placement):
        per = np.stack([np.bincount(r, weights=w, minlength=8) for r, w in zip(placement.expert_device, loads)])
        return (per.max(1) / per.mean(1)).mean()

    assert spread(get_policy("eplb").solve(small_trace, 8)) < spread(get_policy("vanilla").solve(small_trace, 8))


def test_moetuner_respects_its_load_bound(small_trace):
    from vllm_semmoe.policy.simple import expert_loads

    loads = expert_loads(small_trace)
    placement = get_policy("moetuner").solve(small_trace, 8)
    per = np.stack([np.bincount(r, weights=w, minlength=8) for r, w in zip(placement.expert_device, loads)])
    assert np.all(per.max(1) <= 1.10 * per.mean(1) + 1e-6)
