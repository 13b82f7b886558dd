"""Fuzzing every user input format: a malformed trace, capture, tables directory, manifest or
plugin config gives the project's own error type with a message, never another exception."""

import io
import json
import os
import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from vllm_semmoe.core.capture_store import SegmentWriter, encode_step
from vllm_semmoe.core.policy import get_policy
from vllm_semmoe.core.synthetic import synthetic_trace
from vllm_semmoe.core.tables import TablesError, build_tables, load_tables
from vllm_semmoe.core.trace import RoutingTrace, TraceError
from vllm_semmoe.core.capture_store import load_trace
from vllm_semmoe.vllm_adapter.config import SemMoEConfig, SemMoEConfigError

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

dtypes = st.sampled_from(["int8", "uint8", "int16", "int32", "int64", "uint64", "float32", "bool", "U3", "S2",
                          "complex64"])
arrays = dtypes.flatmap(lambda d: hnp.arrays(d, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)))


def _valid_trace() -> RoutingTrace:
    return synthetic_trace(num_layers=2, num_experts=8, top_k=2, vocab_size=64, num_requests=4, seed=0)


def _valid_trace_fields() -> dict:
    t = _valid_trace()
    return {"tokens": t.tokens, "experts": t.experts, "offsets": t.offsets, "request_ids": t.request_ids,
            "num_experts": np.int64(t.num_experts), "vocab_size": np.int64(t.vocab_size),
            "is_decode": t.is_decode}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def _write_npz(path, fields: dict) -> None:
    with open(path, "wb") as f:
        np.savez(f, **fields)


# ---- traces ------------------------------------------------------------------------------------
@FUZZ
@given(replace=st.dictionaries(st.sampled_from(sorted(_valid_trace_fields()) + ["vocab"]), arrays, max_size=3),
       drop=st.sets(st.sampled_from(sorted(_valid_trace_fields()))))
def test_trace_fields(workdir, replace, drop):
    fields = {k: v for k, v in _valid_trace_fields().items() if k not in drop}
    fields.update(replace)
    path = workdir / "fields.npz"
    _write_npz(path, fields)
    try:
        load_trace(path)
    except TraceError as exc:
        assert str(exc)


@FUZZ
@given(data=st.data())
def test_trace_bytes(workdir, data):
    path = workdir / "bytes.npz"
    buffer = io.BytesIO()
    np.savez(buffer, **_valid_trace_fields())
    valid = buffer.getvalue()
    mode = data.draw(st.sampled_from(["truncate", "flip", "random"]))
    if mode == "truncate":
        blob = valid[: data.draw(st.integers(0, len(valid) - 1))]
    elif mode == "flip":
        blob = bytearray(valid)
        for i in data.draw(st.lists(st.integers(0, len(valid) - 1), min_size=1, max_size=8)):
            blob[i] ^= 0xFF
        blob = bytes(blob)
    else:
        blob = data.draw(st.binary(max_size=200))
    path.write_bytes(blob)
    try:
        load_trace(path)
    except TraceError as exc:
        assert str(exc)


# ---- live capture segments ----------------------------------------------------------------------
def _valid_segment(path) -> bytes:
    writer = SegmentWriter(path, num_layers=2, num_experts=8, top_k=2, vocab_size=64, vocab=[])
    rng = np.random.default_rng(0)
    for step in range(3):
        n = 3
        writer.append([f"r{step}"], [2], np.zeros(n), np.arange(n), rng.integers(0, 64, n),
                      rng.integers(0, 8, (n, 2, 2)))
    writer.close()
    return open(writer.path, "rb").read()


@FUZZ
@given(data=st.data())
def test_capture_segments(workdir, data):
    path = workdir / "cap.npz"
    valid = _valid_segment(path)
    mode = data.draw(st.sampled_from(["truncate", "flip", "random", "step"]))
    if mode == "truncate":
        blob = valid[: data.draw(st.integers(0, len(valid) - 1))]
    elif mode == "flip":
        blob = bytearray(valid)
        for i in data.draw(st.lists(st.integers(0, len(valid) - 1), min_size=1, max_size=8)):
            blob[i] ^= 0xFF
        blob = bytes(blob)
    elif mode == "random":
        blob = data.draw(st.binary(max_size=300))
    else:  # a well-framed step record whose payload lies (checksum right, content wrong)
        payload = bytearray(encode_step(["a"], [1], [0, 0], [0, 1], [1, 2], np.zeros((2, 2, 2), np.uint8)))
        for i in data.draw(st.lists(st.integers(0, len(payload) - 1), min_size=1, max_size=6)):
            payload[i] = data.draw(st.integers(0, 255))
        payload = bytes(payload)
        blob = valid + struct.pack("<4sIQI", b"SMRC", 1, len(payload), zlib.crc32(payload)) + payload
    with open(os.path.join(str(path) + ".parts", "dp0.seg"), "wb") as f:
        f.write(blob)
    try:
        load_trace(path)
    except TraceError as exc:
        assert str(exc)


# ---- tables and manifests -----------------------------------------------------------------------
json_values = st.recursive(st.none() | st.booleans() | st.integers(-3, 10**6) | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                           max_leaves=6)


@pytest.fixture(scope="module")
def valid_tables(tmp_path_factory):
    trace = _valid_trace()
    tables = build_tables(trace, get_policy("vanilla").solve(trace, 2), mode="tp")
    out = tmp_path_factory.mktemp("tables") / "t"
    tables.save(out)
    with np.load(out / "tables.npz") as data:
        arrays = {k: data[k] for k in data.files}
    return json.loads((out / "manifest.json").read_text()), arrays


@FUZZ
@given(manifest_edit=st.dictionaries(st.sampled_from(["format", "method", "mode", "ep_size", "num_layers",
                                                      "num_experts", "top_k", "vocab_size", "source_trace", "x"]),
                                     json_values, max_size=3),
       drop=st.sets(st.sampled_from(["format", "ep_size", "mode", "top_k", "method"])),
       whole=st.one_of(st.none(), json_values),
       array_edit=st.dictionaries(st.sampled_from(["expert_device", "t2d_tokens", "t2d_score", "markov", "oov_score"]),
                                  arrays, max_size=2),
       array_drop=st.sets(st.sampled_from(["expert_device", "t2d_tokens", "t2d_score", "markov", "oov_score"]),
                          max_size=1))
def test_tables_directory(workdir, valid_tables, manifest_edit, drop, whole, array_edit, array_drop):
    manifest, arrays = valid_tables
    directory = workdir / "tables"
    directory.mkdir(exist_ok=True)
    manifest = {k: v for k, v in manifest.items() if k not in drop}
    manifest.update(manifest_edit)
    (directory / "manifest.json").write_text(json.dumps(manifest if whole is None else whole))
    fields = {k: v for k, v in arrays.items() if k not in array_drop}
    fields.update(array_edit)
    _write_npz(directory / "tables.npz", fields)
    try:
        load_tables(directory)
    except TablesError as exc:
        assert str(exc)


@FUZZ
@given(data=st.data())
def test_tables_bytes(workdir, valid_tables, data):
    manifest, arrays = valid_tables
    directory = workdir / "tables_bytes"
    directory.mkdir(exist_ok=True)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    valid_npz, valid_manifest = buffer.getvalue(), json.dumps(manifest).encode()
    which = data.draw(st.sampled_from(["tables.npz", "manifest.json"]))
    valid = valid_npz if which == "tables.npz" else valid_manifest
    blob = data.draw(st.one_of(st.binary(max_size=100), st.integers(0, len(valid) - 1).map(lambda n: valid[:n])))
    (directory / "tables.npz").write_bytes(blob if which == "tables.npz" else valid_npz)
    (directory / "manifest.json").write_bytes(blob if which == "manifest.json" else valid_manifest)
    try:
        load_tables(directory)
    except TablesError as exc:
        assert str(exc)


# ---- plugin configs -----------------------------------------------------------------------------
@FUZZ
@given(raw=st.one_of(json_values, st.dictionaries(
    st.sampled_from(["tables", "capture", "mode", "dp_slack", "dp_balance", "dp_price_step", "other"]),
    st.one_of(json_values, st.sampled_from(["tp", "dp", "placement-only", "/", "/nonexistent/x.npz", "x.npz"])),
    max_size=4)))
def test_plugin_config(raw):
    try:
        SemMoEConfig.from_additional_config({"semmoe": raw})
        SemMoEConfig.from_additional_config(raw)
    except SemMoEConfigError as exc:
        assert str(exc)
