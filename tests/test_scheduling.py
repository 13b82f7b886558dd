import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_semmoe.core import scheduling


@st.composite
def batches(draw):
    E = draw(st.sampled_from([1, 2, 3, 4, 8]))
    B = draw(st.integers(1, 300))
    seed = draw(st.integers(0, 2**31 - 1))
    one_device = draw(st.booleans())
    rng = np.random.default_rng(seed)
    scores = rng.random((B, E)).astype(np.float32)
    if one_device:  # every token wants the same device
        scores[:, 0] += 10.0
    return scores, E


@settings(max_examples=150, deadline=None)
@given(batches())
def test_align_gives_equal_slices_and_processes_every_token_once(batch):
    scores, E = batch
    B = len(scores)
    cap = scheduling.slice_capacity(B, E)
    assert cap == -(-B // E)
    device = scheduling.align(scores, cap)
    assert device.shape == (B,) and device.min() >= 0 and device.max() < E
    assert np.bincount(device, minlength=E).max() <= cap
    slot_token, token_slot = scheduling.shuffle_permutation(device, E, cap)
    assert len(slot_token) == E * cap
    real = slot_token[slot_token != scheduling.PAD]
    assert sorted(real) == list(range(B))  # every token exactly once
    np.testing.assert_array_equal(slot_token[token_slot], np.arange(B))  # inverse round-trips
    np.testing.assert_array_equal(token_slot // cap, device)  # token sits in its device's slice
    x = np.random.default_rng(0).random((B, 3))
    padded = np.zeros((E * cap, 3))
    padded[token_slot] = x  # SRS order ...
    np.testing.assert_array_equal(padded[token_slot], x)  # ... SAG restores the original order


def test_align_keeps_preferences_when_they_fit():
    scores = np.eye(4, dtype=np.float32)[[0, 1, 2, 3, 0, 1, 2, 3]]
    assert list(scheduling.align(scores, 2)) == [0, 1, 2, 3, 0, 1, 2, 3]


def test_align_spills_the_least_costly_token_to_its_next_best():
    # three tokens want device 0 (capacity 2); token 2 loses least by moving to device 1
    scores = np.array([[0.9, 0.1], [0.8, 0.1], [0.5, 0.45], [0.0, 1.0]], np.float32)
    assert list(scheduling.align(scores, 2)) == [0, 0, 1, 1]


@settings(max_examples=300, deadline=None)
@given(U=st.integers(0, 120), E=st.sampled_from([1, 2, 3, 5, 8]), ties=st.booleans(), piled=st.booleans(),
       slack=st.integers(0, 1), seed=st.integers(0, 2**16))
def test_heap_repair_makes_the_sequential_repairs_moves(U, E, ties, piled, slack, seed):
    """``repair_unit`` (per-device heaps) moves the same units to the same devices as the
    sequential loop, ties included, from any start (piled: most units on devices 0 and 1)."""
    rng = np.random.default_rng(seed)
    score = rng.integers(0, 3, (U, E)) / 2.0 if ties else rng.random((U, E))
    device = (np.minimum(rng.integers(0, 2, U), E - 1) if piled else rng.integers(0, E, U)).astype(np.int64)
    load = np.bincount(device, minlength=E).astype(np.float64)
    cap = float(scheduling.slice_capacity(U, E) + slack)
    want_device, want_load = device.copy(), load.copy()
    scheduling._repair_weighted(score, np.ones(U), want_device, want_load, cap)
    got_device, got_load = device.copy(), load.copy()
    scheduling.repair_unit(score, got_device, got_load, cap)
    np.testing.assert_array_equal(got_device, want_device)
    np.testing.assert_array_equal(got_load, want_load)
    assert got_load.max() <= cap or E == 1


def test_tp_layer_scores_combinations():
    t2d = np.array([[0.7, 0.3], [0.5, 0.5]], np.float32)
    oov = np.array([0.5, 0.5], np.float32)
    markov = np.array([[0.5, 0.5], [0.1, 0.9], [0.5, 0.5], [0.5, 0.5]], np.float32)
    rows = np.array([0, 1, -1, 0])
    hist = np.array([-1, 1, 1, 1])
    conf = scheduling.tp_layer_scores(rows, hist, t2d, oov, markov, scheduling.COMBINE_CONFIDENCE)
    np.testing.assert_allclose(conf, [[0.7, 0.3], [0.1, 0.9], [0.1, 0.9], [0.1, 0.9]])
    prod = scheduling.tp_layer_scores(rows, hist, t2d, oov, markov, scheduling.COMBINE_PRODUCT)
    np.testing.assert_allclose(prod[0], [0.7, 0.3])
    np.testing.assert_allclose(prod[3], np.array([0.07, 0.27]) / 0.34, rtol=1e-5)
    np.testing.assert_allclose(prod.sum(axis=1), 1.0, rtol=1e-5)


def test_tp_expert_scores_follow_the_earlier_experts():
    """Two devices, experts 0-1 on device 0 and 2-3 on device 1. Earlier expert 0 predicts
    experts 0-1 here, earlier expert 2 predicts 2-3; T2D is flat, so the earlier experts decide,
    and with no history (or zero weights) the scores are T2D's."""
    N = 4
    holds = np.array([[1, 0], [1, 0], [0, 1], [0, 1]], np.float32)
    prior = np.full(N, 0.25)
    follow = np.array([[0.45, 0.45, 0.05, 0.05], [0.25] * 4, [0.05, 0.05, 0.45, 0.45], [0.25] * 4])
    evidence = np.log(np.stack([follow, follow]) / prior).astype(np.float32)
    t2d = np.array([[0.5, 0.5], [0.9, 0.1]], np.float32)
    oov = np.array([0.5, 0.5], np.float32)
    prev = np.full((4, 2, 1), -1, np.int64)
    prev[0, 0, 0], prev[1, 0, 0], prev[3, 1, 0] = 0, 2, 2
    rows = np.array([0, 0, 0, 1])
    args = (t2d, oov, evidence, np.log(prior).astype(np.float32), holds)
    scores = scheduling.tp_expert_scores(rows, prev, *args, np.array([1.0, 1.0, 0.5]))
    np.testing.assert_allclose(scores[0], [0.9, 0.1], rtol=1e-5)  # 0.5 * 0.9 / 0.5 vs 0.5 * 0.1 / 0.5
    np.testing.assert_allclose(scores[1], [0.1, 0.9], rtol=1e-5)
    np.testing.assert_allclose(scores[2], [0.5, 0.5], rtol=1e-6)  # no history: T2D
    assert scores[3, 0] > 0.5 and scores[3, 0] < 0.9  # T2D 0.9 on device 0, tempered lag-2 against it
    np.testing.assert_allclose(scores.sum(axis=1), 1.0, rtol=1e-6)
    flat = scheduling.tp_expert_scores(rows, prev, *args, np.array([1.0, 0.0, 0.0]))
    np.testing.assert_allclose(flat, t2d[rows], rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 400), st.sampled_from([2, 4, 8]), st.integers(0, 10**6))
def test_dp_round_robin_mask_uses_each_rank_once_per_group(R, E, seed):
    rng = np.random.default_rng(seed)
    votes = rng.random((R, E))
    votes[:, 0] += 5  # everybody prefers rank 0
    lengths = rng.integers(1, 100, R).astype(float)
    rank = scheduling.dp_assign(votes, lengths, 0.1, 64, True)
    for start in range(0, R, E):
        group = rank[start : start + E]
        assert len(set(group)) == len(group)


def test_dp_balance_knob_trades_locality_for_lock_step_balance():
    """A rank everybody likes: with the knobs off every request goes there; with the default
    knobs, the window work stays as balanced as the least-loaded balancer's while weak
    preferences still follow the votes."""
    rng = np.random.default_rng(0)
    R, E, W = 4000, 8, 256
    lengths = rng.integers(5, 200, R).astype(float)
    work = scheduling.request_work(lengths, 128.0)
    votes = rng.random((R, E)) * lengths[:, None]
    votes[:, 3] += 0.5 * lengths
    free = scheduling.dp_assign(votes, work, 0.0, W, False, 0.0)
    assert np.all(free == np.argmax(votes, axis=1))
    blind = scheduling.least_loaded_assign(work, E, W)
    least = scheduling.window_imbalance(blind, work, E, W)
    ranks = scheduling.dp_assign(votes, work, scheduling.DEFAULT_DP_BALANCE, W, False, scheduling.DEFAULT_DP_PRICE_STEP)
    assert scheduling.window_imbalance(ranks, work, E, W) <= 1.05 * least
    # locality survives: clearly more requests on their best rank than under the blind balancer
    best = np.argmax(votes, axis=1)
    assert (ranks == best).mean() > 1.4 * (blind == best).mean()


def test_dp_choose_balanced_prefers_locality_until_the_load_gap_costs_more():
    votes = np.array([10.0, 8.0, 0.0])
    zero = np.zeros(3)
    assert scheduling.dp_choose_balanced(votes, zero, 100.0, 100.0, 1.0, np.zeros(3), 0.0) == 0
    # rank 0 carries one mean request more than rank 1: the request (one mean request of work)
    # pays balance x 1 request x work / mean^2 per unit of load... 2 votes of preference
    load = np.array([100.0, 0.0, 0.0])
    assert scheduling.dp_choose_balanced(votes, load, 100.0, 100.0, 3.0, np.zeros(3), 0.0) == 1
    assert scheduling.dp_choose_balanced(votes, load, 100.0, 100.0, 1.0, np.zeros(3), 0.0) == 0
    # a short request (a tenth of the mean work) pays a tenth: it keeps its preference
    assert scheduling.dp_choose_balanced(votes, load, 100.0, 10.0, 3.0, np.zeros(3), 0.0) == 0
    # flat votes (unseen tokens): the least-loaded rank
    assert scheduling.dp_choose_balanced(np.ones(3), np.array([5.0, 1.0, 3.0]), 100.0, 100.0, 0.01,
                                         np.zeros(3), 0.0) == 1
    # prices: per unit of work, and the chosen rank's price rises (prices keep a zero mean)
    price = np.array([0.03, 0.0, 0.0])  # 3 votes for a mean request: more than the 2-vote preference
    assert scheduling.dp_choose_balanced(votes, zero, 100.0, 100.0, 0.0, price, 0.3) == 1
    np.testing.assert_allclose(price, [0.03 - 0.1, 0.3 - 0.1, -0.1])
    assert price.sum() == pytest.approx(0.03)


def test_dp_prices_settle_where_ranks_share_the_work():
    """Every request prefers rank 0 a little and a few prefer another rank strongly: prices
    alone (no proportional term) spread the work evenly over time, and the strong preferences
    keep their rank."""
    rng = np.random.default_rng(1)
    R, E, W = 6000, 4, 256
    work = np.full(R, 100.0)
    votes = rng.random((R, E))
    votes[:, 0] += 1.0
    strong = rng.random(R) < 0.2
    votes[strong, rng.integers(1, E, strong.sum())] += 20.0
    rank = scheduling.dp_assign(votes, work, 0.0, W, False, 0.05)
    late = slice(R // 2, R)
    share = np.bincount(rank[late], minlength=E) / (R - R // 2)
    assert np.all(np.abs(share - 1 / E) < 0.03)
    assert (rank[strong] == np.argmax(votes[strong], axis=1)).mean() > 0.95


def test_request_votes_sum_over_tokens_and_layers():
    t2d = np.array([[[1.0, 0.0], [0.0, 1.0]], [[0.5, 0.5], [0.0, 1.0]]], np.float32)  # [L=2, J=2, E=2]
    oov = np.array([[0.5, 0.5], [0.5, 0.5]], np.float32)
    votes = scheduling.request_votes(np.array([0, 1, -1]), np.array([0, 2, 3]), t2d, oov)
    np.testing.assert_allclose(votes, [[1.5, 2.5], [1.0, 1.0]])


def test_request_work_adds_the_decode_weight():
    np.testing.assert_allclose(scheduling.request_work(np.array([0, 10, 300]), 128.0), [129.0, 138.0, 428.0])
    assert scheduling.balance_window(8) == 256


def test_window_imbalance_per_window_not_cumulative():
    # two windows, each all on one rank but on different ranks: cumulative balance would be
    # perfect, every window is maximally skewed
    rank = np.array([0] * 4 + [1] * 4)
    work = np.ones(8)
    assert scheduling.window_imbalance(rank, work, 2, 4) == pytest.approx(2.0)
    assert scheduling.window_imbalance(np.array([0, 1] * 4), work, 2, 4) == pytest.approx(1.0)
    # fewer requests than a window: one (partial) window
    assert scheduling.window_imbalance(np.array([0, 0, 1]), np.ones(3), 2, 256) == pytest.approx(4 / 3)


def test_least_loaded_balances_in_window_work_and_round_robin_counts():
    rng = np.random.default_rng(3)
    work = rng.pareto(1.5, 3000) * 50 + 130  # long-tailed prompts plus a decode weight
    least = scheduling.least_loaded_assign(work, 8, 256)
    robin = scheduling.round_robin_assign(3000, 8)
    assert scheduling.window_imbalance(least, work, 8, 256) < scheduling.window_imbalance(robin, work, 8, 256)
    assert scheduling.window_imbalance(robin, np.ones(3000), 8, 256) == pytest.approx(1.0)


@pytest.mark.parametrize("balance,price_step", [(scheduling.DEFAULT_DP_BALANCE, scheduling.DEFAULT_DP_PRICE_STEP),
                                                (256.0, 0.0), (0.0, 0.5)])
def test_dp_knob_keeps_window_work_near_least_loaded(balance, price_step):
    """Long-tailed prompts and a shared preference: a moderate knob keeps the lock-step balance
    close to the locality-blind least-loaded balancer's; the knob off does not."""
    rng = np.random.default_rng(7)
    R, E, W = 3000, 8, 256
    lengths = np.floor(rng.pareto(1.5, R) * 40 + 2)
    work = scheduling.request_work(lengths, 128.0)
    votes = rng.random((R, E)) * lengths[:, None]
    votes[:, 2] += 2.0 * lengths  # every request prefers rank 2
    least = scheduling.window_imbalance(scheduling.least_loaded_assign(work, E, W), work, E, W)
    ours = scheduling.window_imbalance(scheduling.dp_assign(votes, work, balance, W, False, price_step), work, E, W)
    free = scheduling.window_imbalance(scheduling.dp_assign(votes, work, 0.0, W, False, 0.0), work, E, W)
    assert ours <= 1.05 * least
    assert free > 1.5 * least
