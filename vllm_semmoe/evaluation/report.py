"""``semmoe report``: one HTML page with figures from the JSON the other commands wrote.

Reads every ``*.json`` under ``--from`` and every tables directory (``manifest.json`` of
``semmoe solve``), recognises each by its keys, and draws (matplotlib, PNG files beside
``index.html``; the page has no external resources):

=====================  =================================================  ============================
figure                 input                                              keys it needs
=====================  =================================================  ============================
LAR per layer          ``semmoe eval --json``                             ``methods.*.lar_per_layer``
affinity evidence      ``semmoe analyze --json``                          ``layers[*].f1/topk_mass``
placement map          tables directory (``semmoe solve --out``)          ``tables.npz: expert_device``
DP rank load           ``semmoe eval --mode dp --json``                   ``methods.*.rank_load_curve``
                       ``semmoe bench-serve --json``                      ``rank_prompt_tokens``
bytes per token        ``semmoe bench-ep --json``                         ``methods.*.bytes_per_token``
modelled MoE time      ``semmoe cost --json``                             ``cost.<hw>.<method>.*_us``
time vs vanilla grid   ``semmoe cost --grid --json``                      ``rows[*].time_ratio_vs_vanilla``
=====================  =================================================  ============================

A figure whose input is absent is skipped, and the page says which and why. A ``*.json`` that is
not readable JSON, and an input recognised by its keys whose fields a figure reads hold the wrong
kind of value (a string where a number belongs, ``"ep": 0``), is a :class:`ReportError` naming the
file and the field. ``semmoe eval --seeds`` output is drawn from the seeds' means. The page's one
inline script marks the figure check (``#figure-check``): how many ``<img>`` decoded.
"""

from __future__ import annotations

import html
import json
import os
import time
from numbers import Real

import numpy as np

DPI = 110


class ReportError(ValueError):
    """``semmoe report`` has nothing to read, or cannot write its output."""


# ---- finding inputs ------------------------------------------------------------------------
def _is_eval(d) -> bool:
    rows = d.get("methods") if isinstance(d, dict) else None
    return (isinstance(rows, dict) and "mode" in d and "ep" in d and rows
            and all(isinstance(r, dict) and "lar" in r and "oracle_lar" in r for r in rows.values()))


def _is_analyze(d) -> bool:
    return isinstance(d, dict) and isinstance(d.get("layers"), list) and bool(d["layers"]) \
        and isinstance(d["layers"][0], dict) and "f1" in d["layers"][0]


def _is_bench_ep(d) -> bool:
    rows = d.get("methods") if isinstance(d, dict) else None
    return isinstance(rows, dict) and bool(rows) and all(
        isinstance(r, dict) and "bytes_per_token" in r for r in rows.values())


def _is_bench_serve(d) -> bool:
    return isinstance(d, dict) and "rank_prompt_tokens" in d and "policy" in d


def _is_cost(d) -> bool:
    cost = d.get("cost") if isinstance(d, dict) else None
    return isinstance(cost, dict) and bool(cost) and all(
        isinstance(rows, dict) and all(isinstance(r, dict) and "total_us" in r for r in rows.values())
        for rows in cost.values())


def _is_grid(d) -> bool:
    rows = d.get("rows") if isinstance(d, dict) else None
    return isinstance(rows, list) and bool(rows) and all(
        isinstance(r, dict) and "time_ratio_vs_vanilla" in r and "method" in r for r in rows)


# ---- checking the fields the figures read ---------------------------------------------------
_MISSING = object()


class _Fields:
    """Checks the fields of one input file that a figure reads; the first wrong one is a
    :class:`ReportError` naming the file, the field and the command that writes the file."""

    def __init__(self, path: str, writer: str):
        self.path, self.writer = path, writer

    def fail(self, field: str, want: str, value) -> None:
        shown = repr(value)
        shown = "nothing (missing)" if value is _MISSING else shown if len(shown) <= 40 else shown[:37] + "..."
        raise ReportError(f"{self.path}: field {field} must be {want}, got {shown}; re-create the file with "
                          f"`{self.writer}` or remove it from --from")

    def number(self, row: dict, key: str, field: str, required: bool = True, none_ok: bool = False) -> None:
        value = row.get(key, _MISSING)
        if value is _MISSING and not required:
            return
        if not ((value is None and none_ok) or (isinstance(value, Real) and not isinstance(value, bool))):
            self.fail(field, "a number", value)

    def numbers(self, value, field: str, length: int | None = None) -> None:
        """A non-empty list of numbers (of ``length`` items when given)."""
        if not isinstance(value, list) or not value or (length is not None and len(value) != length):
            self.fail(field, "a non-empty list of numbers" if length is None else f"a list of {length} numbers", value)
        for i, v in enumerate(value):
            if not isinstance(v, Real) or isinstance(v, bool):
                self.fail(f"{field}[{i}]", "a number", v)

    def positive_int(self, row: dict, key: str, field: str) -> None:
        value = row.get(key, _MISSING)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            self.fail(field, "an integer >= 1", value)


def _seed_means(data: dict) -> dict:
    """``semmoe eval --seeds`` JSON (every figure ``{"mean", "sd", "per_seed"}``) → the same
    layout as one seed's, with each figure's mean (figures without a mean are left out)."""
    if "seeds" not in data:
        return data
    rows = {name: {k: v["mean"] for k, v in row.items() if isinstance(v, dict) and "mean" in v}
            for name, row in data["methods"].items()}
    return dict(data, methods=rows)


def _check_eval(path: str, data: dict) -> None:
    from ..core.modes import MODES

    check = _Fields(path, "semmoe eval --json")
    check.positive_int(data, "ep", "ep")
    if data["mode"] not in MODES:
        check.fail("mode", f"one of {', '.join(MODES)}", data["mode"])
    for name, row in data["methods"].items():
        where = f"methods.{name}"
        check.number(row, "lar", f"{where}.lar")
        check.number(row, "oracle_lar", f"{where}.oracle_lar")
        if "lar_per_layer" in row:
            check.numbers(row["lar_per_layer"], f"{where}.lar_per_layer")
        if "rank_load_curve" in row:
            curve = row["rank_load_curve"]
            if not isinstance(curve, dict) or not isinstance(curve.get("tokens"), list) or not curve["tokens"]:
                check.fail(f"{where}.rank_load_curve", "{\"requests\": [P], \"tokens\": [P][ranks]}", curve)
            ranks = curve["tokens"][0] if isinstance(curve["tokens"][0], list) else []
            for i, step in enumerate(curve["tokens"]):
                check.numbers(step, f"{where}.rank_load_curve.tokens[{i}]", len(ranks) or None)
            check.numbers(curve.get("requests", _MISSING), f"{where}.rank_load_curve.requests", len(curve["tokens"]))


def _check_analyze(path: str, data: dict, prefix: str = "") -> None:
    check = _Fields(path, "semmoe analyze --json")
    for i, row in enumerate(data["layers"]):
        where = f"{prefix}layers[{i}]"
        if not isinstance(row, dict):
            check.fail(where, "an object", row)
        check.number(row, "layer", f"{where}.layer")
        for key in ("f1", "topk_mass"):
            check.numbers(row.get(key, _MISSING), f"{where}.{key}", 3)
    shape = data.get("shape")
    if shape:
        if not isinstance(shape, dict):
            check.fail(f"{prefix}shape", "an object", shape)
        check.positive_int(shape, "top_k", f"{prefix}shape.top_k")
        check.positive_int(shape, "experts", f"{prefix}shape.experts")


def _check_bench_ep(path: str, data: dict) -> None:
    check = _Fields(path, "semmoe bench-ep --json")
    for name, row in data["methods"].items():
        check.number(row, "bytes_per_token", f"methods.{name}.bytes_per_token")


def _check_bench_serve(path: str, data: dict, prefix: str = "") -> None:
    check = _Fields(path, "semmoe bench-serve --json")
    check.numbers(data["rank_prompt_tokens"], f"{prefix}rank_prompt_tokens")
    check.number(data, "rank_imbalance", f"{prefix}rank_imbalance")
    check.number(data, "live_lar", f"{prefix}live_lar", required=False, none_ok=True)
    check.number(data, "moe_bytes_per_token", f"{prefix}moe_bytes_per_token", required=False, none_ok=True)


def _check_cost(path: str, data: dict) -> None:
    check = _Fields(path, "semmoe cost --json")
    for hw, rows in data["cost"].items():
        for name, row in rows.items():
            for key in ("total_us", *COST_PARTS):
                check.number(row, key, f"cost.{hw}.{name}.{key}", required=key == "total_us")


def _check_grid(path: str, data: dict) -> None:
    check = _Fields(path, "semmoe cost --grid --json")
    for i, row in enumerate(data["rows"]):
        for key in ("mode", "method", "hardware"):
            if not isinstance(row.get(key), str):
                check.fail(f"rows[{i}].{key}", "a string", row.get(key, _MISSING))
        for key in ("redundant", "batch_tokens", "hidden"):
            if key == "redundant":
                check.number(row, key, f"rows[{i}].{key}")
            else:
                check.positive_int(row, key, f"rows[{i}].{key}")
        check.number(row, "total_us", f"rows[{i}].total_us")
        check.number(row, "time_ratio_vs_vanilla", f"rows[{i}].time_ratio_vs_vanilla", none_ok=True)


def collect_inputs(from_dir: str, skip_dir: str | None = None) -> dict:
    """``{"eval": [(name, data)], "analyze": [...], "bench_ep": [...], "bench_serve": [...],
    "cost": [...], "grid": [...], "tables": [(name, path)]}`` found under ``from_dir`` (sorted by path).

    A ``*.json`` that is not JSON, or an input of a known kind with a wrong field, is a
    :class:`ReportError` naming the file (and the field); JSON of other tools is passed over."""
    if not os.path.isdir(from_dir):
        raise ReportError(f"--from {from_dir}: not a directory")
    found = {k: [] for k in ("eval", "analyze", "bench_ep", "bench_serve", "cost", "grid", "tables")}
    skip = os.path.abspath(skip_dir) if skip_dir else None
    for root, dirs, files in os.walk(from_dir):
        dirs[:] = sorted(d for d in dirs if os.path.abspath(os.path.join(root, d)) != skip)
        rel = os.path.relpath(root, from_dir)
        if "manifest.json" in files and "tables.npz" in files:
            found["tables"].append((rel, root))
            continue
        for name in sorted(files):
            if not name.endswith(".json"):
                continue
            path = os.path.join(root, name)
            label = os.path.normpath(os.path.join(rel, name))
            try:
                with open(path, encoding="utf-8") as f:
                    data = json.load(f)
            except OSError as exc:
                raise ReportError(f"{path}: cannot be read ({exc.strerror}); fix its permissions or remove it "
                                  "from --from") from None
            except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
                raise ReportError(f"{path}: not readable JSON ({exc}); repair or remove it from --from") from None
            if _is_eval(data):
                data = _seed_means(data)
                _check_eval(path, data)
                found["eval"].append((label, data))
            elif _is_analyze(data):
                _check_analyze(path, data)
                found["analyze"].append((label, data))
            elif isinstance(data, dict) and data and all(_is_analyze(v) for v in data.values()):
                for k, v in data.items():
                    _check_analyze(path, v, prefix=f"{k}.")
                found["analyze"] += [(f"{label}: {os.path.basename(k)}", v) for k, v in data.items()]
            elif _is_grid(data):
                _check_grid(path, data)
                found["grid"].append((label, data))
            elif _is_cost(data):
                _check_cost(path, data)
                found["cost"].append((label, data))
            elif _is_bench_ep(data):
                _check_bench_ep(path, data)
                found["bench_ep"].append((label, data))
            elif _is_bench_serve(data):
                _check_bench_serve(path, data)
                found["bench_serve"].append((label, data))
            elif isinstance(data, dict) and isinstance(data.get("runs"), dict) and data["runs"] \
                    and all(_is_bench_serve(r) for r in data["runs"].values()):  # bench-serve, several policies
                for policy, r in data["runs"].items():
                    _check_bench_serve(path, r, prefix=f"runs.{policy}.")
                found["bench_serve"] += [(f"{label}: {policy}", r) for policy, r in data["runs"].items()]
    return found


# ---- figures (each returns the matplotlib figure) ------------------------------------------
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _legend_outside(fig, ax=None, **kwargs):
    """A legend beside the plots (right of them), never over data: the figure's, with
    ``ax``'s handles when given (constrained layout makes room for it)."""
    handles, labels = (ax or fig.axes[0]).get_legend_handles_labels()
    return fig.legend(handles, labels, loc="outside right upper", fontsize=8, **kwargs)


def figure_lar_per_layer(data: dict):
    """Lines: LAR of every method at every MoE layer (``lar_per_layer`` ``[L]`` per method)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9.5, 4), layout="constrained")
    for name, row in data["methods"].items():
        values = row["lar_per_layer"]
        ax.plot(np.arange(len(values)), values, marker="o", ms=3, label=f"{name} ({row['lar']:.3f})")
    ax.axhline(1.0 / data["ep"], color="grey", ls=":", lw=1, label=f"1/EP = {1.0 / data['ep']:.3f}")
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("local activation rate")
    seeds = f"mean of {len(data['seeds'])} seeds" if "seeds" in data else f"{data.get('eval_tokens', '?')} tokens"
    ax.set_title(f"LAR per layer, EP {data['ep']}, {data['mode'].upper()} mode ({seeds})")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    _legend_outside(fig, ax, title="method (mean LAR)")
    return fig


def figure_affinity(reports: list[tuple[str, dict]]):
    """Per layer, median (p25-p75 band) of F1 top-k and top-k mass over frequent tokens."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True, layout="constrained")
    for label, r in reports:
        layers = [row["layer"] for row in r["layers"]]
        for ax, key in zip(axes, ("f1", "topk_mass")):
            q = np.array([row[key] for row in r["layers"]], float)  # [L, 3]: p25, p50, p75
            line, = ax.plot(layers, q[:, 1], marker="o", ms=3, label=r.get("trace", label))
            ax.fill_between(layers, q[:, 0], q[:, 2], color=line.get_color(), alpha=0.2)
        shape = r.get("shape")
        if shape:
            for ax in axes:
                ax.axhline(shape["top_k"] / shape["experts"], color=line.get_color(), ls=":", lw=1)
    axes[0].set_title("F1 of a token's usual top-k (leave-one-out)")
    axes[1].set_title("share of a token's routing on its top-k")
    axes[0].set_ylabel("F1 (median; band p25-p75)")
    axes[1].set_ylabel("top-k share (median; band p25-p75)")
    for ax in axes:
        ax.set_xlabel("MoE layer")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    _legend_outside(fig, axes[0], title="trace")
    fig.suptitle("token→expert affinity per layer over frequent tokens (dotted: no-affinity level k/N)", fontsize=10)
    return fig


def figure_placement(expert_device: np.ndarray, title: str):
    """Layer × expert map coloured by the device holding each expert."""
    plt = _plt()
    from matplotlib.colors import BoundaryNorm, ListedColormap

    L, N = expert_device.shape
    E = int(expert_device.max()) + 1
    base = plt.get_cmap("tab20" if E > 10 else "tab10")
    cmap = ListedColormap([base(i % base.N) for i in range(E)])
    fig, ax = plt.subplots(figsize=(min(14, 3 + N * 0.12), min(8, 1.5 + L * 0.2)), layout="constrained")
    im = ax.imshow(expert_device, aspect="auto", interpolation="nearest", cmap=cmap,
                   norm=BoundaryNorm(np.arange(E + 1) - 0.5, E))
    ax.set_xlabel("logical expert")
    ax.set_ylabel("MoE layer")
    ax.set_title(title)
    cbar = fig.colorbar(im, ax=ax, ticks=np.arange(E))
    cbar.set_label("device")
    return fig


def _rank_style(rank: int, ranks: int, plt) -> dict:
    """Colour and line style of one DP rank, the same in every panel (distinct for up to 80 ranks)."""
    cmap = plt.get_cmap("tab10" if ranks <= 10 else "tab20")
    return {"color": cmap(rank % cmap.N), "ls": ("-", "--", ":", "-.")[(rank // cmap.N) % 4]}


def figure_rank_load(curves: dict, ep: int, title: str):
    """Cumulative prompt tokens per DP rank over the requests, one panel per method; one legend
    names the ranks (each rank has the same line in every panel)."""
    plt = _plt()
    cols = min(3, len(curves))
    rows = -(-len(curves) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols + 1.2, 3.0 * rows + 0.5), sharey=True, squeeze=False,
                             layout="constrained")
    for ax in axes.flat[len(curves):]:
        ax.set_visible(False)
    for ax, (name, curve) in zip(axes.flat, curves.items()):
        tokens = np.asarray(curve["tokens"], float)  # [P, E]
        for r in range(tokens.shape[1]):
            ax.plot(curve["requests"], tokens[:, r], lw=1, label=f"rank {r}", **_rank_style(r, tokens.shape[1], plt))
        spread = tokens[-1].max() / max(tokens[-1].mean(), 1e-9)
        ax.set_title(f"{name}: max/mean {spread:.3f}", fontsize=9)
        ax.set_xlabel("requests routed")
        ax.set_ylabel("prompt tokens per rank")
        ax.grid(alpha=0.3)
    _legend_outside(fig, axes.flat[0], title=f"DP rank ({ep} ranks)", ncol=-(-ep // 16))
    fig.suptitle(title, fontsize=10)
    return fig


def figure_bench_serve(runs: list[tuple[str, dict]]):
    """Prompt tokens each DP rank served, per bench-serve run."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.5 + 0.25 * len(runs)), layout="constrained")
    width = 0.8 / len(runs)
    for i, (_, r) in enumerate(runs):
        x = np.arange(len(r["rank_prompt_tokens"])) + i * width
        moe = f", MoE {r['moe_bytes_per_token']:.0f} B/token" if r.get("moe_bytes_per_token") is not None else ""
        lar = "-" if r.get("live_lar") is None else f"{r['live_lar']:.3f}"
        ax.bar(x, r["rank_prompt_tokens"], width, label=f"{r['policy']} (max/mean {r['rank_imbalance']:.3f}, "
                                                        f"live LAR {lar}{moe})")
    ranks = max(len(r["rank_prompt_tokens"]) for _, r in runs)
    ax.set_xticks(np.arange(ranks) + width * (len(runs) - 1) / 2, [str(i) for i in range(ranks)])
    ax.set_xlabel("DP rank")
    ax.set_ylabel("prompt tokens served")
    ax.set_title("bench-serve: DP per-rank load")
    ax.grid(alpha=0.3, axis="y")
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", fontsize=8)  # long labels: below, full width
    return fig


def figure_bytes(runs: list[tuple[str, dict]]):
    """All-to-all bytes per token per method (bench-ep, and bench-serve when it reports them)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.5), layout="constrained")
    labels, values = [], []
    for label, r in runs:
        for name, row in r["methods"].items():
            labels.append(f"{name}\n{r.get('mode', '')} {label}")
            values.append(row["bytes_per_token"] / 1024)
    bars = ax.bar(np.arange(len(values)), values, color=[f"C{i % 10}" for i in range(len(values))])
    ax.bar_label(bars, fmt="%.3g", fontsize=8)
    ax.set_xticks(np.arange(len(values)), labels, fontsize=7)
    ax.set_ylabel("KiB per token (dispatch + combine)")
    ax.set_title("bench-ep: all-to-all bytes per token")
    ax.grid(alpha=0.3, axis="y")
    return fig


COST_PARTS = ("dispatch_us", "experts_us", "combine_us")


def figure_cost(data: dict):
    """Modelled MoE time per token, stacked dispatch / experts / combine, per hardware and method;
    one legend for the parts, beside the panels."""
    plt = _plt()
    cost = data["cost"]
    fig, axes = plt.subplots(1, len(cost), figsize=(4.2 * len(cost) + 1.2, 3.6), squeeze=False, layout="constrained")
    for ax, (hw, rows) in zip(axes[0], cost.items()):
        names = list(rows)
        bottom = np.zeros(len(names))
        for i, part in enumerate(COST_PARTS):
            vals = np.array([rows[m].get(part, 0.0) for m in names], float)
            ax.bar(names, vals, bottom=bottom, color=f"C{i}", label=part.removesuffix("_us"))
            bottom += vals
        ax.set_title(hw, fontsize=9)
        ax.set_ylabel("µs per token (all MoE layers)")
        ax.tick_params(axis="x", labelsize=7, rotation=30)
        ax.grid(alpha=0.3, axis="y")
    _legend_outside(fig, axes[0][0], title="part")
    fig.suptitle(f"cost model: EP {data.get('ep', '?')}, {str(data.get('mode', '')).upper()} mode", fontsize=10)
    return fig


GRID_METHODS = ("eplb", "moetuner", "semmoe")  # drawn against vanilla (ratio 1)


def grid_best(rows: list[dict]) -> dict:
    """``{(mode, batch, hidden): {hardware: {method: best row over R}}}`` of a cost grid."""
    out = {}
    for r in rows:
        if r["method"] not in GRID_METHODS or r.get("time_ratio_vs_vanilla") is None:
            continue
        cell = out.setdefault((r["mode"], r["batch_tokens"], r["hidden"]), {}).setdefault(r["hardware"], {})
        if r["method"] not in cell or r["total_us"] < cell[r["method"]]["total_us"]:
            cell[r["method"]] = r
    return out


def figure_grid(data: dict):
    """Modelled MoE-layer time relative to vanilla, each method at its best R, one panel per
    (mode, step size, width), a bar group per hardware set (calibrated ones marked ``*``)."""
    plt = _plt()
    best = grid_best(data["rows"])
    keys = sorted(best)
    cols = 2
    nrows = -(-len(keys) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(13, 3.1 * nrows + 0.6), squeeze=False, layout="constrained")
    for ax, key in zip(axes.flat, keys):
        mode, batch, hidden = key
        hws = list(best[key])
        x = np.arange(len(hws))
        w = 0.8 / len(GRID_METHODS)
        for i, m in enumerate(GRID_METHODS):
            vals = [best[key][h][m]["time_ratio_vs_vanilla"] if m in best[key][h] else np.nan for h in hws]
            ax.bar(x + (i - (len(GRID_METHODS) - 1) / 2) * w, vals, w, color=f"C{i}", label=m)
        ax.axhline(1.0, color="k", lw=0.8)
        calibrated = {r["hardware"]: r.get("calibrated") for r in data["rows"]}
        ax.set_xticks(x, [h + ("*" if calibrated.get(h) else "") for h in hws], fontsize=7, rotation=25, ha="right")
        ax.set_ylabel("time / vanilla")
        ax.set_title(f"{mode.upper()}, {batch}-token steps, hidden {hidden}", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
        lo = np.nanmin([best[key][h][m]["time_ratio_vs_vanilla"] for h in hws for m in best[key][h]])
        ax.set_ylim(min(0.8, lo - 0.02), 1.1)
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    _legend_outside(fig, axes[0][0], title="method (best R)")
    fig.suptitle(f"modelled MoE-layer time vs vanilla, EP {data.get('ep', '?')} (* calibrated hardware)", fontsize=10)
    return fig


# ---- tables --------------------------------------------------------------------------------
def eval_columns(methods: dict) -> list[list[str]]:
    """The numeric columns of ``semmoe eval``'s method rows in up to three tables, as the command
    prints them: the methods' figures, the DP balance over windows (``window_imbalance*``,
    ``request_imbalance``) and the DP locality under each locality-blind balancer (``lar_<rule>``)."""
    cols = []
    for row in methods.values():
        cols += [c for c, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and c not in cols]
    balance = [c for c in cols if c.startswith("window_imbalance") or c == "request_imbalance"]
    own = ("lar_token", "lar_with_semmoe_sched")
    under = [c for c in cols if c.startswith("lar_") and c not in own]
    main = [c for c in cols if c not in balance and c not in under]
    return [main] + [group for group in (balance, ["lar", *under] if under else []) if group]


def html_table(rows: dict, columns: list[str] | None = None, fmt: str = "{:.4f}") -> str:
    """``{row name: {column: value}}`` → an HTML table (numbers formatted, lists left out). Column
    names may break after each ``_`` so a wide table wraps its header instead of widening the page;
    a table wider than the page still scrolls inside its own box (``div.table``)."""
    if columns is None:
        columns = []
        for row in rows.values():
            columns += [c for c, v in row.items() if isinstance(v, (int, float)) and c not in columns]
    head = "".join(f"<th>{html.escape(c).replace('_', '_<wbr>')}</th>" for c in columns)
    body = []
    for name, row in rows.items():
        cells = []
        for c in columns:
            v = row.get(c)
            cells.append("<td>-</td>" if v is None else
                         f"<td>{fmt.format(v) if isinstance(v, float) else html.escape(str(v))}</td>")
        body.append(f"<tr><th>{html.escape(str(name))}</th>{''.join(cells)}</tr>")
    return f"<div class=\"table\"><table><tr><th></th>{head}</tr>{''.join(body)}</table></div>"


# ---- page ----------------------------------------------------------------------------------
def _slug(label: str) -> str:
    """A file-name part from an input's path relative to ``--from`` (``eval_tp.json`` → ``eval_tp``)."""
    stem = label[:-5] if label.endswith(".json") else label
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in stem)


_STYLE = """body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:2em}
figure{margin:1em 0}img{max-width:100%;border:1px solid #eee}figcaption{font-size:.85em;color:#555}
.table{max-width:100%;overflow-x:auto}table{border-collapse:collapse;font-size:.75em;margin:.5em 0}
td,th{border:1px solid #ddd;padding:2px 4px;text-align:right}
.skipped{color:#a60}#figure-check{font-size:.85em;color:#555}"""

_CHECK = """<script>
window.addEventListener("load", function () {
  var imgs = Array.prototype.slice.call(document.images);
  var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; });
  var el = document.getElementById("figure-check");
  el.dataset.loaded = ok.length; el.dataset.total = imgs.length;
  el.textContent = ok.length === imgs.length ? "all " + imgs.length + " figures loaded"
    : (imgs.length - ok.length) + " of " + imgs.length + " figures did not load: keep the PNG files beside this page";
});
</script>"""


def build_report(from_dir: str, out_dir: str) -> dict:
    """Write ``out_dir/index.html`` and its PNG figures from what :func:`collect_inputs` finds.

    Returns ``{"html": path, "figures": [{"file", "title", "source"}], "skipped": [reason]}``.
    """
    from ..core.tables import load_tables

    plt = _plt()
    found = collect_inputs(from_dir, skip_dir=out_dir)
    if not any(found.values()):
        raise ReportError(f"--from {from_dir}: no JSON written by semmoe eval/analyze/cost/bench-ep/bench-serve "
                          "and no tables directory; run e.g. `bash scripts/eval_deepseek.sh` first")
    os.makedirs(out_dir, exist_ok=True)
    figures, skipped, sections = [], [], []

    def save(fig, file: str, title: str, source: str) -> str:
        fig.savefig(os.path.join(out_dir, file), dpi=DPI)
        plt.close(fig)
        figures.append({"file": file, "title": title, "source": source})
        return (f'<figure><img src="{html.escape(file)}" alt="{html.escape(title)}">'
                f"<figcaption>{html.escape(title)} — from <code>{html.escape(source)}</code></figcaption></figure>")

    def skip(reason: str) -> str:
        skipped.append(reason)
        return f'<p class="skipped">Not drawn: {html.escape(reason)}</p>'

    # LAR per layer + method tables
    part = []
    for label, data in found["eval"]:
        if all("lar_per_layer" in r for r in data["methods"].values()):
            part.append(save(figure_lar_per_layer(data), f"lar_per_layer_{_slug(label)}.png",
                             f"LAR per layer, every method, EP {data['ep']} {data['mode'].upper()}", label))
        else:
            part.append(skip(f"{label}: no lar_per_layer (written by an older semmoe eval)"))
        part += [html_table(data["methods"], cols) for cols in eval_columns(data["methods"])]
    sections.append(("Local activation rate per layer", part or [skip("no `semmoe eval --json` output")]))

    # affinity
    part = []
    if found["analyze"]:
        part.append(save(figure_affinity(found["analyze"]), "affinity.png", "token→expert affinity evidence per layer",
                         ", ".join(label for label, _ in found["analyze"])))
    sections.append(("Affinity evidence", part or [skip("no `semmoe analyze --json` output")]))

    # placement maps
    part = []
    for label, path in found["tables"]:
        try:
            placement = load_tables(path).placement
        except ValueError as exc:
            part.append(skip(f"{label}: {exc}"))
            continue
        file = f"placement_{_slug(label)}.png"
        title = (f"{placement.method} placement: {placement.num_layers} layers x {placement.num_experts} experts "
                 f"on {placement.ep_size} devices")
        part.append(save(figure_placement(placement.expert_device, title), file, title, label))
    sections.append(("Placement (layer × expert, coloured by device)",
                     part or [skip("no tables directory (`semmoe solve --out DIR`)")]))

    # DP load over time
    part = []
    for label, data in found["eval"]:
        curves = {m: r["rank_load_curve"] for m, r in data["methods"].items() if "rank_load_curve" in r}
        if data["mode"] == "dp" and curves:
            fig = figure_rank_load(curves, data["ep"], f"DP per-rank load over time (eval, EP {data['ep']})")
            part.append(save(fig, f"dp_rank_load_{_slug(label)}.png", "DP per-rank prompt tokens over the evaluation",
                             label))
    if found["bench_serve"]:
        part.append(save(figure_bench_serve(found["bench_serve"]), "bench_serve_rank_load.png",
                         "bench-serve: prompt tokens per DP rank", ", ".join(lb for lb, _ in found["bench_serve"])))
        part.append(html_table({lb: r for lb, r in found["bench_serve"]}))
    sections.append(("DP per-rank load", part or [skip("no DP eval with rank_load_curve and no bench-serve JSON")]))

    # bytes per token
    part = []
    if found["bench_ep"]:
        part.append(save(figure_bytes(found["bench_ep"]), "bytes_per_token.png",
                         "all-to-all bytes per token", ", ".join(lb for lb, _ in found["bench_ep"])))
        for label, data in found["bench_ep"]:
            part.append(f"<p><code>{html.escape(label)}</code></p>" + html_table(data["methods"]))
    sections.append(("Bytes per token", part or [skip("no `semmoe bench-ep --json` output")]))

    # cost model
    part = []
    for label, data in found["cost"]:
        part.append(save(figure_cost(data), f"cost_model_{_slug(label)}.png", "modelled MoE-layer time per token",
                         label))
        for hw, rows in data["cost"].items():
            part.append(f"<p><b>{html.escape(hw)}</b> (µs per token)</p>" + html_table(rows, fmt="{:.3f}"))
    for label, data in found["grid"]:
        part.append(save(figure_grid(data), f"cost_grid_{_slug(label)}.png",
                         "modelled MoE-layer time vs vanilla, every method at its best R", label))
        table = {}
        for (mode, batch, hidden), cells in sorted(grid_best(data["rows"]).items()):
            for hw, by in cells.items():
                sem = by.get("semmoe")
                if sem:
                    table[f"{mode} {batch} {hidden} {hw}"] = {
                        "semmoe_R": sem["redundant"], "variant": sem.get("variant", ""),
                        "vs_vanilla": sem["time_ratio_vs_vanilla"],
                        "eplb_vs_vanilla": by["eplb"]["time_ratio_vs_vanilla"] if "eplb" in by else None}
        part.append(f"<p><code>{html.escape(label)}</code>: Sem-MoE at its best R</p>"
                    + html_table(table, ["semmoe_R", "variant", "vs_vanilla", "eplb_vs_vanilla"], fmt="{:.3f}"))
    sections.append(("Cost model", part or [skip("no `semmoe cost --json` output")]))

    body = "".join(f"<h2>{html.escape(title)}</h2>{''.join(items)}" for title, items in sections)
    page = (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>Sem-MoE report</title>"
            f"<style>{_STYLE}</style></head><body><h1>Sem-MoE report</h1>"
            f"<p>From <code>{html.escape(os.path.abspath(from_dir))}</code>, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
            f"<span id=\"figure-check\" data-loaded=\"\" data-total=\"{len(figures)}\">figures not checked</span></p>"
            f"{body}{_CHECK}</body></html>\n")
    path = os.path.join(out_dir, "index.html")
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return {"html": path, "figures": figures, "skipped": skipped}
