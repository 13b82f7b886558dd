"""The plugin under vLLM's default compilation (no ``enforce_eager``): on CPU, vLLM traces the
model once with Dynamo and compiles it with Inductor, so Python hooks inside the model run
only at trace time. Every mode must still do its work on every step:

Reference: plain vLLM (plugin installed, not configured), TP 1, compiled.

* TP 1, routing capture: every MoE layer's routing of every step is captured;
* TP 2 + EP, mode ``tp``: the token shuffle runs (fused into the collectives) in every MoE
  layer of every step, and greedy tokens equal TP 1's;
* ``semmoe serve`` DP 2 + EP, mode ``dp``: Sem-MoE routes the requests, every answer equals TP 1's.

Engines run in subprocesses with fresh compile caches (a minute or more each on a 2-core
machine: Dynamo trace plus Inductor compile of the tiny model); the two TP 2 engines in one pair
of processes, one TP rank each (vLLM's external launcher), each engine compiling its own graph.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_semmoe.assets import tiny_moe_path
from vllm_semmoe.tools.bench_serve import free_port, wait_healthy

pytest.importorskip("vllm")

from test_cpu_parallel import (  # noqa: E402  (shared engine helpers)
    MAX_TOKENS, PROMPTS, REPO, SERVER_START_TIMEOUT_S, _engine_env, _kill_group, _launched,
    _post_json, _run_bounded, _tail, clear_outputs)
from test_route import check_route_header_steers_requests  # noqa: E402
from shared_fixtures import metrics_text, per_label, settled  # noqa: E402

ENGINE_TIMEOUT_S = 480

COMPILED_SCRIPT = r"""
import json, sys

def main():
    cfg = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm_semmoe.vllm_adapter.recording import flush_capture
    llm = LLM(model=cfg["model"], dtype="bfloat16", max_model_len=256, seed=0,
              distributed_executor_backend="uni", enable_prefix_caching=False,
              additional_config={"semmoe": cfg["semmoe"]} if cfg["semmoe"] else {})
    assert not llm.llm_engine.vllm_config.model_config.enforce_eager
    mode = llm.llm_engine.vllm_config.compilation_config.mode
    outs = llm.generate(cfg["prompts"], SamplingParams(temperature=0.0, max_tokens=cfg["max_tokens"],
                                                       ignore_eos=True, logprobs=2), use_tqdm=False)
    result = {"outputs": [{"token_ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text,
                           "margins": [(lambda v: v[0] - v[1] if len(v) > 1 else float("inf"))(
                               sorted((x.logprob for x in step.values()), reverse=True))
                               for step in o.outputs[0].logprobs]} for o in outs],
              "summaries": llm.collective_rpc(flush_capture) if cfg["semmoe"] else [],
              "compilation_mode": int(mode)}
    with open(cfg["out"], "w") as f:
        json.dump(result, f, default=float)

if __name__ == "__main__":
    main()
"""


def _run_compiled(tmp: Path, name: str, *, semmoe: dict | None) -> dict:
    """TP 1, compiled, engine and worker in one subprocess (:data:`COMPILED_SCRIPT`)."""
    out = tmp / f"{name}.json"
    cfg = {"model": str(tiny_moe_path()), "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "out": str(out),
           "semmoe": semmoe}
    started = time.monotonic()
    _run_bounded([sys.executable, "-c", COMPILED_SCRIPT, json.dumps(cfg)],
                 _engine_env(tmp, VLLM_ENABLE_V1_MULTIPROCESSING="0"),
                 tmp / f"{name}.log", ENGINE_TIMEOUT_S)
    print(f"{name}: engine run {time.monotonic() - started:.0f} s")
    result = json.loads(out.read_text())
    assert result["compilation_mode"] > 0, "the engine did not compile the model"
    return result


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, list[int]]:
    """Greedy tokens of plain vLLM (plugin not configured), TP 1, compiled, for the prompts whose
    greedy path has no near-tie (bf16 logits: another batch shape or reduction order may break a
    tie the other way; :func:`test_cpu_parallel.clear_outputs`), by prompt index."""
    result = _run_compiled(tmp_path_factory.mktemp("reference"), "tp1_plain", semmoe=None)
    return {i: o["token_ids"] for i, o in clear_outputs(result["outputs"]).items()}


def _assert_same_tokens(outputs: list[dict], reference: dict[int, list[int]], what: str) -> None:
    diffs = [f"prompt {i} ({PROMPTS[i][:30]!r}): want {want}, got {outputs[i]['token_ids']}"
             for i, want in reference.items() if outputs[i]["token_ids"] != want]
    assert not diffs, f"{what} differs from plain TP 1 (compiled) greedy output:\n" + "\n".join(diffs)


def _tables(tmp_path_factory, mode: str, redundant: int = 0) -> Path:
    """Sem-MoE tables for EP 2, solved for ``mode`` (with ``redundant`` replica slots per rank),
    from a synthetic trace of the tiny model's shape."""
    from vllm_semmoe.core.policy import get_policy
    from vllm_semmoe.core.synthetic import synthetic_trace
    from vllm_semmoe.core.tables import build_tables

    trace = synthetic_trace(num_layers=4, num_experts=32, top_k=4, vocab_size=6144, num_requests=40)
    placement = get_policy("semmoe").solve(trace, 2, mode=mode, redundant=redundant)
    path = tmp_path_factory.mktemp("tables") / f"{mode}_r{redundant}"
    build_tables(trace, placement, mode=mode).save(path)
    return path


@pytest.fixture(scope="module")
def tp2_shuffled(tmp_path_factory) -> dict[int, dict]:
    """TP 2 + EP, mode ``tp``, compiled (vLLM's default; prefix caching off), without and with one
    replica slot per rank (by ``R``): both engines served by two processes, one TP rank each,
    under vLLM's external launcher (:func:`test_cpu_parallel._launched`, fresh compile caches)."""
    tmp = tmp_path_factory.mktemp("tp2_shuffled")
    runs = _launched(tmp, 2, {f"r{R}": {"semmoe": {"tables": str(_tables(tmp_path_factory, "tp", R)), "mode": "tp",
                                                   "capture": str(tmp / f"r{R}_served.npz")},
                                        "engine": {"enable_prefix_caching": False}}
                              for R in (0, 1)})
    return {int(name[1:]): result for name, result in runs.items()}


@pytest.fixture(scope="module")
def dp_tables(tmp_path_factory) -> Path:
    return _tables(tmp_path_factory, "dp")  # the engine refuses tables solved for another mode


def test_compiled_capture_tp1(reference: dict, tmp_path: Path) -> None:
    """TP 1, compiled, capture on: tokens equal the eager reference, and every step of every
    request is in the trace with routing for all 4 MoE layers."""
    from vllm_semmoe.core.capture_store import load_trace

    capture = tmp_path / "capture.npz"
    result = _run_compiled(tmp_path, "tp1_capture", semmoe={"capture": str(capture)})
    _assert_same_tokens(result["outputs"], reference, "TP 1 compiled with capture")
    trace = load_trace(capture)
    assert trace.num_requests == len(PROMPTS) and trace.num_layers == 4
    # each request: its prompt plus every generated token fed back (the last one is not)
    decode = trace.is_decode.reshape(-1)
    assert decode.sum() == len(PROMPTS) * (MAX_TOKENS - 1)
    for r, out in enumerate(result["outputs"]):
        rows = slice(trace.offsets[r], trace.offsets[r + 1])
        assert list(trace.tokens[rows][trace.is_decode[rows]]) == out["token_ids"][:-1]
    assert result["summaries"][0]["steps"] >= MAX_TOKENS


@pytest.mark.parametrize("R", [0, 1], ids=["r0", "r1"])
def test_compiled_tp2_shuffle(reference: dict, tp2_shuffled: dict, R: int) -> None:
    """TP 2 + EP, mode tp, compiled: greedy tokens equal TP 1's, and on both ranks the fused
    shuffle ran in every MoE layer of every real step (4 layers x steps); without and with one
    replica slot per rank."""
    result = tp2_shuffled[R]
    assert not result["enforce_eager"] and result["compilation_mode"] > 0, "the engine did not compile the model"
    _assert_same_tokens(result["outputs"], reference, "TP 2 + EP, mode tp, compiled")
    summaries = result["summaries"]
    assert len(summaries) == 2
    for summary in summaries:
        counters, steps = summary["tp_shuffle"], summary["steps"]
        assert steps >= MAX_TOKENS, summary  # one step per generated token (prefill may take more)
        assert counters["layers_run"] == counters["fused_layers_run"] == 4 * steps, counters
        assert counters["local_activations"] + counters["remote_activations"] > 0
        share = (counters["schedule_s"] + counters["host_sync_s"]) / counters["moe_layer_s"]
        print(f"TP shuffle rank {summaries.index(summary)}: scheduling {counters['schedule_s'] * 1e3:.1f} ms + host "
              f"syncs {counters['host_sync_s'] * 1e3:.1f} ms of {counters['moe_layer_s'] * 1e3:.1f} ms in the shuffled "
              f"decoder layers ({share:.1%})")


def check_two_engines_on_metrics(base: str) -> None:
    """Both DP ranks' MoE counters on ``/metrics``, through the API servers vLLM starts by default
    (one per DP rank, Prometheus multiprocess mode), once the engines are idle (:func:`settled`):
    each rank dispatched rows, and what one rank dispatches comes back to it as the other's
    combine (both ran the same forwards)."""
    def read() -> dict:
        text = metrics_text(base)
        counts = {op: per_label(text, "vllm:semmoe_moe_bytes_total", "dp_rank", op=op) for op in ("dispatch", "combine")}
        counts["activations"] = {kind: per_label(text, f"vllm:semmoe_{kind}_activations_total", "dp_rank")
                                 for kind in ("local", "remote")}
        return counts

    now = settled(read, f"{base}/metrics MoE counters", timeout=30)
    dispatch, combine = now["dispatch"], now["combine"]
    assert sorted(dispatch) == sorted(combine) == [0, 1], now
    assert all(dispatch[rank] > 0 and combine[rank] == dispatch[1 - rank] for rank in (0, 1)), now
    assert all(sorted(counts) == [0, 1] for counts in now["activations"].values()), now
    assert all(now["activations"]["remote"][rank] > 0 for rank in (0, 1)), now


def test_compiled_serve_dp2_dp_mode(reference: dict, dp_tables: Path, tmp_path: Path) -> None:
    """``semmoe serve`` (= ``vllm serve`` with the plugin settings) DP 2 + EP, mode dp, compiled:
    the README's DP serving command as written (no --enforce-eager). The server starts, Sem-MoE
    chooses the ranks, every completion is HTTP 200 and equals TP 1's greedy output, and both
    engines' MoE counters reach ``/metrics`` (:func:`check_two_engines_on_metrics`)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # the README's command: semmoe serve MODEL --data-parallel-size 2 --enable-expert-parallel --tables T --mode dp
    cmd = [sys.executable, "-m", "vllm_semmoe.cli", "serve", str(tiny_moe_path()),
           "--data-parallel-size", "2", "--enable-expert-parallel", "--tables", str(dp_tables), "--mode", "dp",
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny",
           "--data-parallel-address", "127.0.0.1", "--dtype", "bfloat16", "--max-model-len", "256", "--seed", "0"]
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=_engine_env(tmp_path), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=REPO, start_new_session=True)
    try:
        # two engines compile on 2 shared cores
        waited = wait_healthy(base, proc, 3 * SERVER_START_TIMEOUT_S, log)
        print(f"serve DP 2 compiled: healthy after {waited:.0f} s")
        problems = []
        for i, prompt in enumerate(PROMPTS):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                    "ignore_eos": True, "return_token_ids": True}
            status, answer = _post_json(f"{base}/v1/completions", body, {}, timeout=180)
            if status != 200:
                problems.append(f"prompt {i}: HTTP {status}: {str(answer)[:400]}")
            elif i in reference and answer["choices"][0].get("token_ids") != reference[i]:
                problems.append(f"prompt {i}: want {reference[i]}, got {answer['choices'][0].get('token_ids')}")
        assert not problems, "\n".join(problems) + f"\n{_tail(log, 30)}"
        # an outside router: `semmoe route`'s top rank, sent as vLLM's X-data-parallel-rank header
        check_route_header_steers_requests(base, dp_tables, "tiny")
        check_two_engines_on_metrics(base)
        text = log.read_text(errors="replace")
        assert "Sem-MoE DP routing over 2 ranks" in text
        assert "enforce_eager=False" in text and "DYNAMO_TRACE_ONCE" in text
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        _kill_group(proc)
