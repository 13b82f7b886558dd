"""``semmoe bench-serve --repeat N``: the interleaved run order and the median / spread of each
policy's repetitions (pure functions, no engine). The command's real interleaved runs are
checked on the DP 2 servers of ``test_dp_routing.py`` (``test_bench_serve_repeat_interleaves_real_runs``)."""

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
