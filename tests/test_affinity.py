import numpy as np

from vllm_semmoe.core.affinity import affinity_report, confidence, token_expert_counts
from vllm_semmoe.core.trace import RoutingTrace


def test_counts_match_a_direct_count(small_trace):
    token_ids, counts = token_expert_counts(small_trace)
    assert counts.shape == (26, len(token_ids), 64)
    assert counts.sum() == small_trace.num_tokens * 26 * 6
    tok = token_ids[5]
    rows = small_trace.experts[small_trace.tokens == tok]
    np.testing.assert_array_equal(counts[3, 5], np.bincount(rows[:, 3].ravel(), minlength=64))
    cp = confidence(counts)
    np.testing.assert_allclose(cp.sum(axis=2), 1.0, rtol=1e-5)


def _constant_trace(noise: bool):
    """Token 0 always routes to experts {0, 1}, token 1 to {2, 3}; or both at random."""
    rng = np.random.default_rng(0)
    tokens = np.tile([0, 1], 30).astype(np.int32)
    experts = np.where(tokens[:, None, None] == 0, [[0, 1]], [[2, 3]]).astype(np.uint8)
    if noise:
        experts = np.sort(np.stack([rng.choice(8, 2, replace=False) for _ in range(60)]))[:, None, :]
    return RoutingTrace.from_arrays(tokens, experts, [0, 20, 60], vocab_size=2, num_experts=8)


def test_perfect_affinity_scores_one():
    report = affinity_report(_constant_trace(noise=False), min_count=20)
    assert report["tokens_considered"] == 2
    layer = report["layers"][0]
    assert layer["f1"] == [1.0, 1.0, 1.0]
    assert layer["topk_mass"] == [1.0, 1.0, 1.0]
    assert layer["next_mass"] == [0.0, 0.0, 0.0]


def test_random_routing_scores_low():
    report = affinity_report(_constant_trace(noise=True), min_count=20)
    assert report["layers"][0]["f1"][2] < 0.5  # 2 of 8 experts at random: F1 about 0.25


def test_real_trace_shows_context_independence(small_trace):
    report = affinity_report(small_trace, min_count=20)
    medians = np.array([row["topk_mass"][1] for row in report["layers"]])
    f1 = np.array([row["f1"][1] for row in report["layers"]])
    assert f1.min() > 0.35  # honest (leave-one-out) prediction far above chance (6/64)
    # the paper's observation: a frequent token's k hottest experts carry most of its mass
    assert medians.min() > 0.4  # vs 2/64 = 0.03 for routing without affinity
    assert all(row["next_mass"][1] < row["topk_mass"][1] / 6 for row in report["layers"])
