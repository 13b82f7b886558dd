"""`semmoe report`: figures from the commands' own JSON, checked in a real headless Chromium."""

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from vllm_semmoe.cli import main
from vllm_semmoe.report import ReportError, build_report

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--virtual-time-budget=10000"]
METHODS = "vanilla,eplb,semmoe"


@pytest.fixture(scope="module")
def outputs(small_trace, tmp_path_factory):
    """What `bash scripts/eval_deepseek.sh` writes, on 120 real requests (analyze, eval TP and
    DP, a solved tables directory, the cost model), then `semmoe report` over it."""
    out = tmp_path_factory.mktemp("eval_out")
    trace = out / "trace.npz"
    small_trace.select_requests(np.arange(120)).save(trace)
    assert main(["analyze", str(trace), "--json", str(out / "analyze.json")]) == 0
    for mode in ("tp", "dp"):
        assert main(["eval", "--profile", str(trace), "--profile-frac", "0.3", "--ep", "8", "--mode", mode,
                     "--method", METHODS, "--json", str(out / f"eval_{mode}.json")]) == 0
    assert main(["solve", "--trace", str(trace), "--profile-frac", "0.3", "--ep", "8",
                 "--out", str(out / "tables_semmoe"), "--json", str(out / "solve.json")]) == 0
    assert main(["cost", "--trace", str(trace), "--ep", "8", "--method", "vanilla,semmoe", "--max-batches", "8",
                 "--json", str(out / "cost.json")]) == 0
    report = out / "report"
    assert main(["report", "--from", str(out), "--out", str(report), "--json", str(out / "report.json")]) == 0
    return out, report, json.loads((out / "report.json").read_text())


def test_eval_json_has_per_layer_lar_and_dp_load_curve(outputs):
    out, _, _ = outputs
    for mode in ("tp", "dp"):
        rows = json.loads((out / f"eval_{mode}.json").read_text())["methods"]
        for row in rows.values():
            assert len(row["lar_per_layer"]) == 26
            assert np.mean(row["lar_per_layer"]) == pytest.approx(row["lar"])  # every layer has T*K activations
    curve = json.loads((out / "eval_dp.json").read_text())["methods"]["semmoe"]["rank_load_curve"]
    tokens = np.asarray(curve["tokens"])
    assert tokens.shape[1] == 8 and np.all(np.diff(tokens, axis=0) >= 0) and curve["requests"][-1] == 84


def test_report_draws_every_figure_it_has_inputs_for(outputs):
    _, report, result = outputs
    files = {f["file"] for f in result["figures"]}
    assert files == {"lar_per_layer_eval_tp.png", "lar_per_layer_eval_dp.png", "affinity.png",
                     "placement_tables_semmoe.png", "dp_rank_load_eval_dp.png", "cost_model_cost.png"}
    for name in files:
        assert (report / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (report / "index.html").read_text()
    assert all(f'src="{name}"' in page for name in files)
    assert result["skipped"] == ["no `semmoe bench-ep --json` output"] and "Not drawn: no `semmoe bench-ep" in page
    assert "http://" not in page and "https://" not in page  # self-contained: nothing fetched


def test_report_without_inputs_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(ReportError, match="no JSON written by semmoe"):
        build_report(str(tmp_path), str(tmp_path / "r"))
    assert main(["report", "--from", str(tmp_path / "missing"), "--out", str(tmp_path / "r")]) == 2
    assert "not a directory" in capsys.readouterr().err


def _chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser")


def dump_dom(page, profile_dir) -> str:
    """The page's DOM after load, as headless Chromium renders it (the page's figure check has run)."""
    result = subprocess.run([_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile_dir}", "--dump-dom",
                             page.as_uri()], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.mark.skipif(_chromium() is None, reason="chromium is not installed (scripts/setup_env.sh installs Debian's "
                                                "chromium with apt-get where it runs as root; here it could not)")
def test_headless_chromium_loads_every_figure(outputs, tmp_path):
    _, report, result = outputs
    n = len(result["figures"])
    dom = dump_dom(report / "index.html", tmp_path / "profile")
    assert f'data-loaded="{n}" data-total="{n}">all {n} figures loaded' in dom
    # the check can fail: a copy of the page without one PNG beside it
    broken = tmp_path / "broken"
    shutil.copytree(report, broken)
    os.remove(broken / result["figures"][0]["file"])
    dom = dump_dom(broken / "index.html", tmp_path / "profile2")
    assert f'data-loaded="{n - 1}" data-total="{n}">1 of {n} figures did not load' in dom


def test_report_says_what_it_could_not_draw(outputs, tmp_path):
    """An eval JSON from before per-layer LAR: the table is kept, the figure is skipped with the reason."""
    out, _, _ = outputs
    data = json.loads((out / "eval_tp.json").read_text())
    for row in data["methods"].values():
        del row["lar_per_layer"]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "old_eval.json").write_text(json.dumps(data))
    result = build_report(str(tmp_path / "in"), str(tmp_path / "r"))
    assert result["figures"] == []
    assert "old_eval.json: no lar_per_layer (written by an older semmoe eval)" in result["skipped"]
    page = (tmp_path / "r" / "index.html").read_text()
    assert "<th>semmoe</th>" in page and "Not drawn: no `semmoe analyze --json` output" in page


def test_bench_serve_json_with_several_policies_is_drawn(tmp_path):
    from vllm_semmoe.report import collect_inputs, figure_bench_serve

    run = lambda policy, b: {"policy": policy, "dp": 2, "rank_prompt_tokens": [10, 12],  # noqa: E731
                             "rank_imbalance": 1.09, "live_lar": 0.5, "moe_bytes_per_token": b}
    (tmp_path / "bench_serve.json").write_text(json.dumps(
        {"runs": {"vllm": run("vllm", 2689.0), "semmoe": run("semmoe", 1933.0)}, "outputs_identical": False}))
    found = collect_inputs(str(tmp_path))["bench_serve"]
    assert [label for label, _ in found] == ["bench_serve.json: vllm", "bench_serve.json: semmoe"]
    legend = [t.get_text() for t in figure_bench_serve(found).axes[0].get_legend().get_texts()]
    assert legend[1].endswith("MoE 1933 B/token)"), legend
