import json

import numpy as np
import pytest

from vllm_semmoe.core.policy import get_policy
from vllm_semmoe.core.tables import TablesError, build_tables, load_tables


@pytest.fixture(scope="module")
def tables(small_trace):
    return build_tables(small_trace, get_policy("semmoe").solve(small_trace, 8), mode="tp")


def test_shapes_and_probabilities(tables, small_trace):
    L, E = 26, 8
    J = len(np.unique(small_trace.tokens))
    assert tables.t2d_score.shape == (L, J, E) and tables.markov.shape == (L, E * E, E)
    np.testing.assert_allclose(tables.t2d_score.astype(np.float32).sum(axis=2), 1.0, atol=5e-3)
    np.testing.assert_allclose(tables.markov[2:].sum(axis=2), 1.0, atol=1e-5)
    np.testing.assert_allclose(tables.oov_score.sum(axis=1), 1.0, atol=1e-5)
    assert tables.t2d_device.shape == (L, J) and np.all(tables.t2d_confidence <= 1.0)
    # X: per earlier expert, a distribution over this layer's experts (rows of l < lag unused)
    assert tables.transition.shape == (L, 2, 64, 64) and tables.expert_prior.shape == (L, 64)
    np.testing.assert_allclose(tables.transition[1:, 0].sum(axis=2), 1.0, atol=1e-5)
    np.testing.assert_allclose(tables.transition[2:, 1].sum(axis=2), 1.0, atol=1e-5)
    assert not tables.transition[0].any() and not tables.transition[1, 1].any()
    np.testing.assert_allclose(tables.expert_prior.sum(axis=1), 1.0, atol=1e-5)


def test_transition_counts_what_followed_each_expert(small_trace):
    """X[l, j-1, n, m] from a hand count on the trace, before smoothing (alpha = 0)."""
    from vllm_semmoe.core.tables import expert_transitions

    transition, prior = expert_transitions(small_trace, alpha=0.0)
    ex = small_trace.experts.astype(np.int64)
    l, n = 5, int(ex[0, 4, 0])
    users = np.flatnonzero((ex[:, 4] == n).any(axis=1))  # tokens that used n at layer 4
    want = np.bincount(ex[users, 5].ravel(), minlength=64) / (len(users) * ex.shape[2])
    np.testing.assert_allclose(transition[l, 0, n], want, rtol=1e-6)
    n2 = int(ex[0, 3, 1])
    users = np.flatnonzero((ex[:, 3] == n2).any(axis=1))
    want = np.bincount(ex[users, 5].ravel(), minlength=64) / (len(users) * ex.shape[2])
    np.testing.assert_allclose(transition[l, 1, n2], want, rtol=1e-6)
    np.testing.assert_allclose(prior[l], np.bincount(ex[:, l].ravel(), minlength=64) / ex[:, l].size, rtol=1e-6)


def test_token_rows(tables):
    ids = tables.t2d_tokens
    rows = tables.token_rows(np.array([ids[0], ids[-1], 10**6, ids[3]]))
    assert list(rows) == [0, len(ids) - 1, -1, 3]


def test_round_trip(tables, tmp_path):
    tables.save(tmp_path / "t")
    back = load_tables(tmp_path / "t", num_layers=26, num_experts=64, ep_size=8)
    for field in ("t2d_tokens", "t2d_score", "markov", "oov_score", "transition", "expert_prior"):
        np.testing.assert_array_equal(getattr(back, field), getattr(tables, field))
    np.testing.assert_array_equal(back.placement.expert_device, tables.placement.expert_device)
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert manifest["method"] == "semmoe" and manifest["ep_size"] == 8 and manifest["num_experts"] == 64
    assert manifest["source_trace"] == tables.source_trace


def test_wrong_shape_is_a_clear_error(tables, tmp_path):
    tables.save(tmp_path / "t")
    with pytest.raises(TablesError, match=r"experts per layer 64 \(model has 128\)"):
        load_tables(tmp_path / "t", num_layers=26, num_experts=128)
    with pytest.raises(TablesError, match=r"EP size 8 \(running with 4\)"):
        load_tables(tmp_path / "t", num_layers=26, num_experts=64, ep_size=4)
    with pytest.raises(TablesError, match=r"MoE layers 26 \(model has 48\)"):
        load_tables(tmp_path / "t", num_layers=48, num_experts=64)


def test_missing_or_foreign_directory(tmp_path):
    with pytest.raises(TablesError, match="not found"):
        load_tables(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TablesError, match="no manifest.json"):
        load_tables(tmp_path / "empty")


@pytest.fixture(scope="module")
def replicated(small_trace):
    return build_tables(small_trace, get_policy("semmoe").solve(small_trace, 8, redundant=1), mode="tp")


def test_replicated_tables_count_every_copy(replicated, small_trace):
    """With replicas a token's local shares over devices sum to more than 1, exactly as often
    as its experts have copies."""
    from vllm_semmoe.core.tables import device_counts, placement_device_counts

    placement = replicated.placement
    counts = placement_device_counts(small_trace.experts, placement)
    copies = placement.replica_count()  # [L, N]
    expected = copies[np.arange(26)[None, :, None], small_trace.experts].sum(axis=2)  # [T, L]
    np.testing.assert_array_equal(counts.sum(axis=2), expected)
    home = device_counts(small_trace.experts, placement.expert_device, 8)
    assert np.all(counts >= home)
    np.testing.assert_allclose(replicated.oov_score.sum(axis=1), expected.sum(axis=0) / (len(expected) * 6), rtol=1e-5)
    assert np.all(replicated.t2d_score.astype(np.float32).sum(axis=2) >= 1.0 - 5e-3)


def test_replicated_round_trip_and_format_1_still_loads(replicated, tables, tmp_path):
    replicated.save(tmp_path / "r")
    manifest = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert manifest["format"] == "vllm-semmoe-tables/3" and manifest["redundant"] == 1
    back = load_tables(tmp_path / "r", num_layers=26, num_experts=64, ep_size=8)
    np.testing.assert_array_equal(back.placement.replicas, replicated.placement.replicas)
    np.testing.assert_array_equal(back.placement.physical_to_logical(), replicated.placement.physical_to_logical())
    # a format-1 directory (no replicas array, no "redundant", no X table) written by earlier
    # versions loads, without X (the TP scheduler then uses the A table)
    tables.save(tmp_path / "old")
    manifest = json.loads((tmp_path / "old" / "manifest.json").read_text())
    manifest["format"] = "vllm-semmoe-tables/1"
    del manifest["redundant"]
    (tmp_path / "old" / "manifest.json").write_text(json.dumps(manifest))
    with np.load(tmp_path / "old" / "tables.npz") as data:
        arrays = {k: data[k] for k in data.files if k not in ("replicas", "transition", "expert_prior")}
    np.savez_compressed(tmp_path / "old" / "tables.npz", **arrays)
    old = load_tables(tmp_path / "old", num_layers=26, num_experts=64, ep_size=8)
    assert old.placement.redundant == 0 and old.transition is None
    np.testing.assert_array_equal(old.placement.expert_device, tables.placement.expert_device)
    with pytest.raises(TablesError, match="no transition"):
        old.log_evidence()
    # half an X table is a damaged directory
    np.savez_compressed(tmp_path / "old" / "tables.npz", **arrays, transition=tables.transition)
    with pytest.raises(TablesError, match="not both"):
        load_tables(tmp_path / "old")


def test_unseen_tokens_take_their_nearest_profiled_neighbour(small_trace, tmp_path):
    """The paper's OOV rule: with the model's embedding, an unseen id reads the T2D row of the
    profiled token closest in cosine similarity; without it, -1 (the layer prior)."""
    from vllm_semmoe.core.tables import nearest_profiled_rows

    profiled = np.unique(small_trace.tokens)
    V = int(profiled.max()) + 10
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(V, 16)).astype(np.float32)
    unseen = np.setdiff1d(np.arange(V), profiled)[:5]
    twins = profiled[[3, 7, 11, 13, 17]]
    emb[unseen] = 2.5 * emb[twins] + 0.01 * rng.normal(size=(5, 16))  # near-parallel copies
    rows = nearest_profiled_rows(emb, profiled)
    np.testing.assert_array_equal(rows[unseen], [3, 7, 11, 13, 17])
    np.testing.assert_array_equal(rows[profiled], np.arange(len(profiled)))
    placement = get_policy("vanilla").solve(small_trace, 8)
    plain = build_tables(small_trace, placement)
    nearest = build_tables(small_trace, placement, embedding=emb)
    assert np.all(plain.token_rows(unseen) == -1)
    np.testing.assert_array_equal(nearest.token_rows(np.append(unseen, 10**7)), [3, 7, 11, 13, 17, -1])
    nearest.save(tmp_path / "n")
    back = load_tables(tmp_path / "n")
    np.testing.assert_array_equal(back.token_rows(unseen), [3, 7, 11, 13, 17])
    assert json.loads((tmp_path / "n" / "manifest.json").read_text())["oov"] == "nearest"
    with pytest.raises(TablesError, match="outside the embedding"):
        nearest_profiled_rows(emb[:10], profiled)
