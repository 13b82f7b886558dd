"""Durable routing capture: the on-disk layout, and real servers stopped by signals.

The server tests start ``semmoe serve`` on the embedded tiny MoE with ``--capture`` (one engine,
and DP 2 + EP), keep requests in flight, stop the server with SIGTERM (to the server process,
as ``kill``/``docker stop`` do) or SIGINT (to its process group, as Ctrl-C does) under vLLM's
default shutdown timeout (0 s: engines are killed without a flush), or kill its engine
processes with SIGKILL (``kill -9``: nothing of theirs runs after it), and check that the capture
is readable and holds the prompt token ids of every request that completed before the signal.

The servers run ``--enforce-eager`` (an eager engine starts faster); captures of compiled
engines are served in ``tests/test_dp_routing.py``.
"""

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import psutil
import pytest

from vllm_semmoe.assets import tiny_moe_path
from vllm_semmoe.core.capture_store import SegmentWriter, compact_capture, parts_dir, segment_path
from vllm_semmoe.core.policy import get_policy
from vllm_semmoe.core.synthetic import synthetic_trace
from vllm_semmoe.core.tables import build_tables
from vllm_semmoe.core.trace import TraceError
from vllm_semmoe.core.capture_store import load_trace
from vllm_semmoe.tools.bench_serve import free_port, wait_healthy
from vllm_semmoe.tools.engine import default_cache_root

L, N, K, V = 3, 16, 2, 50
GRACE_S = 10  # after the signal, as a supervisor waits before SIGKILL (docker stop: 10 s)


def _step(rng, names, prompt_len, positions):
    """One step's rows: each request ``names[i]`` contributes the given positions."""
    request = np.concatenate([np.full(len(p), i) for i, p in enumerate(positions)])
    position = np.concatenate(positions)
    token = rng.integers(0, V, len(position))
    experts = np.stack([rng.permutation(N)[:K] for _ in range(len(position) * L)]).reshape(-1, L, K)
    return names, prompt_len, request, position, token, experts


def _writer(path, rank=0, size=1):
    return SegmentWriter(path, num_layers=L, num_experts=N, top_k=K, vocab_size=V,
                         vocab=[f"t{i}" for i in range(V)], dp_rank=rank, dp_size=size)


def test_segments_merge_into_one_trace(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "cap.npz"
    w0, w1 = _writer(path, 0, 2), _writer(path, 1, 2)
    a = _step(rng, ["a", "b"], [3, 2], [np.arange(3), np.arange(2)])  # prefills
    b = _step(rng, ["a", "b"], [3, 2], [np.array([3]), np.array([2])])  # decodes
    c = _step(rng, ["a"], [4], [np.arange(4)])  # the same name on rank 1 is another request
    w0.append(*a)
    w0.append(*b)
    w1.append(*c)
    trace = load_trace(path)  # X.npz absent: its parts are read
    assert trace.num_requests == 3 and trace.num_tokens == 3 + 1 + 2 + 1 + 4
    rows = slice(trace.offsets[0], trace.offsets[1])
    np.testing.assert_array_equal(trace.tokens[rows], np.concatenate([a[4][:3], b[4][:1]]))
    np.testing.assert_array_equal(trace.is_decode[rows], [False, False, False, True])
    np.testing.assert_array_equal(trace.experts[rows], np.sort(np.concatenate([a[5][:3], b[5][:1]]), axis=2))
    assert load_trace(parts_dir(path)).num_tokens == trace.num_tokens  # the directory itself
    assert list(trace.vocab[:2]) == ["t0", "t1"] and trace.num_experts == N
    compacted = compact_capture(path)
    assert not os.path.exists(parts_dir(path))
    np.testing.assert_array_equal(load_trace(path).tokens, compacted.tokens)


def test_recomputed_positions_keep_the_last_capture(tmp_path):
    rng = np.random.default_rng(1)
    w = _writer(tmp_path / "cap.npz")
    first = _step(rng, ["r"], [4], [np.arange(4)])
    again = _step(rng, ["r"], [4], [np.arange(4)])  # preempted and recomputed
    w.append(*first)
    w.append(*again)
    trace = load_trace(tmp_path / "cap.npz")
    np.testing.assert_array_equal(trace.tokens, again[4])


def test_a_torn_last_record_is_dropped_and_other_damage_named(tmp_path):
    rng = np.random.default_rng(2)
    path = tmp_path / "cap.npz"
    w = _writer(path)
    for i in range(3):
        w.append(*_step(rng, [f"r{i}"], [2], [np.arange(2)]))
    seg = segment_path(path, 0)
    data = open(seg, "rb").read()
    with open(seg, "wb") as f:  # kill -9 in the middle of the third write
        f.write(data[:-7])
    assert load_trace(path).num_requests == 2
    corrupt = bytearray(data)
    corrupt[len(data) // 2] ^= 0xFF  # damage inside an earlier record
    with open(seg, "wb") as f:
        f.write(bytes(corrupt))
    with pytest.raises(TraceError, match=r"dp0\.seg: .*(corrupt|damaged|not readable)"):
        load_trace(path)
    with open(seg, "wb") as f:
        f.write(b"hello, this is not a capture" * 3)
    with pytest.raises(TraceError, match=r"dp0\.seg: not a semmoe capture segment"):
        load_trace(path)


def test_stale_file_and_parts_together_are_refused(tmp_path):
    rng = np.random.default_rng(3)
    path = tmp_path / "cap.npz"
    w = _writer(path)
    w.append(*_step(rng, ["r"], [2], [np.arange(2)]))
    compact_capture(path)
    w = _writer(path)  # a new run removes the old compacted file (DP rank 0)
    assert not path.exists()
    w.append(*_step(rng, ["r"], [2], [np.arange(2)]))
    path.write_bytes(b"PK\x05\x06" + bytes(18))
    with pytest.raises(TraceError, match=r"both .*cap\.npz and the capture directory .*cap\.npz\.parts exist"):
        load_trace(path)


@pytest.mark.parametrize("method", ["vanilla", "semmoe"])
def test_step_replay_in_chunks_equals_evaluate_on_all_steps(method):
    """The capture's replay keeps no steps: its figures are accumulated chunk by chunk, and must
    equal ``evaluate`` on all steps at once (one batch per step)."""
    from vllm_semmoe.evaluation.evaluate import EvalConfig, StepReplay, evaluate

    trace = synthetic_trace(num_layers=4, num_experts=16, top_k=2, vocab_size=300, num_requests=30)
    tables = build_tables(trace, get_policy(method).solve(trace, 4))
    steps = trace  # every "request" of the trace plays one engine step
    meter = StepReplay(tables, vocab_size=trace.vocab_size)
    lengths = np.diff(steps.offsets)
    for chunk in np.array_split(np.arange(steps.num_requests), 4):
        rows = slice(steps.offsets[chunk[0]], steps.offsets[chunk[-1] + 1])
        meter.add(steps.tokens[rows], steps.experts[rows].astype(np.int64), list(lengths[chunk]))
    whole = evaluate(steps, tables.placement, tables if method == "semmoe" else None,
                     EvalConfig(mode="tp", batch_tokens=0))
    live = meter.result()
    for key in ("lar", "lar_token", "oracle_lar", "imbalance", "expert_imbalance"):
        assert live[key] == pytest.approx(whole[key], rel=1e-9), key
    assert (live["steps"], live["tokens"]) == (steps.num_requests, steps.num_tokens)


# ---- real servers ------------------------------------------------------------------------------
def _complete(base: str, prompt: list[int], max_tokens: int) -> tuple[list[int], float] | None:
    payload = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(base + "/v1/completions", json.dumps(payload).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            json.loads(response.read())
            return prompt, time.monotonic()
    except (urllib.error.URLError, OSError, ValueError):
        return None  # cut off by the signal


def _captured_prompts(trace) -> set[tuple[int, ...]]:
    prompts = set()
    for r in range(trace.num_requests):
        rows = slice(trace.offsets[r], trace.offsets[r + 1])
        prompts.add(tuple(int(t) for t in trace.tokens[rows][~trace.is_decode[rows]]))
    return prompts


@pytest.fixture(scope="module")
def dp_tables(tmp_path_factory):
    trace = synthetic_trace(num_layers=4, num_experts=32, top_k=4, vocab_size=6144, num_requests=60)
    out = tmp_path_factory.mktemp("tables") / "dp2"
    build_tables(trace, get_policy("semmoe").solve(trace, 2, mode="dp"), mode="dp").save(out)
    return out


def _exited(process) -> bool:
    """Whether ``process`` has ended: gone, or a zombie its parent (the API server, busy on a
    loaded machine) has not reaped yet."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _engine_processes(server_pid: int) -> list:
    """The processes the API server started (engine core, workers): its descendants."""
    return psutil.Process(server_pid).children(recursive=True)


# Each signal once, each layout once (a server start costs 1-3 minutes on the 2-core VM; a server
# stopped by one signal cannot take another): SIGTERM reaches the API server only, which stops
# its engine; SIGINT reaches every process of the group at once, the harder case, taken with the
# most processes (DP 2 + EP: two engines, two workers, two API servers, the coordinator); SIGKILL
# goes to the engine processes only, the writers of the capture, which then run nothing more (no
# signal handler, no atexit, no flush), as under `kill -9`, the OOM killer or a crash. Whichever way, the
# capture's durability is the same mechanism: each step's record is handed to the OS when the
# step ends, whoever dies first.
@pytest.mark.parametrize("dp,sig", [(1, signal.SIGTERM), (2, signal.SIGINT), (1, signal.SIGKILL)],
                         ids=["one-engine-SIGTERM", "dp2-ep-SIGINT", "one-engine-SIGKILL-engines"])
def test_capture_survives_signal(tmp_path, dp_tables, dp, sig):
    started = time.monotonic()
    capture = tmp_path / "served.npz"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # vLLM's cache shared with the suite's other engines (each model class inspected once)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CACHE_ROOT=os.environ.get("VLLM_CACHE_ROOT") or default_cache_root())
    cmd = [sys.executable, "-m", "vllm_semmoe.cli", "serve", tiny_moe_path(), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "256", "--enforce-eager",
           "--no-enable-prefix-caching", "--served-model-name", "tiny", "--capture", str(capture)]
    if dp > 1:
        cmd += ["--data-parallel-size", str(dp), "--enable-expert-parallel", "--tables", str(dp_tables),
                "--mode", "dp"]
    log_path = tmp_path / "server.log"
    rng = np.random.default_rng(dp * 100 + int(sig))
    prompts = [rng.integers(100, 6000, int(rng.integers(8, 40))).tolist() for _ in range(48)]
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait_healthy(base, server, 600, str(log_path))
            ready = time.monotonic()
            engines = _engine_processes(server.pid)
            assert engines, "the server started no engine process"
            done: list = []
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                futures = [pool.submit(_complete, base, p, 6) for p in prompts]
                # signal the server while requests are in flight
                while sum(f.done() for f in futures) < len(prompts) // 2:
                    time.sleep(0.05)
                signalled = time.monotonic()
                if sig == signal.SIGINT:  # Ctrl-C: the terminal signals the whole process group
                    os.killpg(server.pid, sig)
                elif sig == signal.SIGKILL:  # `kill -9` of the engine processes, the API server left as is
                    for process in engines:
                        process.send_signal(sig)
                    gone, alive = psutil.wait_procs(engines, timeout=GRACE_S)
                    alive = [process for process in alive if not _exited(process)]
                    assert not alive, f"engine processes {[p.pid for p in alive]} outlived SIGKILL"
                    assert all(p.returncode == -signal.SIGKILL for p in gone if p.returncode is not None), gone
                else:  # `kill PID`, `docker stop`, systemd: the server process only
                    os.kill(server.pid, sig)
                try:
                    server.wait(timeout=GRACE_S)
                    hung = False
                except subprocess.TimeoutExpired:
                    # vLLM's API server waits for open HTTP connections after its engines are
                    # gone; a supervisor (docker, systemd) kills it after its grace period
                    hung = True
                    os.killpg(server.pid, signal.SIGKILL)
                    server.wait()
                stopped = time.monotonic()
                done = [f.result() for f in futures]
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
    completed = [p for p, t in (d for d in done if d is not None) if t < signalled]
    assert len(completed) >= len(prompts) // 2
    trace = load_trace(capture)
    missing = [p for p in completed if tuple(p) not in _captured_prompts(trace)]
    print(f"dp {dp} {signal.Signals(sig).name}: {len(completed)} completed before the signal, "
          f"{trace.num_requests} requests captured, missing {len(missing)}; start {ready - started:.1f} s, "
          f"exit {stopped - signalled:.1f} s after the signal" + (f" (killed after {GRACE_S} s)" if hung else ""))
    assert not missing, f"{len(missing)} of {len(completed)} completed requests are not in the capture"
    # the process group is gone soon: no orphaned engine keeps the capture open
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(server.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    else:
        pytest.fail("engine processes outlived the server by 30 s")
