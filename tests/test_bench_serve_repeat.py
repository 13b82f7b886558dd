"""``semmoe bench-serve``'s own logic, no engine: the interleaved run order and the median /
spread of each policy's repetitions, and the command around them with its runs recorded. The
command's real servers are checked in ``test_dp_routing.py`` (DP 2) and
``test_cpu_parallel.py`` (TP 2)."""

import json
import statistics

import pytest

from vllm_semmoe.cli import main
from vllm_semmoe.tools.bench_serve import REPEAT_KEYS, aggregate_repeats, repeat_schedule, run_problems


def _run(policy: str, ttft_p50: float, ttft_p99: float, tpot: float, throughput: float, moe_bytes: float | None,
         *, failed: int = 0, failures=(), exit_status: int = 0, digest: str = "5f1c0a9e33d2b7c4") -> dict:
    """One repetition as :func:`run_bench_serve` returns it (DP 2, 40 prompts of 8 tokens)."""
    return {"policy": policy, "dp": 2, "tp": 1, "ok": 40 - failed, "failed": failed,
            "moe_bytes_per_token": moe_bytes,
            "moe_bytes": {"dispatch_bytes": 812544, "combine_bytes": 812544},
            "plugin_failures": list(failures), "tokens": 5120, "live_lar": 0.61,
            "rank_prompt_tokens": [2480, 2320], "rank_imbalance": 1.033, "ttft_p50_s": ttft_p50,
            "ttft_p99_s": ttft_p99, "tpot_s": tpot, "completion_tokens": 320, "throughput_tok_s": throughput,
            "output_digest": digest, "outputs": ["text"] * 40, "wall_s": 320 / throughput, "num_prompts": 40,
            "concurrency": 8, "max_tokens": 8, "errors": ["HTTP 500: boom"] if failed else [],
            "metrics": {"requests_total": 40}, "server_exit_status": exit_status, "dtype": "bfloat16",
            "redundant": 0, "compiled": True}


def test_repetitions_rotate_the_policy_order():
    assert repeat_schedule(["vllm", "semmoe"], 3) == [(0, "vllm"), (0, "semmoe"), (1, "semmoe"), (1, "vllm"),
                                                      (2, "vllm"), (2, "semmoe")]
    order = repeat_schedule(["vllm", "sparse", "semmoe"], 3)
    assert [name for _, name in order] == ["vllm", "sparse", "semmoe", "sparse", "semmoe", "vllm",
                                           "semmoe", "vllm", "sparse"]
    # every policy takes every place in the order once over as many repetitions as policies
    for policy in ("vllm", "sparse", "semmoe"):
        assert sorted(order[3 * k:3 * k + 3].index((k, policy)) for k in range(3)) == [0, 1, 2]
    assert repeat_schedule(["vllm", "semmoe"], 1) == [(0, "vllm"), (0, "semmoe")]


def test_median_and_spread_of_the_repetitions(tmp_path):
    runs = [_run("semmoe", 0.212, 0.874, 0.0411, 95.2, 5821.3),
            _run("semmoe", 0.187, 0.731, 0.0398, 101.7, 5819.9),
            _run("semmoe", 0.240, 1.102, 0.0455, 88.4, 5823.6)]
    out = aggregate_repeats(runs)
    for key in REPEAT_KEYS:
        values = [run[key] for run in runs]
        assert out[key] == pytest.approx(statistics.median(values))
        assert out["spread"][key] == pytest.approx({"median": statistics.median(values), "min": min(values),
                                                    "max": max(values), "sd": statistics.stdev(values)})
    assert out["repeat"] == 3 and out["repeats"] == runs
    assert out["ok"] == 120 and out["failed"] == 0 and run_problems(out) == []
    # the keys readers use keep their place and kind, and the result stays JSON
    assert set(runs[0]) < set(out) and out["policy"] == "semmoe" and out["rank_prompt_tokens"] == [2480, 2320]
    assert json.loads(json.dumps(out))["ttft_p99_s"] == pytest.approx(0.874)
    # `semmoe report` reads the aggregated run as it reads a single one
    from vllm_semmoe.evaluation.report import collect_inputs

    (tmp_path / "bench_serve.json").write_text(json.dumps({"runs": {"semmoe": out}, "outputs_identical": True}))
    assert collect_inputs(str(tmp_path))["bench_serve"] == [("bench_serve.json: semmoe", json.loads(json.dumps(out)))]


def test_even_number_of_repetitions_takes_the_middle_mean():
    runs = [_run("vllm", 0.20, 0.50, 0.040, 100.0, 9000.0), _run("vllm", 0.30, 0.70, 0.050, 80.0, 9000.0)]
    out = aggregate_repeats(runs)
    assert out["ttft_p99_s"] == pytest.approx(0.60) and out["throughput_tok_s"] == pytest.approx(90.0)
    assert out["spread"]["moe_bytes_per_token"]["sd"] == 0.0


def test_one_repetition_is_the_run_itself():
    run = _run("vllm", 0.20, 0.50, 0.040, 100.0, 9000.0)
    assert aggregate_repeats([run]) is run and "repeats" not in run and "spread" not in run


def test_a_failing_repetition_fails_the_policy():
    failure = {"rank": 1, "kind": "unmetered", "reason": "MoE layer 2 ran outside the meter"}
    runs = [_run("semmoe", 0.2, 0.8, 0.04, 95.0, 5821.3),
            _run("semmoe", 0.2, 0.9, 0.04, 90.0, None, failed=2, failures=[failure], exit_status=3)]
    out = aggregate_repeats(runs)
    assert out["moe_bytes_per_token"] is None and out["spread"]["moe_bytes_per_token"] is None
    assert out["ok"] == 78 and out["failed"] == 2 and out["server_exit_status"] == 3
    problems = run_problems(out)
    assert problems[0] == "2 requests failed"
    assert "unmetered (rank 1) (repetition 2): MoE layer 2 ran outside the meter" in problems
    assert "the server exited with status 3" in problems


def test_repeat_below_one_is_the_sub_commands_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench-serve", "--repeat", "0"])
    assert exit_info.value.code == 2
    assert "--repeat" in capsys.readouterr().err


def test_nodes_are_launched_as_vllm_launches_them(monkeypatch):
    """``bench-serve --nodes``: node 0 runs the API server and the first DP ranks, every other
    node ``--headless`` from its first rank on, all at node 0's DP address, each bound to CPUs of
    its own."""
    from vllm_semmoe.tools import bench_serve

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(bench_serve, "_has_cuda", lambda: False)
    monkeypatch.setattr(bench_serve.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    shared, api = ["semmoe", "serve", "M", "--data-parallel-size", "4"], ["--host", "127.0.0.1", "--port", "8000"]
    nodes = bench_serve.node_commands(shared, api, dp=4, nodes=2, rpc_port=29555)
    assert len(nodes) == 2
    (node0, env0), (node1, env1) = nodes
    for command in (node0, node1):
        assert command[:len(shared)] == shared
        text = " ".join(command)
        assert ("--data-parallel-size-local 2 --data-parallel-address 127.0.0.1 "
                "--data-parallel-rpc-port 29555") in text
    assert node0[-len(api):] == api and "--headless" not in node0
    assert node1[-3:] == ["--headless", "--data-parallel-start-rank", "2"] and "--port" not in node1
    assert env0 == {"VLLM_CPU_OMP_THREADS_BIND": "0|1"} and env1 == {"VLLM_CPU_OMP_THREADS_BIND": "2|3"}
    # fewer CPUs than ranks: each rank one CPU, shared round the nodes
    monkeypatch.setattr(bench_serve.os, "sched_getaffinity", lambda pid: {0, 1})
    envs = [env for _, env in bench_serve.node_commands(shared, api, dp=2, nodes=2, rpc_port=1)]
    assert envs == [{"VLLM_CPU_OMP_THREADS_BIND": "0"}, {"VLLM_CPU_OMP_THREADS_BIND": "1"}]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")  # the user's binding is theirs
    assert [env for _, env in bench_serve.node_commands(shared, api, dp=2, nodes=2, rpc_port=1)] == [{}, {}]
    with pytest.raises(ValueError, match="3 nodes cannot hold DP 4"):
        bench_serve.run_bench_serve("M", "D", "W", dp=4, nodes=3)


@pytest.mark.parametrize("argv, message", [
    (["--dp", "3", "--nodes", "2"], "--nodes 2 spreads DP ranks over nodes"),
    (["--tp", "2", "--nodes", "2"], "--nodes 2 spreads DP ranks over nodes"),
])
def test_nodes_that_cannot_hold_the_ranks_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench-serve", *argv])
    assert message in str(exit_info.value)


def test_each_dp_router_setting_is_a_run_of_its_own(monkeypatch, capsys):
    """``--dp-slack 1,4`` (``--dp-balance 0,32``): the DP-routing policy runs once per guard (per
    balance knob, per pair of both), beside the other policies (which take neither), interleaved
    as repetitions are; each row is named by its settings."""
    from vllm_semmoe.tools import bench_serve

    calls = []

    def fake(model, dataset, workdir, **kwargs):
        calls.append((kwargs["policy"], kwargs["dp_balance"], kwargs["dp_slack"], kwargs["skip"]))
        return _run(kwargs["policy"], 0.2, 0.5 + (kwargs["dp_slack"] or 0), 0.04, 100.0, 5000.0)

    monkeypatch.setattr(bench_serve, "run_bench_serve", fake)
    assert main(["bench-serve", "--model", "M", "--policy", "vllm,semmoe", "--dp-slack", "1,4",
                 "--skip", "3500", "--num-prompts", "40"]) == 0
    assert calls == [("vllm", None, None, 3500), ("semmoe", None, 1.0, 3500), ("semmoe", None, 4.0, 3500)]
    printed = capsys.readouterr().out
    assert "\nsemmoe slack=1 " in printed and "\nsemmoe slack=4 " in printed and "\nvllm " in printed
    calls.clear()
    assert main(["bench-serve", "--model", "M", "--policy", "sparse,semmoe", "--dp-balance", "0,32",
                 "--dp-slack", "2", "--num-prompts", "40"]) == 0
    assert calls == [("sparse", None, None, 3000), ("semmoe", 0.0, 2.0, 3000), ("semmoe", 32.0, 2.0, 3000)]
    printed = capsys.readouterr().out
    assert "\nsemmoe balance=0 slack=2 " in printed and "\nsemmoe balance=32 slack=2 " in printed
    for flag in ("--dp-slack", "--dp-balance"):
        with pytest.raises(SystemExit):
            main(["bench-serve", flag, "-1"])


def test_the_command_interleaves_the_repetitions_and_reports_their_medians(monkeypatch, capsys, tmp_path):
    """``semmoe bench-serve --policy vllm,sparse --repeat 2``: four runs in the order vllm,
    sparse, sparse, vllm, each carrying its repetition and place in the order; each policy's row
    and JSON keys are the medians of its two repetitions, every repetition kept under
    ``repeats``; the outputs are called identical only when every repetition's are. (The real
    servers behind one run per policy: ``test_dp_routing.py``'s DP 2 runs.)"""
    from vllm_semmoe.tools import bench_serve

    calls, digests = [], iter(["d0", "d0", "d0", "d0", "d0", "d0", "d0", "other"])

    def fake(model, dataset, workdir, **kwargs):
        n = len(calls)
        calls.append(kwargs["policy"])
        return _run(kwargs["policy"], 0.2 + n / 100, 0.5 + n / 10, 0.04 + n / 1000, 100.0 - n,
                    (9000.0 if kwargs["policy"] == "vllm" else 6000.0) + n, digest=next(digests))

    monkeypatch.setattr(bench_serve, "run_bench_serve", fake)
    out = tmp_path / "bench.json"
    assert main(["bench-serve", "--model", "M", "--policy", "vllm,sparse", "--repeat", "2",
                 "--json", str(out)]) == 0
    assert calls == ["vllm", "sparse", "sparse", "vllm"]
    printed = capsys.readouterr().out
    runs = json.loads(out.read_text())["runs"]
    assert [[(r["repetition"], r["order"]) for r in runs[p]["repeats"]] for p in ("vllm", "sparse")] == \
        [[(0, 0), (1, 3)], [(0, 1), (1, 2)]]
    for policy, run in runs.items():
        assert run["repeat"] == 2 and run["ok"] == 80 and run["failed"] == 0
        for key in REPEAT_KEYS:
            values = [r[key] for r in run["repeats"]]
            assert run[key] == pytest.approx(statistics.median(values)), (policy, key)
            assert run["spread"][key]["min"] == min(values) and run["spread"][key]["max"] == max(values)
        assert all(r["policy"] == policy for r in run["repeats"])
    assert "median of 2 interleaved repetitions" in printed
    assert json.loads(out.read_text())["outputs_identical"]
    assert "outputs identical across policies and repetitions" in printed
    # one repetition's text differs: the verdict says so
    calls.clear()
    assert main(["bench-serve", "--model", "M", "--policy", "vllm,sparse", "--repeat", "2"]) == 0
    assert "OUTPUTS DIFFER across policies or repetitions" in capsys.readouterr().out
