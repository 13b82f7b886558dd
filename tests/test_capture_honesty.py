"""Captures that say what they miss, and failures of the plugin's own machinery made visible.

- Coverage: a request whose leading tokens vLLM's prefix cache serves never routes them; the
  capture records those tokens too, marked as not routed, and every reader states the share of
  tokens with routing (the trace, the capture summary, ``semmoe eval``). Older captures still load
  and say that their coverage is not recorded.
- A capture that stops on a write error while the engine serves on, and a MoE layer whose token
  exchange is not metered, reach ``/metrics``, the live counters ``bench-serve`` reads (and so its
  JSON and exit status) and ``semmoe serve``'s exit status.

The recorder, the capture writer and the dispatch decision are driven directly (no engine); one
real server (``semmoe serve --capture`` with vLLM's default prefix caching) checks the whole path.
"""

import functools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
import torch

from vllm_semmoe.core.capture_store import (HEADER, HEADER_KEYS, CHUNK, _frame, _npz_bytes, compact_capture, coverage,
                                       coverage_text, encode_step, parts_dir, segment_path)
from vllm_semmoe.cli import main
from vllm_semmoe.core.synthetic import synthetic_trace
from vllm_semmoe.core.trace import RoutingTrace, TraceError
from vllm_semmoe.core.capture_store import load_trace
from vllm_semmoe.vllm_adapter import ep_dispatch, metrics
from vllm_semmoe.tools.bench_serve import _summarise, parse_metrics, run_problems
from vllm_semmoe.vllm_adapter.capture import LiveCounters, RoutingRecorder
from vllm_semmoe.vllm_adapter.config import SemMoEConfig
from vllm_semmoe.vllm_adapter.recording import flush_state, report_engine_failure
from vllm_semmoe.core.modes import Layout
from vllm_semmoe.vllm_adapter.state import EngineState, new_moe_counters
from vllm_semmoe.cli.serving import serve_exit_status
from vllm_semmoe.testing.processes import fresh_cache_root

L, N, K, V = 3, 16, 2, 64


class Engine:
    """Drives a :class:`RoutingRecorder` as the model-runner hook does: each step's requests,
    positions and token ids from the requests' full token sequences, random routing per layer."""

    def __init__(self, recorder: RoutingRecorder, sequences: dict, prompt_len: dict, seed: int = 0):
        self.recorder, self.sequences, self.prompt_len = recorder, sequences, prompt_len
        self.rng = np.random.default_rng(seed)

    def step(self, rows: dict, live=None) -> None:
        """``rows``: request id -> positions it computes in this step."""
        names = list(rows)
        bounds = np.concatenate([[0], np.cumsum([len(p) for p in rows.values()])]).astype(np.int64)
        positions = np.concatenate([np.asarray(p, np.int64) for p in rows.values()])
        tokens = np.concatenate([self.sequences[name][np.asarray(p)] for name, p in rows.items()])
        self.recorder.begin_forward(names, np.array([self.prompt_len[n] for n in names]), bounds, tokens, positions,
                                    token_ids=lambda i, start, end: self.sequences[names[i]][start:end],
                                    live=set(self.sequences) if live is None else live)
        for layer in range(L):
            ids = np.stack([self.rng.permutation(N)[:K] for _ in range(len(tokens))])
            self.recorder.on_layer(layer, torch.from_numpy(ids))
        self.recorder.end_forward()


def _recorder(path=None, dp_rank=0, dp_size=1) -> RoutingRecorder:
    recorder = RoutingRecorder(num_layers=L, num_experts=N, top_k=K, placement=None,
                               vocab=[f"t{i}" for i in range(V)], vocab_size=V)
    if path is not None:
        recorder.open_store(str(path), dp_rank=dp_rank, dp_size=dp_size)
    return recorder


def _sequences(seed=0, length=16, names=("a", "b", "c")) -> dict:
    rng = np.random.default_rng(seed)
    return {name: rng.integers(1, V, length) for name in names}


# ---- coverage --------------------------------------------------------------------------------
def test_positions_a_step_skips_are_captured_as_not_routed(tmp_path):
    path = tmp_path / "cap.npz"
    sequences = _sequences()
    engine = Engine(_recorder(path), sequences, {"a": 12, "b": 12, "c": 12})
    r = np.arange
    engine.step({"a": r(0, 12)})                      # computed from position 0
    engine.step({"b": r(8, 12), "a": [12]})           # b: positions 0..7 served by the prefix cache
    engine.step({"c": r(4, 8), "b": [12]})            # c: 0..3 from the cache
    engine.step({"c": r(2, 10)}, live={"a", "b", "c"})  # c preempted, resumed: 2..9 recomputed, 0..1 cached
    engine.step({"a": [13]}, live={"a"})              # b and c finished

    trace = load_trace(path)
    expected = [(1, p, sequences["b"][p]) for p in range(8)] + [(2, p, sequences["c"][p]) for p in range(2)]
    np.testing.assert_array_equal(trace.unrouted, np.array(expected, np.int64))
    for index, name in enumerate("abc"):  # every token the request had: the skipped ones, then the routed ones
        rows = slice(trace.offsets[index], trace.offsets[index + 1])
        skipped = trace.unrouted[trace.unrouted[:, 0] == index, 2]
        whole = np.concatenate([skipped, trace.tokens[rows]])
        np.testing.assert_array_equal(whole, sequences[name][:len(whole)])
    cover = coverage(trace)
    assert (cover["routed_tokens"], cover["unrouted_tokens"], cover["requests_with_unrouted"]) == (14 + 5 + 8, 10, 2)
    assert engine.recorder.coverage() == {"routed_tokens": 27, "unrouted_tokens": 10, "routed_share": 27 / 37}
    assert coverage_text(trace) == ("routing for 73.0% of tokens (10 of 37 in 2 requests not computed: "
                                    "prefix-cache hits or KV loaded from elsewhere)")
    assert set(engine.recorder._covered) == {"a"}  # finished requests leave no record behind
    compacted = compact_capture(path)
    np.testing.assert_array_equal(load_trace(path).unrouted, compacted.unrouted)
    np.testing.assert_array_equal(compacted.unrouted, trace.unrouted)


def test_a_capture_with_every_position_computed_says_so(tmp_path):
    path = tmp_path / "cap.npz"
    engine = Engine(_recorder(path), _sequences(1, names=("a",)), {"a": 8})
    engine.step({"a": np.arange(8)})
    engine.step({"a": [8]})
    trace = load_trace(path)
    assert trace.unrouted.shape == (0, 3)
    assert coverage_text(trace) == "routing for all 9 tokens"


def _v1_segment(path, steps):
    """A segment of the first capture format (no format_version, no coverage records)."""
    os.makedirs(parts_dir(path), exist_ok=True)
    header = {k: np.int64(v) for k, v in zip(HEADER_KEYS, (L, N, K, V, 0, 1))}
    header["vocab"] = np.asarray([], dtype=str)
    with open(segment_path(path, 0), "wb") as f:
        f.write(_frame(HEADER, _npz_bytes(header)))
        for step in steps:
            f.write(_frame(CHUNK, encode_step(*step)))


def test_older_traces_and_captures_load_and_say_coverage_is_unknown(tmp_path):
    rng = np.random.default_rng(2)
    experts = np.stack([rng.permutation(N)[:K] for _ in range(5 * L)]).reshape(5, L, K)
    _v1_segment(tmp_path / "old.npz", [(["r"], [5], np.zeros(5), np.arange(5), rng.integers(0, V, 5), experts)])
    old = load_trace(tmp_path / "old.npz")
    assert old.unrouted is None and coverage(old) is None and coverage_text(old) == "coverage not recorded"
    synthetic = synthetic_trace(num_layers=L, num_experts=N, top_k=K, vocab_size=V, num_requests=6)
    synthetic.save(tmp_path / "plain.npz")
    assert load_trace(tmp_path / "plain.npz").unrouted is None

    # a newer format is refused with the fix, not misread
    header = {k: np.int64(v) for k, v in zip(HEADER_KEYS, (L, N, K, V, 0, 1))}
    header.update(vocab=np.asarray([], dtype=str), format_version=np.int64(99))
    os.makedirs(parts_dir(tmp_path / "new.npz"))
    with open(segment_path(tmp_path / "new.npz", 0), "wb") as f:
        f.write(_frame(HEADER, _npz_bytes(header)))
    with pytest.raises(TraceError, match=r"dp0\.seg: capture format version 99 is newer .* upgrade vllm-semmoe"):
        load_trace(tmp_path / "new.npz")


def test_unrouted_rows_survive_save_select_and_split(tmp_path):
    base = synthetic_trace(num_layers=L, num_experts=N, top_k=K, vocab_size=V, num_requests=10)
    rows = np.array([[r, p, (r * 7 + p) % V] for r in (1, 4, 8) for p in range(r)], np.int64)
    trace = RoutingTrace.from_arrays(base.tokens, base.experts, base.offsets, vocab_size=V, num_experts=N,
                                     unrouted=rows)
    trace.save(tmp_path / "t.npz")
    np.testing.assert_array_equal(load_trace(tmp_path / "t.npz").unrouted, rows)
    picked = trace.select_requests([8, 1, 2])  # renumbered to the selection's order
    np.testing.assert_array_equal(picked.unrouted, np.array([[0, p, (56 + p) % V] for p in range(8)]
                                                            + [[1, 0, 7]], np.int64))
    first, rest = trace.split(0.5, seed=3)
    assert len(first.unrouted) + len(rest.unrouted) == len(rows)
    with pytest.raises(TraceError, match="unrouted: a request index outside"):
        RoutingTrace.from_arrays(base.tokens, base.experts, base.offsets, vocab_size=V, unrouted=[[10, 0, 1]])


def test_eval_states_the_share_of_tokens_with_routing(tmp_path, capsys):
    base = synthetic_trace(num_layers=4, num_experts=32, top_k=4, vocab_size=300, num_requests=120)
    rows = np.array([[r, p, 5] for r in range(0, 120, 3) for p in range(4)], np.int64)
    captured = RoutingTrace.from_arrays(base.tokens, base.experts, base.offsets, vocab_size=300, num_experts=32,
                                        unrouted=rows)
    captured.save(tmp_path / "captured.npz")
    base.save(tmp_path / "plain.npz")
    for name, pattern in (("captured", r"profile routing for \d+\.\d% of tokens \(\d+ of \d+ in \d+ requests not "
                                       r"computed.*; evaluation routing for \d+\.\d% of tokens"),
                          ("plain", r"profile coverage not recorded; evaluation coverage not recorded")):
        assert main(["eval", "--profile", str(tmp_path / f"{name}.npz"), "--profile-frac", "0.5", "--ep", "4",
                     "--method", "vanilla"]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("routing coverage:"))
        assert re.search(pattern, line), line


# ---- the plugin's failures -------------------------------------------------------------------
@pytest.fixture
def status_dir(tmp_path, monkeypatch):
    directory = tmp_path / "status"
    directory.mkdir()
    monkeypatch.setenv(metrics.STATUS_DIR_ENV, str(directory))
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    return directory


def _exposition(directory) -> dict:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(metrics.FailureCollector(str(directory)))
    return parse_metrics(generate_latest(registry).decode())


def _live_file(capture, rank, failures=None, moved=1000):
    traffic = dict(new_moe_counters(), dispatch_bytes=moved)
    payload = {"dp_rank": rank, "tp_rank": 0, "steps": 3, "tokens": 10, "prompt_tokens": 8, "local_activations": 5,
               "remote_activations": 5, "lar": 0.5, "moe_traffic": traffic}
    if failures:
        payload["failures"] = failures
    with open(str(capture).replace(".npz", f".dp{rank}.npz.live.json"), "w") as f:
        json.dump(payload, f)


def _bench_summary(capture):
    results = [{"ok": True, "ttft_s": 0.1, "latency_s": 0.5, "tokens": 4, "text": "x"}]
    return _summarise("vllm", 2, 1, results, 1.0, str(capture), 1, 1, 4)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full to fail writes as a full disk does")
def test_a_capture_that_stops_on_a_write_error_is_visible_everywhere(tmp_path, status_dir, caplog):
    capture = tmp_path / "served.npz"
    state = EngineState(config=SemMoEConfig(capture=str(capture)), layout=Layout(dp=2, ep=True), dp_rank=1, ep_size=2)
    recorder = state.recorder = _recorder(capture, dp_rank=1, dp_size=2)
    recorder.on_failure = functools.partial(report_engine_failure, state, 1)
    recorder.live_counters = LiveCounters(str(capture).replace(".npz", ".dp1.npz.live.json"), 1, 2, N, 2,
                                          traffic=state.counters, failures=state.failures)
    engine = Engine(recorder, _sequences(3, names=("a", "b")), {"a": 6, "b": 6})
    engine.step({"a": np.arange(6)})
    recorder.store._file.close()
    recorder.store._file = open("/dev/full", "wb")  # the disk is full from now on
    engine.step({"a": [6], "b": np.arange(6)})  # the engine serves on
    engine.step({"a": [7], "b": [6]})

    reason = state.failures["capture_error"]
    assert "No space left on device" in reason and "capture stopped after 1 steps" in reason
    assert recorder.store is None and load_trace(capture).num_tokens == 6  # what reached the disk
    assert any(r.levelname == "ERROR" and "capture stopped" in r.getMessage() for r in caplog.records)
    summary = flush_state(state)  # the capture's summary
    assert summary["failures"] == {"capture_error": reason} and summary["coverage"]["routed_tokens"] == 15
    with open(str(capture).replace(".npz", ".dp1.npz.json")) as f:
        assert json.load(f)["failures"]["capture_error"] == reason
    assert _exposition(status_dir)["capture_errors_total"] == 1  # /metrics (one API server)

    _live_file(capture, 0)  # bench-serve reads every rank's live counters; rank 1's are the recorder's
    run = _bench_summary(capture)
    assert run["plugin_failures"] == [{"rank": 1, "kind": "capture_error", "reason": reason}]
    assert run_problems(run) and run["moe_bytes_per_token"] is not None  # bytes were metered: still stated

    caplog.clear()
    assert serve_exit_status(0, str(status_dir)) == 1  # semmoe serve's exit status
    assert not status_dir.exists()
    assert any(r.levelname == "ERROR" and reason in r.getMessage() for r in caplog.records)
    os.makedirs(status_dir)
    assert serve_exit_status(0, str(status_dir)) == 0


class _Kernel:
    def __init__(self, stage):
        self.impl = type("Impl", (), {"prepare_finalize": stage})()


class _Experts:
    """The part of vLLM's ``RoutedExperts`` the dispatch decision reads: whether its kernel is
    monolithic and its quant method's modular kernel (``None``: no modular kernel)."""

    def __init__(self, stage, has_kernel=True, monolithic=False):
        self.quant_method = type("Quant", (), {"moe_kernel": _Kernel(stage) if has_kernel else None,
                                               "is_monolithic": monolithic})()


class _Runner:
    def __init__(self, experts, naive=False):
        self.routed_experts, self.layer_name, self.do_naive_dispatch_combine = experts, "model.layers.0.mlp", naive


def test_a_dispatch_stage_the_meter_cannot_replace_is_reported_unmetered(tmp_path, status_dir, caplog):
    from vllm.model_executor.layers.fused_moe.prepare_finalize.naive_dp_ep import (
        MoEPrepareAndFinalizeNaiveDPEPModular)
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import MoEPrepareAndFinalizeNoDPEPModular

    from vllm_semmoe.vllm_adapter.patches.prepare_finalize import use_stage

    def decide(experts, naive=False):
        failures = {}
        replaced = []
        use_stage(_Runner(experts, naive), lambda stage: replaced.append(stage) or stage,
                  functools.partial(ep_dispatch.report_unmetered, dp_rank=0, failures=failures))
        return failures.get("unmetered"), replaced

    allgather = MoEPrepareAndFinalizeNaiveDPEPModular(num_dispatchers=2)
    assert decide(_Experts(allgather)) == (None, [allgather])  # vLLM's all-gather stage: metered
    reason, replaced = decide(_Experts(MoEPrepareAndFinalizeNoDPEPModular()))
    assert not replaced and "moves tokens with MoEPrepareAndFinalizeNoDPEPModular" in reason
    assert "not counted" in reason
    assert "all-gathers every token to every rank itself" in decide(_Experts(None, has_kernel=False), naive=True)[0]
    assert "monolithic kernel" in decide(_Experts(None, monolithic=True))[0]
    assert any(r.levelname == "WARNING" and "not counted" in r.getMessage() for r in caplog.records)
    assert _exposition(status_dir)["unmetered_moe_layers_total"] == 3

    capture = tmp_path / "served.npz"  # bench-serve: the bytes read unmetered (None), not 0
    _live_file(capture, 0, {"unmetered": reason}, moved=0)
    _live_file(capture, 1, moved=0)
    run = _bench_summary(capture)
    assert run["moe_bytes_per_token"] is None and any("unmetered" in p for p in run_problems(run))
    assert serve_exit_status(0, str(status_dir)) == 1


# ---- one real server ---------------------------------------------------------------------------
# ``semmoe serve --capture`` on the embedded tiny MoE with vLLM's defaults (prefix caching on),
# started once for the checks below. The engine's capture segment is a named pipe this test reads
# into a regular file (the copy the checks load, byte for byte what the engine wrote); closing the
# pipe's read end later makes the engine's next append fail (EPIPE), as storage that goes away
# does, while the server serves on.
MAX_TOKENS = 8


class SegmentTee:
    """Reads the FIFO ``fifo`` into the file ``copy`` until :meth:`cut`."""

    def __init__(self, fifo: str, copy: str):
        self.fifo, self.copy = fifo, copy
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        import select

        fd = os.open(self.fifo, os.O_RDONLY)  # returns once the engine opens its segment
        try:
            with open(self.copy, "wb") as out:
                while not self.stop.is_set():
                    if not select.select([fd], [], [], 0.2)[0]:
                        continue
                    data = os.read(fd, 1 << 16)
                    if not data:
                        return
                    out.write(data)
                    out.flush()
        finally:
            os.close(fd)

    def settled(self, quiet_s: float = 1.5, timeout: float = 60) -> None:
        """Wait until the copy stops growing (the engine's last records have arrived)."""
        deadline, size, since = time.monotonic() + timeout, -1, time.monotonic()
        while time.monotonic() < deadline:
            now = os.path.getsize(self.copy) if os.path.exists(self.copy) else 0
            if now != size:
                size, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return
            time.sleep(0.1)

    def cut(self) -> None:
        """Close the read end: the engine's next append fails."""
        self.stop.set()
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from vllm_semmoe.assets import tiny_moe_path
    from vllm_semmoe.tools.bench_serve import free_port, wait_healthy

    work = tmp_path_factory.mktemp("served")
    port = free_port()
    capture, copy, log_path = work / "served.npz", work / "copy.npz", work / "server.log"
    os.makedirs(parts_dir(capture))
    os.makedirs(parts_dir(copy))
    os.mkfifo(segment_path(capture, 0))
    tee = SegmentTee(segment_path(capture, 0), segment_path(copy, 0))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CACHE_ROOT=fresh_cache_root(work / "cache"))
    cmd = [sys.executable, "-m", "vllm_semmoe.cli", "serve", tiny_moe_path(), "--host", "127.0.0.1", "--port",
           str(port), "--dtype", "bfloat16", "--max-model-len", "512", "--enforce-eager", "--served-model-name",
           "tiny", "--capture", str(capture)]
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", process, 900, str(log_path))
            yield {"base": f"http://127.0.0.1:{port}", "copy": copy, "tee": tee, "process": process, "log": log_path}
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            tee.cut()


def _complete_all(base: str, prompts: list, concurrency: int = 4, max_tokens: int = MAX_TOKENS) -> list:
    import concurrent.futures

    def one(prompt):
        payload = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        request = urllib.request.Request(base + "/v1/completions", json.dumps(payload).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())["usage"]["completion_tokens"]

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))


def _metrics(base: str) -> dict:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as response:
        return parse_metrics(response.read().decode())


def test_served_capture_with_prefix_caching_holds_every_token(server, capsys):
    rng = np.random.default_rng(7)
    distinct = [rng.integers(100, 6000, 300).tolist() for _ in range(12)]
    assert _complete_all(server["base"], distinct) == [MAX_TOKENS] * len(distinct)
    repeats = [p for p in distinct for _ in range(4)]  # the same prompts again: the prefix cache serves them
    assert _complete_all(server["base"], repeats) == [MAX_TOKENS] * len(repeats)
    server["tee"].settled()

    trace = load_trace(server["copy"])  # what the running engine wrote
    assert trace.num_requests == len(distinct) + len(repeats)
    cover = coverage(trace)
    assert cover["unrouted_tokens"] > 0 and cover["requests_with_unrouted"] > 0, cover  # the cache did serve
    sent = {tuple(p) for p in distinct}
    for r in range(trace.num_requests):  # every request: its whole prompt, cached tokens marked as not routed
        rows = slice(trace.offsets[r], trace.offsets[r + 1])
        skipped = trace.unrouted[trace.unrouted[:, 0] == r]
        assert np.array_equal(skipped[:, 1], np.arange(len(skipped)))  # a leading run of positions
        prompt = tuple(skipped[:, 2].tolist()) + tuple(trace.tokens[rows][~trace.is_decode[rows]].tolist())
        assert prompt in sent, f"request {r}: {len(skipped)} cached + routed prompt tokens are not a prompt sent"
        assert int(trace.is_decode[rows].sum()) == MAX_TOKENS - 1  # the last sampled token is never fed back

    assert main(["eval", "--profile", str(server["copy"]), "--profile-frac", "0.5", "--ep", "4",
                 "--method", "vanilla"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("routing coverage:"))
    assert re.fullmatch(r"routing coverage: profile routing for \d+\.\d% of tokens .*; evaluation routing for "
                        r"\d+\.\d% of tokens .*", line), line
    assert not _metrics(server["base"]).get("capture_errors_total")


def test_served_capture_that_stops_on_a_write_error_fails_the_server_visibly(server):
    base = server["base"]
    rng = np.random.default_rng(8)
    server["tee"].cut()  # the capture's storage goes away
    prompts = [rng.integers(100, 6000, 40).tolist() for _ in range(8)]
    assert _complete_all(base, prompts) == [MAX_TOKENS] * len(prompts)  # the server serves on
    assert _metrics(base)["capture_errors_total"] == 1  # /metrics: one capture stopped
    assert load_trace(server["copy"]).num_requests > 0  # what reached the storage still reads

    process = server["process"]
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 1  # semmoe serve's exit status
    log = server["log"].read_text(errors="replace")
    assert re.search(r"ERROR .*semmoe: could not append to the routing capture .*Broken pipe", log), log[-3000:]
    assert "exiting with status 1: the plugin's machinery failed while serving" in log, log[-3000:]
