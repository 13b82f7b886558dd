"""Sem-MoE through vLLM's own multi-node data parallelism: two "nodes" on the loopback address.

Node 0 is ``semmoe serve`` (= ``vllm serve`` with the plugin settings) running the API server and
DP rank 0 (``--data-parallel-size 2 --data-parallel-size-local 1 --data-parallel-address
127.0.0.1 --data-parallel-rpc-port P``); node 1 is the same command with ``--headless
--data-parallel-start-rank 1``: DP rank 1, no API server, reached by node 0 over its DP address.
Both run EP 2, mode ``dp`` (tables from ``semmoe solve --mode dp --ep 2``), the sparse dispatch and
the routing capture, each node into a directory of its own (nodes do not share a disk).

One deployment serves every check: each node loads the tables and re-places its experts; every
request completes, a prompt gets the same tokens on either rank; node 0's router places
requests on both ranks; each node counts its own MoE bytes, and the two counts agree (what one
rank dispatches the other combines back); the capture parts of the two nodes, brought together,
merge into one trace holding every request. Then node 1 dies (its whole process tree, as a
node is lost) and the deployment ends as vLLM ends it: the API server exits, nothing of either
node is left running, and node 0's capture part stays readable. Two more deployments end by
SIGTERM, one to each node, under load (after node 0, node 1 is stopped too: vLLM's headless node
watches only its own engines, and idle ones wait for a front-end that is gone): the same end, and
the merged capture holds every request that completed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from vllm_semmoe.assets import tiny_moe_path
from vllm_semmoe.tools.bench_serve import free_port, wait_healthy

pytest.importorskip("vllm")

from test_cpu_parallel import (  # noqa: E402  (shared engine helpers)
    MAX_TOKENS, PROMPTS, REPO, SERVER_START_TIMEOUT_S, _engine_env, _kill_group, _post_json, _tail)
from test_route import _prompt_tokens_per_engine  # noqa: E402
from shared_fixtures import metrics_text, per_label, settled  # noqa: E402

DP = 2
#: seconds the API server may take to end once a node is lost (vLLM's engine-death handling)
EXIT_AFTER_LOSS_S = 180
CAPTURE = "served.npz"


def _solve_tables(tmp: Path) -> Path:
    """``semmoe solve --mode dp --ep 2`` on a synthetic trace of the tiny model's shape."""
    from vllm_semmoe.core.synthetic import synthetic_trace

    trace_path = tmp / "profile.npz"
    synthetic_trace(num_layers=4, num_experts=32, top_k=4, vocab_size=6144, num_requests=60, seed=1).save(trace_path)
    out = tmp / "tables"
    solved = subprocess.run([sys.executable, "-m", "vllm_semmoe.cli", "solve", "--trace", str(trace_path),
                             "--ep", str(DP), "--mode", "dp", "--out", str(out)],
                            capture_output=True, text=True, timeout=600, cwd=REPO)
    assert solved.returncode == 0, solved.stderr
    return out


def _node_command(tables: Path, capture: Path, rpc_port: int, *extra: str) -> list[str]:
    """``semmoe serve`` for one node of the DP 2 + EP deployment (the flags both nodes share)."""
    return [sys.executable, "-m", "vllm_semmoe.cli", "serve", str(tiny_moe_path()),
            "--tables", str(tables), "--mode", "dp", "--capture", str(capture),
            "--data-parallel-size", str(DP), "--data-parallel-size-local", "1",
            "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc_port),
            "--enable-expert-parallel", "--dtype", "float32", "--max-model-len", "256", "--seed", "0",
            "--enforce-eager", "--no-enable-prefix-caching", *extra]


def _start(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=REPO, start_new_session=True)


def _group_alive(pgid: int) -> bool:
    """Whether any process of the process group ``pgid`` is still running."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _live_counters(path: Path) -> dict:
    """The live counters file ``path`` once the engine is idle (:func:`settled`)."""
    def read():
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    return settled(read, f"{path}: live counters")


@contextlib.contextmanager
def _deployed(tmp: Path):
    """Node 0 (API server + DP rank 0) and node 1 (headless, DP rank 1), healthy; every process
    of both nodes is gone once the block ends."""
    tables = _solve_tables(tmp)
    port, rpc_port = free_port(), free_port()
    cpus = sorted(os.sched_getaffinity(0))
    nodes = {}
    for rank in range(DP):
        home = tmp / f"node{rank}"
        home.mkdir()
        extra = (("--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny") if rank == 0 else
                 ("--headless", "--data-parallel-start-rank", str(rank)))
        log = home / "serve.log"
        # one CPU of its own per node where there are several (vLLM would bind both to the first)
        env = _engine_env(home, VLLM_CPU_OMP_THREADS_BIND=str(cpus[rank % len(cpus)]))
        nodes[rank] = {"home": home, "log": log, "capture": home / CAPTURE,
                       "proc": _start(_node_command(tables, home / CAPTURE, rpc_port, *extra), env, log)}
    base = f"http://127.0.0.1:{port}"
    try:
        # three process trees start on shared cores; node 0's API server answers for both
        waited = wait_healthy(base, [nodes[r]["proc"] for r in range(DP)], 3 * SERVER_START_TIMEOUT_S,
                              [nodes[r]["log"] for r in range(DP)])
        print(f"two-node DP 2: healthy after {waited:.0f} s")
        yield {"base": base, "tables": tables, "nodes": nodes, "tmp": tmp}
    finally:
        for node in nodes.values():
            if node["proc"].poll() is None:
                node["proc"].send_signal(signal.SIGTERM)
        for node in nodes.values():
            try:
                node["proc"].wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
            _kill_group(node["proc"])


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """:func:`_deployed` for the module's main test."""
    with _deployed(tmp_path_factory.mktemp("multinode")) as deployed:
        yield deployed


def _wait_for_successes(base: str, served: dict[int, int], timeout: float = 30) -> None:
    """Until vLLM's per-engine ``vllm:request_success_total`` shows ``served`` (requests per DP
    rank): the API server counts a request's stats as its last output arrives."""
    want = {e: float(n) for e, n in served.items()}
    deadline = time.monotonic() + timeout
    while (got := per_label(metrics_text(base), "vllm:request_success_total", "engine")) != want:
        assert time.monotonic() < deadline, f"requests per engine on /metrics: {got}, served {want}"
        time.sleep(0.5)


def _complete(base: str, prompt, rank: int | None) -> tuple[int, object]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    return _post_json(f"{base}/v1/completions", body, headers, timeout=300)


def _prompt_for_rank(tables_dir: Path, rank: int, length: int) -> list[int]:
    """Token ids whose Sem-MoE votes prefer ``rank`` (an idle router sends them there)."""
    from vllm_semmoe.core.route import rank_dp_ranks
    from vllm_semmoe.core.tables import load_tables

    tables = load_tables(tables_dir)
    rows = tables.t2d_score.astype(np.float32).sum(axis=0).reshape(len(tables.t2d_tokens), DP, -1).sum(axis=2)
    others = np.delete(rows, rank, axis=1).max(axis=1)
    prompt = [int(tables.t2d_tokens[np.argmax(rows[:, rank] - others)])] * length
    assert rank_dp_ranks(tables, prompt, num_ranks=DP)[0].rank == rank
    return prompt


def test_two_node_dp_ep_serves_counts_captures_and_ends_with_a_lost_node(deployment) -> None:
    from vllm_semmoe.core.capture_store import compact_capture, load_trace, parts_dir, read_segment, segment_path

    base, nodes = deployment["base"], deployment["nodes"]
    # 1. every prompt pinned to each rank (the other node served through node 0's API server), at once
    jobs = [(i, rank) for i in range(len(PROMPTS)) for rank in range(DP)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        answers = list(pool.map(lambda job: _complete(base, PROMPTS[job[0]], job[1]), jobs))
    problems = [f"prompt {i} on rank {rank}: HTTP {status}: {str(body)[:300]}"
                for (i, rank), (status, body) in zip(jobs, answers) if status != 200]
    assert not problems, "\n".join(problems) + f"\n{_tail(nodes[0]['log'], 30)}"
    tokens = {job: body["choices"][0]["token_ids"] for job, (_, body) in zip(jobs, answers)}
    prompt_ids = _tokenize(PROMPTS)
    # every request's tokens as the engine that served it saw them: prompt, then its output fed back
    sequences = [tuple(prompt_ids[i] + tokens[i, rank][:-1]) for i, rank in jobs]
    for i in range(len(PROMPTS)):
        assert len(tokens[i, 0]) == MAX_TOKENS and tokens[i, 0] == tokens[i, 1], (PROMPTS[i], tokens[i, 0], tokens[i, 1])
    served = {rank: len(PROMPTS) for rank in range(DP)}
    _wait_for_successes(base, served)
    # each node loaded the tables, re-placed its experts (checked on its first forward) and runs
    # the sparse dispatch; the router runs in node 0's API server
    logs = {rank: node["log"].read_text(errors="replace") for rank, node in nodes.items()}
    for rank, text in logs.items():
        for line in ("semmoe placement (EP 2) installed on 4 MoE layers", "self-check passed",
                     "sparse EP MoE dispatch on 4 MoE layers"):
            assert line in text, f"node {rank}: no {line!r}\n{_tail(nodes[rank]['log'])}"
    assert "Sem-MoE DP routing over 2 ranks" in logs[0]

    # 2. node 0's router places requests on both ranks: a prompt whose experts live on rank r goes to r
    before = _prompt_tokens_per_engine(base)
    for rank in range(DP):
        prompt = _prompt_for_rank(deployment["tables"], rank, 17 + rank)
        status, body = _complete(base, prompt, None)
        assert status == 200, body
        served[rank] += 1
        sequences.append(tuple(prompt + body["choices"][0]["token_ids"][:-1]))
    deadline = time.monotonic() + 30  # the API server counts a request's stats as its outputs arrive
    while True:
        after = _prompt_tokens_per_engine(base)
        moved = {e: after.get(e, 0.0) - before.get(e, 0.0) for e in range(DP)}
        if moved == {e: float(17 + e) for e in range(DP)} or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert moved == {e: float(17 + e) for e in range(DP)}, moved
    _wait_for_successes(base, served)
    metrics = metrics_text(base)
    assert per_label(metrics, "vllm:semmoe_requests_total", "dp_rank") == {e: 1.0 for e in range(DP)}

    # 3. each node counts its own MoE bytes (its live counters, in its own directory); what one
    # rank dispatches to the other comes back as the other's combine, and both ran the same forwards
    live = {rank: _live_counters(Path(str(node["capture"]).replace(".npz", f".dp{rank}.npz.live.json")))
            for rank, node in nodes.items()}
    traffic = {rank: counters["moe_traffic"] for rank, counters in live.items()}
    for rank in range(DP):
        assert traffic[rank]["dispatch_bytes"] > 0 and traffic[rank]["tokens"] > 0, (rank, traffic[rank])
        assert traffic[rank]["combine_bytes"] == traffic[1 - rank]["dispatch_bytes"], traffic
    assert traffic[0]["layers_run"] == traffic[1]["layers_run"], traffic
    print("two-node MoE traffic per rank:", json.dumps(traffic))
    # node 0's /metrics (its two API servers, vLLM's default of one per DP rank of the deployment,
    # aggregate the engine process's counters in Prometheus multiprocess mode) carries the bytes and activations of node 0's engine only: node 1 has no
    # API server, its counts stay in its own files
    metrics = metrics_text(base)
    for op in ("dispatch", "combine", "metadata"):
        assert per_label(metrics, "vllm:semmoe_moe_bytes_total", "dp_rank", op=op) == \
            {0: float(traffic[0][f"{op}_bytes"])}, op
    for kind in ("local", "remote"):
        assert per_label(metrics, f"vllm:semmoe_{kind}_activations_total", "dp_rank") == \
            {0: float(traffic[0][f"{kind}_activations"])}, kind

    # 4. the capture: each node wrote its own part; copied together (as from two disks) they merge
    # into one trace holding every request, each with its prompt and generated tokens
    merged = deployment["tmp"] / "merged" / CAPTURE
    os.makedirs(parts_dir(merged))
    for rank, node in nodes.items():
        part = Path(segment_path(node["capture"], rank))
        assert sorted(os.listdir(parts_dir(node["capture"]))) == [part.name], f"node {rank}"
        header, steps, _ = read_segment(str(part))
        assert header["dp_rank"] == rank and header["dp_size"] == DP
        assert len({name for step in steps for name in step["names"]}) == served[rank], f"node {rank}"
        shutil.copy(part, parts_dir(merged))
    trace = compact_capture(merged)
    assert trace.num_requests == sum(served.values()) and load_trace(merged).num_requests == trace.num_requests
    captured = [tuple(trace.tokens[trace.offsets[r]:trace.offsets[r + 1]].tolist()) for r in range(trace.num_requests)]
    assert sorted(captured) == sorted(sequences)

    # 5. node 1 is lost (its whole process tree killed): the deployment ends as vLLM ends it
    node1 = nodes[1]["proc"]
    os.killpg(node1.pid, signal.SIGKILL)
    node1.wait(timeout=60)
    started = time.monotonic()
    try:  # the client gets an error (or the connection closes as the server ends), never an answer
        status, body = _complete(base, PROMPTS[0], None)
    except OSError as exc:
        status, body = None, exc
    print(f"request after node 1 was lost: HTTP {status} {str(body)[:200]!r} "
          f"after {time.monotonic() - started:.0f} s")
    assert status != 200, body
    code = _ended(nodes, started)
    print(f"node 0 exited with {code}; the deployment ended {time.monotonic() - started:.0f} s after node 1 was lost")
    assert code != 0, "node 0 reported success after losing a DP rank"
    # node 0's capture part is intact and readable: every request rank 0 served
    assert load_trace(nodes[0]["capture"]).num_requests == served[0]


def _ended(nodes: dict, started: float, then_stop: tuple = ()) -> int:
    """Node 0's exit status once the deployment has ended: its API server gone within
    :data:`EXIT_AFTER_LOSS_S` of ``started``, and no process of either node left. The nodes in
    ``then_stop`` get SIGTERM once node 0 has exited, as an orchestrator stops every node of a
    deployment."""
    node0 = nodes[0]["proc"]
    try:
        code = node0.wait(timeout=max(EXIT_AFTER_LOSS_S - (time.monotonic() - started), 1))
    except subprocess.TimeoutExpired:
        pytest.fail(f"node 0 still running {EXIT_AFTER_LOSS_S} s after the signal\n{_tail(nodes[0]['log'], 40)}")
    for rank in then_stop:
        if nodes[rank]["proc"].poll() is None:
            nodes[rank]["proc"].send_signal(signal.SIGTERM)
    # the other node notices on vLLM's own time (about a minute on a loaded machine): every
    # process of the deployment gone within the same bound from the signal
    deadline = max(started + EXIT_AFTER_LOSS_S, time.monotonic() + 5)
    for node in nodes.values():  # reaped: a zombie leader would keep its group "alive"
        try:
            node["proc"].wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            pass
    while any(_group_alive(node["proc"].pid) for node in nodes.values()) and time.monotonic() < deadline:
        time.sleep(1.0)
    for rank, node in nodes.items():
        assert not _group_alive(node["proc"].pid), f"processes of node {rank} outlived the deployment\n" \
            + _tail(node["log"], 40)
    return code


@pytest.mark.parametrize("signalled", [0, 1], ids=["api-server-node", "headless-node"])
def test_sigterm_to_either_node_ends_the_deployment_with_every_completed_request_captured(signalled, tmp_path):
    """SIGTERM (``kill``, as an orchestrator stops a node) to node 0 or to node 1 while requests
    are in flight on both ranks: the deployment ends (the API server exits, no process of either
    node is left; after node 0, node 1 is stopped too, see :func:`_ended`), and the two nodes'
    capture parts, brought together, hold every request a client saw complete."""
    from vllm_semmoe.core.capture_store import load_trace, parts_dir, segment_path

    with _deployed(tmp_path) as deployed:
        base, nodes = deployed["base"], deployed["nodes"]
        prompt_ids = _tokenize(PROMPTS)
        # every prompt on each rank, twice over, with long outputs: the signal finds work on both
        body = {"model": "tiny", "max_tokens": 64, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
        jobs = [(i, rank) for _ in range(2) for i in range(len(PROMPTS)) for rank in range(DP)]

        def send(job):
            i, rank = job
            try:
                return _post_json(f"{base}/v1/completions", {**body, "prompt": PROMPTS[i]},
                                  {"X-data-parallel-rank": str(rank)}, timeout=300)
            except Exception as exc:  # the connection closed or broke as the server ended: not completed
                return None, exc

        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            futures = [pool.submit(send, job) for job in jobs]
            done = concurrent.futures.wait(futures, timeout=300, return_when=concurrent.futures.FIRST_COMPLETED).done
            assert done, "no request completed"
            started = time.monotonic()
            nodes[signalled]["proc"].send_signal(signal.SIGTERM)
            answers = [future.result() for future in futures]
        code = _ended(nodes, started, then_stop=(1,) if signalled == 0 else ())
        print(f"SIGTERM to node {signalled}: node 0 exited with {code} after {time.monotonic() - started:.0f} s; "
              f"{sum(status == 200 for status, _ in answers)} of {len(jobs)} requests answered")
        # completed: every token asked for (an answer cut short by the shutdown is HTTP 200 too,
        # with finish_reason "abort", and may never have reached an engine)
        completed = [tuple(prompt_ids[i] + answer["choices"][0]["token_ids"][:-1])
                     for (i, _), (status, answer) in zip(jobs, answers)
                     if status == 200 and answer["choices"][0]["finish_reason"] == "length"]
        assert completed, "no request completed before the signal"
        merged = tmp_path / "merged" / CAPTURE
        os.makedirs(parts_dir(merged))
        for rank, node in nodes.items():
            shutil.copy(segment_path(node["capture"], rank), parts_dir(merged))
        trace = load_trace(merged)
        captured = {tuple(trace.tokens[trace.offsets[r]:trace.offsets[r + 1]].tolist())
                    for r in range(trace.num_requests)}
        missing = [seq for seq in completed if seq not in captured]
        assert not missing, f"{len(missing)} of {len(completed)} completed requests not in the merged capture"


def _tokenize(prompts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_moe_path())
    return [tokenizer.encode(p) for p in prompts]
