"""`semmoe serve` on the tiny MoE: OpenAI completions and chat under a bounded concurrent load."""

import concurrent.futures
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from vllm_semmoe.assets import tiny_moe_path
from vllm_semmoe.cli import serve_command
from vllm_semmoe.core.policy import get_policy
from vllm_semmoe.core.synthetic import synthetic_trace
from vllm_semmoe.core.tables import build_tables
from vllm_semmoe.tools.bench_serve import engines_compiled, free_port, stop_server, wait_healthy
from vllm_semmoe.testing.processes import fresh_cache_root

CONCURRENT = 64


def _post(url: str, payload: dict, timeout: float = 120) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(payload).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read().decode(errors="replace")}


def test_serve_command_builds_additional_config():
    cmd = serve_command(["/m", "--port", "9", "--tables", "/t", "--mode=tp", "--additional-config", '{"x": 1}'])
    assert cmd[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", "/m"] and cmd[5:7] == ["--port", "9"]
    assert json.loads(cmd[cmd.index("--additional-config") + 1]) == {"x": 1, "semmoe": {"tables": "/t", "mode": "tp"}}
    with pytest.raises(SystemExit, match="usage"):
        serve_command(["--tables", "/t"])


def test_wait_healthy_watches_every_process_and_shows_their_logs(tmp_path):
    """``wait_healthy`` (every server start of bench-serve and the serving tests): returns once
    ``/health`` answers 200 while the processes run; fails naming the process that exited and
    showing every process's log; fails after the timeout; refuses processes without a log each."""
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    for rank, path in enumerate(logs):
        path.write_text(f"node {rank} says hello\n")
    waiting = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in logs]
    exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    exited.wait()
    httpd = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        up = f"http://127.0.0.1:{httpd.server_port}"
        assert 0 <= wait_healthy(up, waiting, 30, logs) < 30
        assert wait_healthy(up, waiting[0], 30, str(logs[0])) >= 0  # one process, one log
        down = f"http://127.0.0.1:{free_port()}"
        with pytest.raises(RuntimeError, match="process 1 of 2 exited with code 3") as failed:
            wait_healthy(down, [waiting[0], exited], 30, logs)
        assert "node 0 says hello" in str(failed.value) and "node 1 says hello" in str(failed.value)
        with pytest.raises(RuntimeError, match=r"not healthy after 1 s\n--- .*node0.log ---\nnode 0 says hello"):
            wait_healthy(down, waiting[0], 1, logs[0])
        with pytest.raises(ValueError, match="2 processes but 1 logs"):
            wait_healthy(up, waiting, 30, logs[0])
    finally:
        httpd.shutdown()
        for proc in waiting:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("serve")
    trace = synthetic_trace(num_layers=4, num_experts=32, top_k=4, vocab_size=6144, num_requests=60)
    build_tables(trace, get_policy("semmoe").solve(trace, 8)).save(work / "tables")
    port = free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CACHE_ROOT=fresh_cache_root(work / "cache"))
    log = open(work / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_semmoe.cli", "serve", tiny_moe_path(), "--host", "127.0.0.1",
         "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "512", "--enforce-eager",
         "--served-model-name", "tiny", "--tables", str(work / "tables")],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, 240, str(work / "server.log"))
        yield base, work
    finally:
        stop_server(proc)
        log.close()


def test_plugin_is_active(server):
    _, work = server
    assert "semmoe: semmoe placement (EP 8) installed on 4 MoE layers" in (work / "server.log").read_text()
    # bench-serve's `compiled` is read from the engine's own config line: this server is eager
    assert engines_compiled(str(work / "server.log")) is False
    (work / "no_engine.log").write_text("semmoe: nothing started\n")
    with pytest.raises(RuntimeError, match="no vLLM engine config line"):
        engines_compiled(str(work / "no_engine.log"))


def test_completions_and_chat_under_concurrent_load(server):
    base, _ = server
    def completion(i):
        return _post(base + "/v1/completions",
                     {"model": "tiny", "prompt": f"Question {i}: how do I sort a list in Python?",
                      "max_tokens": 8, "temperature": 0})

    def chat(i):
        return _post(base + "/v1/chat/completions",
                     {"model": "tiny", "messages": [{"role": "user", "content": f"Say hello to user {i}."}],
                      "max_tokens": 8, "temperature": 0})

    with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
        futures = [pool.submit(completion if i % 2 else chat, i) for i in range(CONCURRENT)]
        results = [f.result(timeout=300) for f in futures]
    failed = [(status, body) for status, body in results if status != 200]
    assert not failed, failed[:3]
    for _status, body in results:
        choice = body["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        assert isinstance(text, str) and body["usage"]["completion_tokens"] >= 1
