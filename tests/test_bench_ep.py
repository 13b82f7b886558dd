"""The expert-parallel MoE-layer benchmark (``vllm_semmoe.tools.bench_ep``): real processes, real bytes.

Small runs (2 and 4 gloo ranks, hidden 64, a few layers and batches of the real DeepSeek
trace) check that what is measured is what the routing implies, that every byte sent is
received, that Sem-MoE moves fewer bytes than vanilla, and the JSON the CLI writes.
"""

import argparse
import json
import os

import numpy as np
import pytest

from vllm_semmoe.tools import bench_ep
from vllm_semmoe.tools.bench_ep import BenchEPError, analytic_counts, format_bench_ep, plan_bench_ep, run_bench_ep
from vllm_semmoe.core.schedulers import sample_steps
from vllm_semmoe.core.trace import first_layers
from vllm_semmoe.cli.bench import add_bench_ep_arguments, cmd_bench_ep
from vllm_semmoe.evaluation.evaluate import EvalConfig, compare_methods
from vllm_semmoe.core.trace import TraceError

from shared_fixtures import serving_by_hand

SMALL = dict(hidden=64, expert_dim=16, batch_tokens=128, max_batches=3)
ELEM = 2  # bfloat16 on the wire


def _spawned_children():
    """Live child processes of this test process started by multiprocessing's spawn."""
    kids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and b"spawn_main" in cmd:
            kids.append(int(pid))
    return kids


@pytest.fixture(scope="module")
def tp2(dev_trace_path, tmp_path_factory):
    """2 ranks, TP, through the CLI helper with --json."""
    out = tmp_path_factory.mktemp("bench_ep") / "tp2.json"
    parser = add_bench_ep_arguments(argparse.ArgumentParser())
    args = parser.parse_args([
        "--trace", str(dev_trace_path), "--ranks", "2", "--mode", "tp", "--methods", "vanilla,semmoe",
        "--hidden", "64", "--expert-dim", "16", "--batch-tokens", "128", "--max-batches", "3",
        "--layers", "4", "--json", str(out),
    ])
    assert cmd_bench_ep(args) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def dp4(dev_trace_path):
    return run_bench_ep(dev_trace_path, 4, "dp", ["vanilla", "eplb", "semmoe"], layers=3, **SMALL)


@pytest.fixture(scope="module")
def tp4(dev_trace_path):
    return run_bench_ep(dev_trace_path, 4, "tp", ["vanilla", "semmoe"], layers=6,
                        **dict(SMALL, max_batches=4))


@pytest.fixture(scope="module")
def tp4_r1(dev_trace_path):
    """tp4 with one replica slot per rank for semmoe (vanilla keeps R = 0)."""
    return run_bench_ep(dev_trace_path, 4, "tp", ["vanilla", "semmoe"], layers=6, redundant=1,
                        **dict(SMALL, max_batches=4))


@pytest.fixture(scope="module")
def dp4_r1(dev_trace_path):
    return run_bench_ep(dev_trace_path, 4, "dp", ["vanilla", "semmoe"], layers=3, redundant=1, **SMALL)


def _expected_step_rows(plan, method):
    """``[S, L, E, E]`` rows each rank must dispatch to each other rank in each step, counted
    token by token (no NumPy tricks), from the placement's copies and the serving rule restated
    by hand."""
    rows_idx, offsets = plan.step_rows[method]
    dev = plan.step_device[method]
    serving = serving_by_hand(plan.placements[method].expert_device, plan.placements[method].holds(),
                              plan.experts[rows_idx], dev)
    L, E = plan.num_layers, plan.ranks
    rows = np.zeros((len(offsets) - 1, L, E, E), np.int64)
    for s in range(len(offsets) - 1):
        for p in range(offsets[s], offsets[s + 1]):
            for layer in range(L):
                home = int(dev[p, layer])
                for dst in {int(r) for r in serving[p, layer]} - {home}:
                    rows[s, layer, home, dst] += 1
    return rows


def _expected_rows(plan, method):
    """``[L, E, E]``: :func:`_expected_step_rows` over all steps."""
    return _expected_step_rows(plan, method).sum(axis=0)


def _local_by_hand(plan, method):
    """Activations whose expert has a copy on the token's rank."""
    rows_idx, _ = plan.step_rows[method]
    dev = plan.step_device[method]
    holds = plan.placements[method].holds()
    return sum(bool(holds[layer, e, dev[p, layer]]) for p, row in enumerate(rows_idx)
               for layer in range(plan.num_layers) for e in plan.experts[row, layer])


@pytest.mark.parametrize("run", ["tp2", "dp4", "tp4", "tp4_r1", "dp4_r1"])
def test_every_byte_sent_is_received(run, request):
    result = request.getfixturevalue(run)
    E = result["ranks"]
    for name, row in result["methods"].items():
        sent, recv = np.array(row["dispatch_matrix"]), np.array(row["dispatch_recv_matrix"])
        back, back_recv = np.array(row["combine_matrix"]), np.array(row["combine_recv_matrix"])
        assert sent.shape == (E, E) and np.all(np.diag(sent) == 0) and np.all(np.diag(back) == 0)
        assert np.array_equal(sent, recv), name  # what src sends to dst is what dst receives from src
        assert np.array_equal(back, back_recv), name
        assert np.array_equal(back, sent.T), name  # one partial sum returns for every row received
        assert row["dispatch_bytes"] == sent.sum() == row["combine_bytes"]
        assert row["total_bytes"] == row["dispatch_bytes"] + row["combine_bytes"]
        assert sum(row["bytes_per_layer"]) == row["total_bytes"]
        assert row["conservation_ok"] and row["analytic_match"]


@pytest.mark.parametrize("run, mode, ranks, methods, kwargs", [
    ("tp2", "tp", 2, ["vanilla", "semmoe"], dict(layers=4, batch_tokens=128, max_batches=3)),
    ("dp4", "dp", 4, ["vanilla", "eplb", "semmoe"], dict(layers=3, batch_tokens=128, max_batches=3)),
    ("tp4_r1", "tp", 4, ["vanilla", "semmoe"], dict(layers=6, batch_tokens=128, max_batches=4, redundant=1)),
    ("dp4_r1", "dp", 4, ["vanilla", "semmoe"], dict(layers=3, batch_tokens=128, max_batches=3, redundant=1)),
])
def test_measured_bytes_equal_the_routing(run, mode, ranks, methods, kwargs, request, dev_trace_path):
    """The bytes the ranks handed to all_to_all_single are exactly what the routing implies."""
    result = request.getfixturevalue(run)
    plan = plan_bench_ep(dev_trace_path, ranks, mode, methods, **kwargs)
    for name in methods:
        rows = _expected_rows(plan, name)
        row = result["methods"][name]
        assert np.array_equal(np.array(row["dispatch_matrix"]), rows.sum(axis=0) * result["hidden"] * ELEM), name
        assert row["remote_pairs"] == rows.sum()
        received = _expected_step_rows(plan, name).sum(axis=2) * result["hidden"] * ELEM  # [S, L, dst]
        assert row["step_match"], name
        assert row["straggler_recv_bytes"] == pytest.approx(received.max(axis=2).mean()), name
        assert row["straggler_recv_ratio"] == pytest.approx(received.max(axis=2).sum() / received.mean(axis=2).sum())
        assert row["bytes_per_layer"] == list(2 * rows.sum(axis=(1, 2)) * result["hidden"] * ELEM)
        counts = analytic_counts(plan, name)
        assert row["lar"] == pytest.approx(counts["local"] / counts["activations"])
        assert counts["local"] == _local_by_hand(plan, name)
        assert row["tokens"] == counts["tokens"] == plan.step_rows[name][1][-1]


def test_semmoe_moves_fewer_bytes_than_vanilla(tp4, dp4):
    for result in (tp4, dp4):
        van, sem = result["methods"]["vanilla"], result["methods"]["semmoe"]
        assert van["tokens"] == sem["tokens"]
        assert sem["total_bytes"] < van["total_bytes"], result["mode"]
        assert sem["bytes_ratio_vs_vanilla"] < 1.0 and sem["lar"] > van["lar"]
        assert sem["activation_ratio_vs_vanilla"] < 1.0
    assert tp4["methods"]["semmoe"]["bytes_ratio_vs_vanilla"] < 0.9


def test_output_matches_single_process_reference(tp2, dp4, tp4, tp4_r1, dp4_r1):
    for result in (tp2, dp4, tp4, tp4_r1, dp4_r1):
        for row in result["methods"].values():
            assert 0.0 < row["check_max_rel_err"] < bench_ep.CHECK_TOL  # bf16 rounding, not zero: computed


def test_json_fields_and_table(tp2):
    for key in ("mode", "ranks", "hidden", "batches", "layers", "backend", "methods"):
        assert key in tp2
    assert (tp2["mode"], tp2["ranks"], tp2["hidden"], tp2["layers"], tp2["batches"]) == ("tp", 2, 64, 4, 3)
    assert tp2["backend"] == "gloo"
    fields = ("dispatch_bytes", "combine_bytes", "total_bytes", "bytes_per_token", "bytes_ratio_vs_vanilla",
              "layer_ms", "time_ratio_vs_vanilla", "lar", "remote_pairs")
    for name in ("vanilla", "semmoe"):
        row = tp2["methods"][name]
        for key in fields:
            assert row[key] is not None, (name, key)
        assert row["layer_ms"] > 0
    assert tp2["methods"]["vanilla"]["bytes_ratio_vs_vanilla"] == 1.0
    assert tp2["methods"]["vanilla"]["time_ratio_vs_vanilla"] == 1.0
    table = format_bench_ep(tp2)
    assert "vanilla" in table and "semmoe" in table and "bytes_x" in table


def test_replicas_make_activations_local_and_move_fewer_bytes(tp4, tp4_r1, dp4, dp4_r1):
    """One replica slot per rank (chosen on the profile for locality): more activations are
    computed on the token's own rank and fewer bytes cross ranks, for the same tokens; each
    rank holds one more expert per layer; vanilla (no replication) is unchanged."""
    for r0, r1 in ((tp4, tp4_r1), (dp4, dp4_r1)):
        van0, van1 = r0["methods"]["vanilla"], r1["methods"]["vanilla"]
        sem0, sem1 = r0["methods"]["semmoe"], r1["methods"]["semmoe"]
        assert van1["total_bytes"] == van0["total_bytes"] and van1["redundant"] == 0
        assert (sem0["redundant"], sem1["redundant"]) == (0, 1)
        assert (sem0["experts_per_rank"], sem1["experts_per_rank"]) == (16, 17)  # 64 experts / 4 ranks (+1)
        assert sem1["tokens"] == sem0["tokens"]
        assert sem1["lar"] > sem0["lar"] + 0.01, r1["mode"]
        assert sem1["total_bytes"] < sem0["total_bytes"], r1["mode"]


def test_no_rank_process_left(tp2, dp4, tp4):
    if not os.path.isdir("/proc"):
        pytest.skip("needs /proc")
    assert _spawned_children() == []


def test_plan_lar_equals_offline_evaluation(dev_trace):
    """With all batches, the benchmark's schedule is evaluate's: same LAR to the last activation,
    with and without replicas."""
    trace = first_layers(dev_trace.select_requests(np.arange(120)), 3)
    methods = ["vanilla", "semmoe"]
    for mode in ("tp", "dp"):
        for R in (0, 1):
            plan = plan_bench_ep(trace, 4, mode, methods, batch_tokens=128, redundant=R)
            profile, rest = trace.split(0.2, 0)
            rows = compare_methods(profile, rest, 4, methods, EvalConfig(mode=mode, batch_tokens=128), redundant=R)
            for name in methods:
                counts = analytic_counts(plan, name)
                assert counts["tokens"] == rest.num_tokens
                assert counts["local"] / counts["activations"] == pytest.approx(rows[name]["lar"], abs=1e-12), \
                    (mode, R, name)


def test_plan_schedules_with_the_given_dp_knobs(dev_trace):
    """``config`` carries other DP knobs into the replay's schedule: the plan's LAR is the
    offline evaluation's at those knobs, and differs from the default knobs' plan."""
    trace = first_layers(dev_trace.select_requests(np.arange(160)), 3)
    profile, rest = trace.split(0.2, 0)
    lar = {}
    for knobs in ((EvalConfig.dp_balance, EvalConfig.dp_price_step), (1024.0, 1.0)):
        config = EvalConfig(mode="dp", batch_tokens=128, dp_balance=knobs[0], dp_price_step=knobs[1])
        plan = plan_bench_ep(trace, 4, "dp", ["semmoe"], batch_tokens=128, config=config)
        counts = analytic_counts(plan, "semmoe")
        lar[knobs] = counts["local"] / counts["activations"]
        expected = compare_methods(profile, rest, 4, ["semmoe"], config)["semmoe"]["lar"]
        assert lar[knobs] == pytest.approx(expected, abs=1e-12), knobs
    assert len(set(lar.values())) == 2


def test_sample_steps():
    assert sample_steps(10, None).tolist() == list(range(10))
    assert sample_steps(10, 20, "spread").tolist() == list(range(10))
    assert sample_steps(10, 3).tolist() == [0, 1, 2]
    assert sample_steps(10, 3, "spread").tolist() == [0, 4, 9]
    spread = sample_steps(1000, 20, "spread")
    assert len(spread) == 20 and spread[0] == 0 and spread[-1] == 999 and (np.diff(spread) >= 52).all()


def test_max_batches_replays_the_whole_runs_steps(dev_trace):
    """``max_batches`` keeps steps of the whole run as they are: the first ones (head), or
    ones spread from the first step to the last (spread), each with the tokens, ranks and
    serving ranks the whole run gives it."""
    trace = first_layers(dev_trace.select_requests(np.arange(200)), 3)
    methods = ["vanilla", "semmoe"]
    for mode in ("tp", "dp"):
        full = plan_bench_ep(trace, 4, mode, methods, batch_tokens=128)
        for sample in ("head", "spread"):
            plan = plan_bench_ep(trace, 4, mode, methods, batch_tokens=128, max_batches=6, sample=sample)
            for m in methods:
                rows_f, off_f = full.step_rows[m]
                rows, off = plan.step_rows[m]
                steps = sample_steps(len(off_f) - 1, 6, sample)
                assert plan.num_steps(m) == 6 and len(off_f) - 1 > 30, (mode, m)
                if sample == "spread":
                    assert steps[-1] == len(off_f) - 2
                for i, s in enumerate(steps):
                    mine, theirs = slice(off[i], off[i + 1]), slice(off_f[s], off_f[s + 1])
                    assert np.array_equal(plan.token_gid[rows[mine]], full.token_gid[rows_f[theirs]]), (mode, m, i)
                    assert np.array_equal(plan.step_device[m][mine], full.step_device[m][theirs])
                    assert np.array_equal(plan.step_serving[m][mine], full.step_serving[m][theirs])
    with pytest.raises(ValueError, match="sample must be one of head, spread"):
        plan_bench_ep(trace, 4, "dp", methods, batch_tokens=128, max_batches=6, sample="tail")


def test_missing_trace_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope.npz"
    with pytest.raises(TraceError, match="not found"):
        run_bench_ep(missing, 2, "tp", ["vanilla"])
    args = add_bench_ep_arguments(argparse.ArgumentParser()).parse_args(["--trace", str(missing), "--ranks", "2"])
    with pytest.raises(SystemExit, match="not found"):
        cmd_bench_ep(args)


def test_bad_arguments_fail_before_spawning(dev_trace_path):
    with pytest.raises(ValueError, match="mode"):
        run_bench_ep(dev_trace_path, 2, "pp", ["vanilla"], max_batches=1, layers=1)
    with pytest.raises(ValueError, match="split evenly"):
        run_bench_ep(dev_trace_path, 3, "tp", ["vanilla"], max_batches=1, layers=1)
    with pytest.raises(ValueError, match="unknown placement method"):
        run_bench_ep(dev_trace_path, 2, "tp", ["nope"], max_batches=1, layers=1)
    with pytest.raises(ValueError, match="redundant slots per device exceed"):
        run_bench_ep(dev_trace_path, 2, "tp", ["semmoe"], redundant=40, max_batches=1, layers=1)
    with pytest.raises(BenchEPError, match="nccl"):
        run_bench_ep(dev_trace_path, 64, "tp", ["vanilla"], backend="nccl", max_batches=1, layers=1)
