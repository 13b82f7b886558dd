"""`semmoe report`: figures from the commands' own JSON, checked in a real headless Chromium."""

import json
import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from vllm_semmoe.cli import main
from vllm_semmoe.evaluation.report import ReportError, build_report

PAGE_WIDTH = 1280  # px: the narrowest desktop window the page must fit without scrolling sideways
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--virtual-time-budget=10000",
                  f"--window-size={PAGE_WIDTH},800"]
#: Added to a copy of the page: after load, records how wide the document is and how many tables
#: scroll inside their own box.
MEASURE = """<script>window.addEventListener("load", function () {
  var boxes = Array.prototype.slice.call(document.querySelectorAll("table")).map(function (t) { return t.parentNode; });
  document.body.dataset.scrollWidth = document.documentElement.scrollWidth;
  document.body.dataset.scrollingTables = boxes.filter(function (b) { return b.scrollWidth > b.clientWidth; }).length;
  document.body.dataset.tables = boxes.length;
});</script>"""
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
    assert main(["cost", "--trace", str(trace), "--ep", "8", "--grid", "--layers", "2", "--max-batches", "2",
                 "--hardware", "deepep-normal-2node,pplx-1node", "--json", str(out / "cost_grid.json")]) == 0
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
    # evaluated: 120 requests less 36 profiled and 24 in the held-out tuning split
    assert tokens.shape[1] == 8 and np.all(np.diff(tokens, axis=0) >= 0) and curve["requests"][-1] == 60


def test_report_draws_every_figure_it_has_inputs_for(outputs):
    _, report, result = outputs
    files = {f["file"] for f in result["figures"]}
    assert files == {"lar_per_layer_eval_tp.png", "lar_per_layer_eval_dp.png", "affinity.png",
                     "placement_tables_semmoe.png", "dp_rank_load_eval_dp.png", "cost_model_cost.png",
                     "cost_grid_cost_grid.png"}
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
def test_headless_chromium_loads_every_figure_and_the_page_fits_1280_px(outputs, tmp_path):
    """In a 1280-px window every figure decodes, the page (the wide DP table included) needs no
    sideways scrolling, and no table scrolls inside its box."""
    _, report, result = outputs
    n = len(result["figures"])
    page = tmp_path / "page"
    shutil.copytree(report, page)
    html_text = (page / "index.html").read_text()
    (page / "index.html").write_text(html_text.replace("</body>", MEASURE + "</body>"))
    dom = dump_dom(page / "index.html", tmp_path / "profile")
    assert f'data-loaded="{n}" data-total="{n}">all {n} figures loaded' in dom
    measured = {key: int(re.search(rf'data-{key}="(\d+)"', dom).group(1))
                for key in ("scroll-width", "scrolling-tables", "tables")}
    assert 0 < measured["scroll-width"] <= PAGE_WIDTH and measured["scrolling-tables"] == 0, measured
    assert measured["tables"] == html_text.count("<table>")
    assert "<th>window_<wbr>imbalance</th>" in html_text  # the widest table, the DP eval's, was measured
    # the check can fail: the same page without one PNG beside it
    os.remove(page / result["figures"][0]["file"])
    dom = dump_dom(page / "index.html", tmp_path / "profile2")
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
    from vllm_semmoe.evaluation.report import collect_inputs, figure_bench_serve

    run = lambda policy, b: {"policy": policy, "dp": 2, "rank_prompt_tokens": [10, 12],  # noqa: E731
                             "rank_imbalance": 1.09, "live_lar": 0.5, "moe_bytes_per_token": b}
    (tmp_path / "bench_serve.json").write_text(json.dumps(
        {"runs": {"vllm": run("vllm", 2689.0), "semmoe": run("semmoe", 1933.0)}, "outputs_identical": False}))
    found = collect_inputs(str(tmp_path))["bench_serve"]
    assert [label for label, _ in found] == ["bench_serve.json: vllm", "bench_serve.json: semmoe"]
    legend = legend_texts(figure_bench_serve(found))
    assert legend[1].endswith("MoE 1933 B/token)"), legend


def test_multi_seed_eval_is_drawn_from_the_seeds_means(outputs, tmp_path):
    """``semmoe eval --seeds`` writes every figure as {mean, sd, per_seed}: the report draws the means."""
    from vllm_semmoe.evaluation.evaluate import aggregate_seeds

    out, _, _ = outputs
    data = json.loads((out / "eval_tp.json").read_text())
    data["methods"] = aggregate_seeds([data["methods"], data["methods"]])
    data["seeds"] = [0, 1]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "eval_seeds.json").write_text(json.dumps(data))
    result = build_report(str(tmp_path / "in"), str(tmp_path / "r"))
    assert [f["file"] for f in result["figures"]] == ["lar_per_layer_eval_seeds.png"]


# ---- the figures: legends beside the data, every axis named ---------------------------------
def legend_texts(fig) -> list[str]:
    """The texts of every legend of ``fig`` (the figure's own and its axes')."""
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    return [t.get_text() for legend in legends for t in legend.get_texts()]


@pytest.fixture(scope="module")
def figures(outputs):
    """Every figure the report draws, from the fixture's JSON (bench-ep and bench-serve: runs of
    their JSON layout)."""
    import matplotlib.pyplot as plt

    from vllm_semmoe.evaluation import report
    from vllm_semmoe.core.tables import load_tables

    out, _, _ = outputs
    read = lambda name: json.loads((out / name).read_text())  # noqa: E731
    dp = read("eval_dp.json")
    placement = load_tables(out / "tables_semmoe").placement
    serve = [(f"bench_serve.json: {p}", {"policy": p, "rank_prompt_tokens": [900 + 40 * i, 1000 - 40 * i],
                                         "rank_imbalance": 1.05, "live_lar": 0.5, "moe_bytes_per_token": 2000.0 + i})
             for i, p in enumerate(("vllm", "semmoe"))]
    bench_ep = [("bench_ep.json", {"mode": "tp", "methods": {m: {"bytes_per_token": 4096.0 * (1 - r["lar"])}
                                                             for m, r in dp["methods"].items()}})]
    figs = {
        "lar_per_layer_tp": report.figure_lar_per_layer(read("eval_tp.json")),
        "lar_per_layer_dp": report.figure_lar_per_layer(dp),
        "affinity": report.figure_affinity([("analyze.json", read("analyze.json"))]),
        "placement": report.figure_placement(placement.expert_device, "placement"),
        "rank_load": report.figure_rank_load({m: r["rank_load_curve"] for m, r in dp["methods"].items()},
                                             dp["ep"], "DP per-rank load"),
        "bench_serve": report.figure_bench_serve(serve),
        "bytes": report.figure_bytes(bench_ep),
        "cost": report.figure_cost(read("cost.json")),
        "grid": report.figure_grid(read("cost_grid.json")),
    }
    for fig in figs.values():
        fig.canvas.draw()
    yield figs
    for fig in figs.values():
        plt.close(fig)


def test_no_legend_covers_a_bar_or_a_data_point(figures):
    """Legends and data compared as drawn (display pixels): no bar and no plotted point under a legend."""
    from matplotlib.patches import Rectangle

    covered = []
    for name, fig in figures.items():
        renderer = fig.canvas.get_renderer()
        legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
        boxes = [legend.get_window_extent(renderer) for legend in legends]
        for ax in fig.axes:
            bars = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_width() and p.get_height()]
            covered += [f"{name}: a bar of {ax.get_title()!r}" for bar in bars
                        if any(box.overlaps(bar.get_window_extent(renderer)) for box in boxes)]
            for line in ax.get_lines():
                points = line.get_transform().transform(line.get_xydata())  # display pixels
                covered += [f"{name}: points of {line.get_label()!r}" for box in boxes
                            if np.any((points[:, 0] > box.x0) & (points[:, 0] < box.x1)
                                      & (points[:, 1] > box.y0) & (points[:, 1] < box.y1))]
    assert covered == []
    assert sum(len(ax.patches) for ax in figures["cost"].axes) >= 3  # the check saw the cost model's bars


def test_every_axes_has_a_y_label(figures):
    unlabelled = [f"{name}: axes {i} ({ax.get_title()!r})" for name, fig in figures.items()
                  for i, ax in enumerate(fig.axes) if ax.get_visible() and not ax.get_ylabel().strip()]
    assert unlabelled == []


def test_per_rank_load_panels_name_every_rank(figures, outputs):
    out, _, _ = outputs
    ranks = json.loads((out / "eval_dp.json").read_text())["ep"]
    fig = figures["rank_load"]
    named = set(legend_texts(fig))
    assert named >= {f"rank {r}" for r in range(ranks)}
    for ax in fig.axes:
        if ax.get_visible():
            lines = ax.get_lines()
            assert len(lines) == ranks and {line.get_label() for line in lines} <= named
            styles = {(tuple(line.get_color()) if not isinstance(line.get_color(), str) else line.get_color(),
                       line.get_linestyle()) for line in lines}
            assert len(styles) == ranks  # every rank's line can be told apart
