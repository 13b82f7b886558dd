import numpy as np
import pytest

from vllm_semmoe.core.trace import RoutingTrace, TraceError

from vllm_semmoe.core.capture_store import load_trace


def test_dev_trace_shape(dev_trace):
    assert dev_trace.num_layers == 26 and dev_trace.num_experts == 64 and dev_trace.top_k == 6
    assert dev_trace.num_requests == 1399 and dev_trace.num_tokens == 136135
    assert dev_trace.vocab_size == len(dev_trace.vocab) == 17257


def test_layout_round_trips(small_trace, tmp_path):
    path = tmp_path / "t.npz"
    small_trace.save(path)
    back = load_trace(path)
    for field in ("tokens", "experts", "offsets", "request_ids", "vocab", "is_decode"):
        np.testing.assert_array_equal(getattr(back, field), getattr(small_trace, field))
    assert back.experts.dtype == np.uint8
    assert back.fingerprint() == small_trace.fingerprint()
    with np.load(path) as raw:  # the shared file's keys are all there, same dtypes
        assert raw["tokens"].dtype == np.int32 and raw["offsets"].dtype == np.int64
        assert raw["experts"].shape == (small_trace.num_tokens, 26, 6)


def test_split_is_seeded_disjoint_and_complete(small_trace):
    a1, b1 = small_trace.split(0.2, seed=3)
    a2, _ = small_trace.split(0.2, seed=3)
    a3, _ = small_trace.split(0.2, seed=4)
    np.testing.assert_array_equal(a1.request_ids, a2.request_ids)
    assert not np.array_equal(a1.request_ids, a3.request_ids)
    assert a1.num_requests == 40 and b1.num_requests == 160
    assert set(a1.request_ids).isdisjoint(b1.request_ids)
    assert a1.num_tokens + b1.num_tokens == small_trace.num_tokens


def _arrays():
    return dict(
        tokens=np.array([1, 2, 3, 1], np.int32),
        experts=np.array([[[0, 1]], [[1, 2]], [[2, 3]], [[0, 1]]], np.uint8),
        offsets=np.array([0, 2, 4]),
    )


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(experts=np.zeros((4, 1, 2), np.float32)), "experts"),
        (dict(experts=np.zeros((4, 2), np.uint8)), "experts"),
        (dict(experts=np.zeros((3, 1, 2), np.uint8)), "experts"),
        (dict(offsets=np.array([0, 3, 2, 4])), "offsets"),
        (dict(offsets=np.array([0, 2, 2, 4])), "offsets"),
        (dict(offsets=np.array([0, 2, 5])), "offsets"),
        (dict(tokens=np.array([1.0, 2, 3, 1])), "tokens"),
        (dict(tokens=np.array([], np.int32), experts=np.zeros((0, 1, 2), np.uint8), offsets=np.array([0])), "empty"),
    ],
)
def test_malformed_arrays_name_the_field(change, field):
    with pytest.raises(TraceError, match=field):
        RoutingTrace.from_arrays(**{**_arrays(), **change})


def test_expert_id_beyond_num_experts(tmp_path):
    path = tmp_path / "bad.npz"
    np.savez(path, **_arrays(), vocab_size=np.int64(8), num_experts=np.int64(3))
    with pytest.raises(TraceError, match=r"experts: id 3 >= num_experts=3"):
        load_trace(path)


def test_bad_files_give_clear_errors(tmp_path):
    with pytest.raises(TraceError, match="not found"):
        load_trace(tmp_path / "missing.npz")
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip")
    with pytest.raises(TraceError, match=r"junk\.npz: not a routing trace \(expected a \.npz archive"):
        load_trace(junk)
    partial = tmp_path / "partial.npz"
    np.savez(partial, tokens=np.array([1], np.int32))
    with pytest.raises(TraceError, match="missing field.*experts.*offsets"):
        load_trace(partial)
    objects = tmp_path / "objects.npz"
    np.savez(objects, **_arrays(), vocab=np.array([object()] * 4, dtype=object))
    with pytest.raises(TraceError, match="Python objects"):
        load_trace(objects)
    big_token = tmp_path / "big_token.npz"
    np.savez(big_token, **_arrays(), vocab=np.array(["a", "b", "c"]))
    with pytest.raises(TraceError, match="tokens: id 3 >= vocab size 3"):
        load_trace(big_token)
