import json
import subprocess
import sys

import numpy as np
import pytest

from vllm_semmoe.cli import main
from vllm_semmoe.core.tables import load_tables


@pytest.fixture(scope="module")
def trace_file(small_trace, tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "small.npz"
    small_trace.save(path)
    return path


def test_analyze_prints_and_writes_json(trace_file, tmp_path, capsys):
    assert main(["analyze", str(trace_file), "--json", str(tmp_path / "a.json")]) == 0
    out = capsys.readouterr().out
    assert "F1 top-k" in out and "hottest non-top-k" in out
    report = json.loads((tmp_path / "a.json").read_text())
    assert len(report["layers"]) == 26 and len(report["layers"][0]["f1"]) == 3


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_solve_writes_loadable_tables(trace_file, tmp_path, ep):
    out = tmp_path / f"tables{ep}"
    assert main(["solve", "--trace", str(trace_file), "--ep", str(ep), "--method", "semmoe", "--out", str(out)]) == 0
    tables = load_tables(out, num_layers=26, num_experts=64, ep_size=ep)
    assert tables.placement.method == "semmoe"
    assert np.all(np.bincount(tables.placement.expert_device[0], minlength=ep) == 64 // ep)


def test_eval_all_methods_json(trace_file, tmp_path):
    out = tmp_path / "eval.json"
    args = ["eval", "--profile", str(trace_file), "--profile-frac", "0.3", "--ep", "8", "--mode", "dp",
            "--method", "all", "--json", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert set(result["methods"]) == {"vanilla", "round_robin", "eplb", "moetuner", "semmoe"}
    for row in result["methods"].values():
        assert {"lar", "lar_token", "oracle_lar", "a2a_ratio", "imbalance", "expert_imbalance", "solve_s"} <= set(row)


def test_user_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    np.savez(bad, tokens=np.array([0, 1], np.int32), experts=np.zeros((2, 1, 2), np.float64),
             offsets=np.array([0, 2]), vocab_size=np.int64(2))
    assert main(["analyze", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "semmoe: error:" in err and "experts: expected an integer dtype" in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        main(["eval", "--profile", str(bad), "--method", "magic"])
    assert "unknown method(s) magic" in capsys.readouterr().err


def test_console_script_is_installed():
    result = subprocess.run([sys.executable, "-m", "vllm_semmoe.cli", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and "vllm-semmoe" in result.stdout


def test_methods_come_from_the_policy_registry(trace_file, tmp_path, monkeypatch):
    """A policy added to the registry alone is accepted by ``solve`` and ``eval`` (no second list)."""
    from vllm_semmoe.core.policy import POLICIES
    from vllm_semmoe.core.policy.simple import RoundRobinPolicy

    class MinePolicy(RoundRobinPolicy):
        name = "mine"

    monkeypatch.setitem(POLICIES, "mine", MinePolicy)
    assert main(["solve", "--trace", str(trace_file), "--ep", "4", "--method", "mine", "--out", str(tmp_path / "t")]) == 0
    out = tmp_path / "e.json"
    assert main(["eval", "--profile", str(trace_file), "--ep", "4", "--method", "vanilla,mine", "--json", str(out)]) == 0
    assert set(json.loads(out.read_text())["methods"]) == {"vanilla", "mine"}


def test_progress_bars_off_a_terminal_write_a_start_and_an_end(capsys):
    """tqdm bars: a new message starts a new bar; off a terminal no per-step redraws flood logs."""
    from vllm_semmoe.cli.output import Progress

    progress = Progress("semmoe")
    for i in range(1, 201):
        progress(i, 200, "co-clustering")
    progress(3, 3, "tables")
    err = capsys.readouterr().err
    lines = err.replace("\r", "\n").split("\n")
    assert sum("co-clustering" in line for line in lines) == 2 and "200/200" in err and "3/3" in err
