"""Every user error is one clear line naming the file or option and the fix; misconfigured
engines refuse to start. Tracebacks are for bugs only."""

import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from vllm_semmoe.core import scheduling
from vllm_semmoe.assets import tiny_moe_path
from vllm_semmoe.cli import main
from vllm_semmoe.core.placement import PlacementError
from vllm_semmoe.core.policy import POLICIES, get_policy
from vllm_semmoe.core.synthetic import synthetic_trace
from vllm_semmoe.core.tables import TablesError, build_tables, load_tables
from vllm_semmoe.core.trace import TraceError
from vllm_semmoe.core.capture_store import load_trace
from vllm_semmoe.vllm_adapter.config import SemMoEConfig, SemMoEConfigError
from vllm_semmoe.testing.processes import fresh_cache_root


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """Saved synthetic traces with 64 and 32 experts per layer."""
    work = tmp_path_factory.mktemp("traces")
    paths = {}
    for experts in (64, 32):
        trace = synthetic_trace(num_layers=2, num_experts=experts, top_k=4, vocab_size=512, num_requests=40)
        paths[experts] = work / f"e{experts}.npz"
        trace.save(paths[experts])
    return paths


def _cli_error(capsys, argv) -> str:
    """Run the CLI, expect exit code 2 and exactly one stderr line; return it."""
    assert main(argv) == 2
    lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(lines) == 1, lines
    return lines[0]


# ---- EP sizes: checked before any solver, for every method -------------------------------------
@pytest.mark.parametrize("method", sorted(POLICIES))
def test_solve_ep_that_does_not_divide_the_experts(capsys, traces, tmp_path, method):
    line = _cli_error(capsys, ["solve", "--trace", str(traces[64]), "--ep", "7", "--method", method,
                               "--out", str(tmp_path / "t")])
    assert line == ("semmoe: error: --ep 7 does not divide the 64 experts per layer evenly; "
                    "choose one of 1, 2, 4, 8, 16, 32, 64")


@pytest.mark.parametrize("method", sorted(POLICIES))
def test_solve_ep_larger_than_the_experts(capsys, traces, tmp_path, method):
    line = _cli_error(capsys, ["solve", "--trace", str(traces[32]), "--ep", "64", "--method", method,
                               "--out", str(tmp_path / "t")])
    assert line == "semmoe: error: --ep 64 exceeds the 32 experts per layer; choose one of 1, 2, 4, 8, 16, 32"


def test_eval_ep_that_does_not_divide_the_experts(capsys, traces):
    line = _cli_error(capsys, ["eval", "--profile", str(traces[64]), "--ep", "7"])
    assert "--ep 7 does not divide the 64 experts" in line and "choose one of" in line


def test_policies_check_ep_size_from_python_too(traces):
    trace = load_trace(traces[64])
    for method in POLICIES:
        with pytest.raises(PlacementError, match="--ep 7 does not divide the 64 experts"):
            get_policy(method).solve(trace, 7)


# ---- damaged inputs ----------------------------------------------------------------------------
@pytest.fixture()
def tables_dir(traces, tmp_path):
    trace = load_trace(traces[32])
    build_tables(trace, get_policy("vanilla").solve(trace, 4), mode="dp").save(tmp_path / "tables")
    return tmp_path / "tables"


def test_truncated_tables_npz(tables_dir):
    data = (tables_dir / "tables.npz").read_bytes()
    (tables_dir / "tables.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(TablesError, match=r"tables\.npz: damaged or truncated .*; re-create the directory with "
                                          r"`semmoe solve`"):
        load_tables(tables_dir)


@pytest.mark.parametrize("manifest, message", [
    ([], r"manifest\.json: expected a JSON object, got list"),
    ("{not json", r"manifest\.json: not readable JSON"),
    ("drop:ep_size", r"manifest\.json: missing field\(s\) ep_size"),
    ("set:ep_size=0", r"manifest\.json: field ep_size must be an integer >= 1, got 0"),
    ("set:mode=ep", r"manifest\.json: mode must be one of tp, dp, got 'ep'"),
    ("set:ep_size=2", r"/tables\.npz: expert_device holds device ids 0\.\.3 \(EP 4\), \S+manifest\.json says "
                      r"ep_size 2; re-create the directory with `semmoe solve`$"),
])
def test_damaged_manifest(tables_dir, manifest, message):
    path = tables_dir / "manifest.json"
    valid = json.loads(path.read_text())
    if isinstance(manifest, str) and manifest.startswith("drop:"):
        valid.pop(manifest[5:])
        path.write_text(json.dumps(valid))
    elif isinstance(manifest, str) and manifest.startswith("set:"):
        key, value = manifest[4:].split("=")
        valid[key] = int(value) if value.isdigit() else value
        path.write_text(json.dumps(valid))
    else:
        path.write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))
    with pytest.raises(TablesError, match=message):
        load_tables(tables_dir)
    # the plugin names the same problem at engine start
    with pytest.raises(SemMoEConfigError, match=message):
        SemMoEConfig(tables=str(tables_dir)).load_tables(num_layers=None, num_experts=32, ep_size=1)


def test_replicated_tables_are_refused_where_replicas_cannot_serve(tmp_path):
    """Replica slots serve a token on the rank that routes it: DP ranks (TP 1) or the TP shuffle
    (DP 1). Other layouts, no expert parallelism and vLLM's EPLB are refused, naming the fix."""
    from types import SimpleNamespace

    from vllm_semmoe.core.modes import ServingMode
    from vllm_semmoe.core.policy import get_policy
    from vllm_semmoe.core.synthetic import synthetic_trace
    from vllm_semmoe.core.tables import build_tables
    from vllm_semmoe.vllm_adapter.config import PLACEMENT_ONLY, replica_token_device

    trace = synthetic_trace(num_layers=2, num_experts=8, top_k=2, vocab_size=256, num_requests=20)
    build_tables(trace, get_policy("semmoe").solve(trace, 2, redundant=1)).save(tmp_path / "r")
    tables = SemMoEConfig(tables=str(tmp_path / "r")).load_tables(num_layers=2, num_experts=8, ep_size=2)

    def layout(dp=1, tp=1, ep=True, eplb=False):
        return SimpleNamespace(data_parallel_size=dp, tensor_parallel_size=tp, enable_expert_parallel=ep,
                               enable_eplb=eplb)

    assert replica_token_device(tables, PLACEMENT_ONLY, layout(dp=2), 1) == 1
    assert replica_token_device(tables, ServingMode.TP, layout(tp=2), 0) == 0
    with pytest.raises(SemMoEConfigError, match=r"--redundant 1 serve a token from a replica on the rank that "
                                                r"routes it, which needs DP ranks with TP 1 or mode 'tp'"):
        replica_token_device(tables, PLACEMENT_ONLY, layout(tp=2), 0)
    with pytest.raises(SemMoEConfigError, match=r"running DP 2, TP 2"):
        replica_token_device(tables, ServingMode.DP, layout(dp=2, tp=2), 0)
    with pytest.raises(SemMoEConfigError, match=r"--enable-expert-parallel over 2 or more ranks"):
        replica_token_device(tables, PLACEMENT_ONLY, layout(dp=2, ep=False), 0)
    with pytest.raises(SemMoEConfigError, match=r"vLLM's EPLB would move them: remove --enable-eplb"):
        replica_token_device(tables, ServingMode.DP, layout(dp=2, eplb=True), 0)


def test_tables_directory_without_arrays(tables_dir):
    os.remove(tables_dir / "tables.npz")
    with pytest.raises(TablesError, match=r"no tables\.npz; re-create the directory with `semmoe solve`"):
        load_tables(tables_dir)


def test_non_trace_files(capsys, tmp_path, traces):
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    line = _cli_error(capsys, ["analyze", str(text)])
    assert line == (f"semmoe: error: {text}: not a routing trace (expected a .npz archive as written by "
                    "`semmoe profile` or a capture)")
    other = tmp_path / "other.npz"
    np.savez(other, weights=np.zeros(3))
    assert "missing field(s) tokens, experts, offsets; not a routing trace" in _cli_error(capsys, ["analyze", str(other)])
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(traces[32].read_bytes()[:2000])
    assert f"{truncated}: damaged or truncated .npz" in _cli_error(capsys, ["analyze", str(truncated)])
    with zipfile.ZipFile(tmp_path / "pickled.npz", "w") as z:  # an object array needs pickle
        for name, array in (("tokens", np.array([{"a": 1}], dtype=object)), ("experts", np.zeros((1, 1, 1), np.uint8)),
                            ("offsets", np.array([0, 1]))):
            with z.open(f"{name}.npy", "w") as f:
                np.lib.format.write_array(f, array, allow_pickle=True)
    with pytest.raises(TraceError, match=r"pickled\.npz: a field is unreadable or holds Python objects"):
        load_trace(tmp_path / "pickled.npz")


# ---- start-up: a configuration that could only fail on the first request refuses to start -----
@pytest.fixture(scope="module")
def engine_config():
    """``EngineArgs.create_engine_config`` through the plugin's start-up hook (the real vLLM
    code path; no engine process is started)."""
    pytest.importorskip("vllm")
    import vllm.plugins
    from vllm.engine.arg_utils import EngineArgs

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    vllm.plugins.load_general_plugins()

    def create(semmoe: dict, **parallel):
        return EngineArgs(model=tiny_moe_path(), dtype="bfloat16", max_model_len=256, enforce_eager=True,
                          additional_config={"semmoe": semmoe}, **parallel).create_engine_config()
    return create


@pytest.fixture(scope="module")
def tiny_tables(tmp_path_factory):
    """Tables for the embedded model (4 layers x 32 experts) for EP 1, 2 and 4, modes tp and dp."""
    trace = synthetic_trace(num_layers=4, num_experts=32, top_k=4, vocab_size=6144, num_requests=40)
    work = tmp_path_factory.mktemp("tiny_tables")
    out = {}
    for ep in (1, 2, 4):
        for mode in ("tp", "dp"):
            out[ep, mode] = work / f"{mode}{ep}"
            build_tables(trace, get_policy("vanilla").solve(trace, ep), mode=mode).save(out[ep, mode])
    return out


def test_dp_mode_without_data_parallelism_refuses_to_start(engine_config, tiny_tables):
    with pytest.raises(SemMoEConfigError, match=r"semmoe mode 'dp' routes requests over data-parallel ranks: add "
                                                r"--data-parallel-size N \(N >= 2\) and --enable-expert-parallel, or "
                                                r"use --mode placement-only \(running DP 1, TP 1, expert parallelism off\)"):
        engine_config({"tables": str(tiny_tables[1, "dp"]), "mode": "dp"})
    with pytest.raises(SemMoEConfigError, match=r"mode 'dp' routes requests"):  # EP-2 tables: the mode, not the EP size
        engine_config({"tables": str(tiny_tables[2, "dp"]), "mode": "dp"})


def test_sparse_dispatch_without_data_parallel_experts_refuses_to_start(engine_config, tiny_tables):
    with pytest.raises(SemMoEConfigError, match=r"semmoe dispatch 'sparse' exchanges tokens between data-parallel "
                                                r"ranks: it needs --data-parallel-size N \(N >= 2\), "
                                                r"--tensor-parallel-size 1 and --enable-expert-parallel \(running DP 1, "
                                                r"TP 1, expert parallelism off\)"):
        engine_config({"tables": str(tiny_tables[1, "dp"]), "dispatch": "sparse"})


def test_tp_mode_without_tensor_parallelism_refuses_to_start(engine_config, tiny_tables):
    with pytest.raises(SemMoEConfigError, match=r"semmoe mode 'tp' shuffles tokens over tensor-parallel ranks: add "
                                                r"--tensor-parallel-size N"):
        engine_config({"tables": str(tiny_tables[1, "tp"]), "mode": "tp"})


def test_tables_for_another_mode_refuse_to_start(engine_config, tiny_tables):
    with pytest.raises(SemMoEConfigError, match=r"were solved for mode 'tp', the engine runs mode 'dp': re-solve "
                                                r"with `semmoe solve --mode dp` or serve with --mode tp"):
        engine_config({"tables": str(tiny_tables[2, "tp"]), "mode": "dp"},
                      data_parallel_size=2, enable_expert_parallel=True)


def test_tables_for_another_ep_size_refuse_to_start(engine_config, tiny_tables):
    with pytest.raises(SemMoEConfigError, match=r"EP size 4 \(running with 2\); solve tables for this model and EP "
                                                r"size \(semmoe solve --ep\)"):
        engine_config({"tables": str(tiny_tables[4, "dp"]), "mode": "dp"},
                      data_parallel_size=2, enable_expert_parallel=True)
    # the matching configuration starts
    config = engine_config({"tables": str(tiny_tables[2, "dp"]), "mode": "dp"},
                           data_parallel_size=2, enable_expert_parallel=True)
    assert config.parallel_config.data_parallel_size == 2


def test_tables_for_another_layer_count_refuse_to_start(engine_config, tmp_path):
    trace = synthetic_trace(num_layers=3, num_experts=32, top_k=4, vocab_size=6144, num_requests=20)
    build_tables(trace, get_policy("vanilla").solve(trace, 1)).save(tmp_path / "three_layers")
    with pytest.raises(SemMoEConfigError, match=r"MoE layers 3 \(model has 4\); solve tables for this model"):
        engine_config({"tables": str(tmp_path / "three_layers")})


def test_refused_server_start_is_one_line(tmp_path, tiny_tables):
    """``semmoe serve`` with a refused configuration exits non-zero at once with the reason in
    one line, and no traceback."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CACHE_ROOT=fresh_cache_root(tmp_path / "cache"))
    result = subprocess.run(
        [sys.executable, "-m", "vllm_semmoe.cli", "serve", tiny_moe_path(), "--port", "1", "--enforce-eager",
         "--tables", str(tiny_tables[1, "dp"]), "--mode", "dp"],
        capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [l for l in result.stderr.splitlines() if l.startswith("semmoe: error:")]
    assert len(errors) == 1 and "mode 'dp' routes requests over data-parallel ranks" in errors[0], result.stderr[-3000:]


def test_loading_the_plugin_leaves_sys_excepthook_alone():
    """Only ``semmoe serve`` turns refusals into one line; a program that loads vLLM (and with it
    the plugin) keeps its own ``sys.excepthook``."""
    code = ("import sys; hook = sys.excepthook; from vllm_semmoe.vllm_adapter.plugin import register; register(); "
            "sys.exit(0 if sys.excepthook is hook else 3)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]


# ---- help --------------------------------------------------------------------------------------
def _subcommands():
    from vllm_semmoe.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return {name: p for name, p in sub.choices.items() if name != "serve"}


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_every_option_has_help_and_shows_its_default(capsys, command):
    parser = _subcommands()[command]
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    text = "".join(capsys.readouterr().out.split())  # argparse wraps lines, also at hyphens
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        option = action.option_strings[0]
        assert action.help, f"semmoe {command} {option} has no help text"
        assert option in text
        if action.required:
            assert "".join(f"{action.help} (required)".split()) in text, option
        elif action.default is not None and action.default is not False:
            shown = "".join(parser.formatter_class("x")._get_help_string(action).split()) % {"default": action.default}
            assert shown in text and "default" in shown, (option, shown)


def test_serve_help_lists_its_options_and_points_to_vllm():
    result = subprocess.run([sys.executable, "-m", "vllm_semmoe.cli", "serve", "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    for option, default in (("--tables DIR", None), ("--mode", "(default: placement-only)"), ("--capture PATH", None),
                            ("--dp-slack S", "(default: 8.0)"), ("--dp-balance B", f"(default: {scheduling.DEFAULT_DP_BALANCE})"),
                            ("--dp-price-step P", f"(default: {scheduling.DEFAULT_DP_PRICE_STEP})"),
                            ("--dp-decode-weight W", "(default: 128.0)")):
        assert option in text and (default is None or default in text), option
    assert "`vllm serve --help`" in text and "python -m vllm.entrypoints.cli.main serve --help" in text


@pytest.mark.parametrize("argv, message", [
    (["M", "--dp-slack", "abc"], "semmoe serve: --dp-slack expects a number, got 'abc'"),
    (["M", "--dp-balance=x"], "semmoe serve: --dp-balance expects a number, got 'x'"),
    (["M", "--mode", "ep"], "semmoe serve: --mode must be one of placement-only, tp, dp, got 'ep'"),
    (["M", "--tables"], "semmoe serve: --tables needs a value"),
    (["M", "--additional-config", "{oops"], "semmoe serve: --additional-config must be a JSON object, got '{oops'"),
])
def test_serve_option_errors_are_one_line(argv, message):
    from vllm_semmoe.cli import serve_command

    with pytest.raises(SystemExit) as exit_info:
        serve_command(argv)
    assert str(exit_info.value.code) == message


def test_demo_checks_ep_before_profiling(capsys):
    line = _cli_error(capsys, ["demo", "--ep", "3"])
    assert line == "semmoe: error: --ep 3 does not divide the 32 experts per layer evenly; choose one of 1, 2, 4, 8, 16, 32"


# ---- count options: the sub-command's own usage error -----------------------------------------
@pytest.mark.parametrize("argv, option, value", [
    (["solve", "--trace", "t.npz", "--ep", "0", "--out", "t"], "--ep", "0"),
    (["eval", "--profile", "t.npz", "--ep", "-2"], "--ep", "-2"),
    (["cost", "--trace", "t.npz", "--ep", "0"], "--ep", "0"),
    (["demo", "--ep", "0"], "--ep", "0"),
    (["bench-ep", "--trace", "t.npz", "--ranks", "0"], "--ranks", "0"),
    (["bench-serve", "--concurrency", "0"], "--concurrency", "0"),
    (["import", "x.pt", "--out", "x.npz", "--num-experts", "x"], "--num-experts", "x"),
])
def test_count_option_below_one_is_the_sub_commands_error(capsys, argv, option, value):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: semmoe {argv[0]} "), err
    assert err.splitlines()[-1] == (f"semmoe {argv[0]}: error: argument {option}: expected an integer >= 1, "
                                    f"got '{value}'")


def test_every_integer_option_is_range_checked():
    """No sub-command takes a bare ``type=int``: counts and sizes go through one validator."""
    bare = [f"semmoe {name} {action.option_strings[0]}" for name, parser in _subcommands().items()
            for action in parser._actions if action.type is int]
    assert bare == []


# ---- semmoe report: inputs it cannot draw -------------------------------------------------------
@pytest.fixture(scope="module")
def eval_json(traces, tmp_path_factory):
    """A real ``semmoe eval --json`` output (DP mode, so every figure field is present)."""
    path = tmp_path_factory.mktemp("eval_json") / "eval.json"
    assert main(["eval", "--profile", str(traces[32]), "--ep", "4", "--mode", "dp", "--method", "vanilla",
                 "--json", str(path)]) == 0
    return json.loads(path.read_text())


@pytest.mark.parametrize("field, value, message", [
    ("methods.vanilla.lar", "0.5", "field methods.vanilla.lar must be a number, got '0.5'"),
    ("ep", 0, "field ep must be an integer >= 1, got 0"),
    ("methods.vanilla.lar_per_layer", [0.5, "x"], "field methods.vanilla.lar_per_layer[1] must be a number, got 'x'"),
    ("methods.vanilla.rank_load_curve.requests", [1], "field methods.vanilla.rank_load_curve.requests must be a list"),
])
def test_report_names_the_file_and_the_field_it_cannot_draw(capsys, eval_json, tmp_path, field, value, message):
    data = json.loads(json.dumps(eval_json))
    *parents, key = field.split(".")
    node = data
    for part in parents:
        node = node[part]
    node[key] = value
    (tmp_path / "in").mkdir()
    path = tmp_path / "in" / "eval.json"
    path.write_text(json.dumps(data))
    line = _cli_error(capsys, ["report", "--from", str(tmp_path / "in"), "--out", str(tmp_path / "r")])
    assert line.startswith(f"semmoe: error: {path}: {message}") and "`semmoe eval --json`" in line, line


@pytest.mark.parametrize("key, value, message", [
    ("total_us", "12", "field rows[1].total_us must be a number, got '12'"),
    ("batch_tokens", 0, "field rows[1].batch_tokens must be an integer >= 1, got 0"),
    ("hardware", None, "field rows[1].hardware must be a string, got None"),
])
def test_report_names_the_cost_grid_row_it_cannot_draw(capsys, tmp_path, key, value, message):
    row = {"mode": "tp", "method": "vanilla", "redundant": 0, "hardware": "pplx-1node", "calibrated": True,
           "batch_tokens": 128, "hidden": 2048, "total_us": 10.0, "time_ratio_vs_vanilla": 1.0}
    bad = {**row, "method": "semmoe", "total_us": 9.0, "time_ratio_vs_vanilla": 0.9}
    bad[key] = value
    (tmp_path / "in").mkdir()
    path = tmp_path / "in" / "grid.json"
    path.write_text(json.dumps({"ep": 8, "rows": [row, bad]}))
    line = _cli_error(capsys, ["report", "--from", str(tmp_path / "in"), "--out", str(tmp_path / "r")])
    assert line.startswith(f"semmoe: error: {path}: {message}") and "`semmoe cost --grid --json`" in line, line


def test_report_refuses_unreadable_json_naming_it(capsys, eval_json, tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "eval.json").write_text(json.dumps(eval_json))
    broken = tmp_path / "in" / "notes.json"
    broken.write_text('{"methods": ')
    line = _cli_error(capsys, ["report", "--from", str(tmp_path / "in"), "--out", str(tmp_path / "r")])
    assert line.startswith(f"semmoe: error: {broken}: not readable JSON (") and "remove it from --from" in line
    assert not (tmp_path / "r").exists()


# ---- semmoe import: files that are not what it reads -------------------------------------------
def test_import_says_what_a_refused_file_is_and_what_was_expected(capsys, tmp_path, traces):
    import fractions
    import pickle

    import torch

    (tmp_path / "notes.txt").write_text("hello\n")
    np.save(tmp_path / "array.npy", np.zeros(3))
    (tmp_path / "plain.pkl").write_bytes(pickle.dumps({"records": []}, protocol=4))
    torch.save({"records": [fractions.Fraction(1, 3)]}, tmp_path / "objects.pt")
    cases = {"notes.txt": "not a readable torch.save file (a text file)",
             "array.npy": "not a readable torch.save file (a NumPy .npy array)",
             "plain.pkl": "not a readable torch.save file (a Python pickle)",
             str(traces[32]): "not a readable torch.save file (a NumPy .npz archive)",
             "objects.pt": "a torch.save file holding Python objects (fractions.Fraction) besides tensors"}
    for name, what in cases.items():
        path = tmp_path / name
        line = _cli_error(capsys, ["import", str(path), "--out", str(tmp_path / "x.npz")])
        assert line.startswith(f"semmoe: error: {path}: {what}"), line
        assert line.endswith("; expected saved vLLM routed experts (vllm_semmoe.tools.interop.save_vllm_routed_experts) "
                             "or an SGLang per_token dump (expert_distribution_recorder_*.pt)"), line
        assert "weights_only" not in line  # torch's advice to unpickle untrusted files is not repeated
