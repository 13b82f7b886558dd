import json

import numpy as np
import pytest

from vllm_semmoe.policy import get_policy
from vllm_semmoe.tables import TablesError, build_tables, load_tables


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


def test_token_rows(tables):
    ids = tables.t2d_tokens
    rows = tables.token_rows(np.array([ids[0], ids[-1], 10**6, ids[3]]))
    assert list(rows) == [0, len(ids) - 1, -1, 3]


def test_round_trip(tables, tmp_path):
    tables.save(tmp_path / "t")
    back = load_tables(tmp_path / "t", num_layers=26, num_experts=64, ep_size=8)
    for field in ("t2d_tokens", "t2d_score", "markov", "oov_score"):
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
