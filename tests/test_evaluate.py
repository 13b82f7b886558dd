import json
import os

import pytest

from vllm_semmoe.evaluation.evaluate import EvalConfig, compare_methods, evaluate
from vllm_semmoe.core.policy import get_policy
from vllm_semmoe.core.tables import build_tables


@pytest.fixture(scope="module")
def split(small_trace):
    return small_trace.split(0.3, seed=0)


def test_vanilla_default_scheduling_is_one_over_e(split):
    profile, trace = split
    for mode in ("tp", "dp"):
        row = evaluate(trace, get_policy("vanilla").solve(profile, 8), None, EvalConfig(mode=mode))
        assert abs(row["lar"] - 0.125) < 0.01
        assert row["lar"] <= row["oracle_lar"] and 0 < row["lar_token"] <= 1


def test_tp_slices_are_equal(split):
    profile, trace = split
    placement = get_policy("semmoe").solve(profile, 8)
    row = evaluate(trace, placement, build_tables(profile, placement), EvalConfig(mode="tp", batch_tokens=256))
    # the last batch of a trace may hold fewer than E tokens per device; all others are exact
    assert row["imbalance"] < 1.01
    assert row["lar"] <= row["oracle_lar"]


def test_semmoe_beats_the_baselines_on_real_routing(split):
    profile, trace = split
    rows = compare_methods(profile, trace, 8, ["vanilla", "eplb", "moetuner", "semmoe"], EvalConfig(mode="tp"))
    assert rows["semmoe"]["lar"] > 1.5 * rows["eplb"]["lar"]
    assert rows["semmoe"]["lar_with_semmoe_sched"] > rows["eplb"]["lar_with_semmoe_sched"]
    assert rows["semmoe"]["a2a_ratio"] < 0.9 and rows["vanilla"]["a2a_ratio"] == 1.0
    assert set(rows["semmoe"]) >= {"lar", "lar_token", "oracle_lar", "a2a_ratio", "imbalance",
                                   "expert_imbalance", "solve_s", "lar_with_semmoe_sched"}


def test_bad_mode(split):
    profile, trace = split
    with pytest.raises(ValueError, match="mode must be"):
        evaluate(trace, get_policy("vanilla").solve(profile, 8), None, EvalConfig(mode="ep"))


def test_dp_reports_lock_step_balance_beside_the_references(split):
    import numpy as np

    from vllm_semmoe.core import scheduling

    profile, trace = split
    placement = get_policy("semmoe").solve(profile, 8, mode="dp")
    config = EvalConfig(mode="dp", dp_window=32, dp_decode_weight=64.0)
    row = evaluate(trace, placement, build_tables(profile, placement, mode="dp"), config)
    work = scheduling.request_work(np.diff(trace.offsets), 64.0)
    least = scheduling.least_loaded_assign(work, 8, 32)
    assert row["window_imbalance_least_loaded"] == pytest.approx(scheduling.window_imbalance(least, work, 8, 32))
    assert row["window_imbalance_round_robin"] >= 1.0 and row["request_imbalance"] >= 1.0
    # the default knob keeps the windows about as balanced as the locality-blind balancer
    assert row["window_imbalance"] <= 1.10 * row["window_imbalance_least_loaded"]


def test_aggregate_seeds_mean_sd_per_seed():
    from vllm_semmoe.evaluation.evaluate import aggregate_seeds

    out = aggregate_seeds([{"a": {"lar": 0.3}}, {"a": {"lar": 0.5}}])
    assert out["a"]["lar"]["mean"] == pytest.approx(0.4)
    assert out["a"]["lar"]["sd"] == pytest.approx(0.1414213562)
    assert out["a"]["lar"]["per_seed"] == [0.3, 0.5]


def test_replication_raises_lar_and_serves_every_activation_once(split):
    import numpy as np

    profile, trace = split
    rows = {R: compare_methods(profile, trace, 8, ["semmoe"], EvalConfig(mode="tp"), redundant=R)["semmoe"]
            for R in (0, 1)}
    assert rows[1]["lar"] > rows[0]["lar"] + 0.01
    assert rows[0]["experts_per_device"] == 8 and rows[1]["experts_per_device"] == 9
    placement = get_policy("semmoe").solve(profile, 8, redundant=1)
    device = np.random.default_rng(0).integers(0, 8, (trace.num_tokens, trace.num_layers))
    serving = placement.serving_device(trace.experts, device)  # every activation served once, by a holder
    held = placement.holds()[np.arange(trace.num_layers)[None, :, None], trace.experts.astype(np.int64), serving]
    assert held.all()
    assert np.array_equal(serving == device[:, :, None],
                          placement.holds()[np.arange(trace.num_layers)[None, :, None], trace.experts.astype(np.int64),
                                            device[:, :, None]])


def test_placement_cache_returns_the_same_placement(split, tmp_path):
    import numpy as np

    from vllm_semmoe.evaluation.evaluate import placement_cache

    profile, _ = split
    cache = placement_cache(str(tmp_path))
    calls = []

    def solve():
        calls.append(1)
        return get_policy("semmoe").solve(profile, 8, redundant=1)

    a = cache("k", solve)
    b = cache("k", solve)
    assert len(calls) == 1
    np.testing.assert_array_equal(a.physical_to_logical(), b.physical_to_logical())


def test_cli_eval_seeds_redundant_and_dp_curve(small_trace, tmp_path, capsys):
    import json

    from vllm_semmoe.cli import main

    path = tmp_path / "small.npz"
    small_trace.save(path)
    out = tmp_path / "e.json"
    assert main(["eval", "--profile", str(path), "--profile-frac", "0.3", "--seeds", "0,1", "--mode", "dp",
                 "--method", "vanilla,semmoe", "--redundant", "1", "--dp-balance-curve", "0,1",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "±" in printed and "window_imbalance_least_loaded" in printed and "balance=1" in printed
    payload = json.loads(out.read_text())
    assert payload["seeds"] == [0, 1] and payload["redundant"] == 1
    lar = payload["methods"]["semmoe"]["lar"]
    assert set(lar) == {"mean", "sd", "per_seed"} and len(lar["per_seed"]) == 2
    assert payload["methods"]["semmoe"]["redundant"]["mean"] == 1
    assert payload["methods"]["vanilla"]["redundant"]["mean"] == 0
    for key in ("window_imbalance", "window_imbalance_least_loaded", "window_imbalance_round_robin",
                "request_imbalance"):
        assert len(payload["methods"]["semmoe"][key]["per_seed"]) == 2
    assert set(payload["dp_curve"]) == {"balance=0", "balance=1"}
    assert main(["solve", "--trace", str(path), "--ep", "8", "--redundant", "2", "--out", str(tmp_path / "t")]) == 0
    assert "2 redundant slot(s) per device (10 physical experts per rank)" in capsys.readouterr().out


@pytest.mark.parametrize("history", ["experts", "devices"])
def test_layers_on_threads_decide_as_one_thread(split, monkeypatch, history):
    """The TP evaluation decides layers on parallel threads (``EvalConfig.threads``): every
    token's device at every layer, and so every figure, equals the single-thread evaluation."""
    import vllm_semmoe.core.schedulers as ev

    profile, trace = split
    placement = get_policy("semmoe").solve(profile, 8)
    tables = build_tables(profile, placement)
    runs, original = {}, ev.for_each_layer
    for threads in (4, 1):
        used = []
        monkeypatch.setattr(ev, "for_each_layer", lambda L, work, n, used=used: (used.append(n), original(L, work, n)))
        runs[threads] = ev.tp_devices(trace, tables, 8, EvalConfig(mode="tp", tp_history=history, threads=threads))
        assert used == [threads]
    assert (runs[4][0] == runs[1][0]).all() and runs[4][1] == runs[1][1]
    assert ev.layer_threads(None, 26) == min(len(os.sched_getaffinity(0)), ev.MAX_LAYER_THREADS)
    assert ev.layer_threads(16, 3) == 3 and ev.layer_threads(0, 3) == 1


SEEDS = [0, 1, 2, 3, 4]


def test_no_seed_split_uses_the_tuning_split(dev_trace):
    """The tuning split (the requests the knobs are chosen on) is in no seed's profile or
    evaluation set; the profile keeps its share of the whole trace, the evaluation the rest."""
    from vllm_semmoe.core.trace import TUNING_FRAC, TraceError

    R = dev_trace.num_requests
    tuning = set(dev_trace.request_ids[dev_trace.tuning_requests()])
    assert len(tuning) == round(TUNING_FRAC * R) and len(set(dev_trace.request_ids)) == R
    carved, rest = dev_trace.tuning_split()
    assert set(carved.request_ids) == tuning and tuning.isdisjoint(rest.request_ids)
    assert carved.num_tokens + rest.num_tokens == dev_trace.num_tokens
    for seed in SEEDS:
        profile, held_out = dev_trace.split(0.2, seed, hold_out_tuning=True)
        assert tuning.isdisjoint(profile.request_ids) and tuning.isdisjoint(held_out.request_ids)
        assert set(profile.request_ids).isdisjoint(held_out.request_ids)
        assert profile.num_requests == round(0.2 * R)
        assert profile.num_requests + held_out.num_requests == rest.num_requests
    with pytest.raises(TraceError, match="outside the tuning split"):
        dev_trace.split(1 - TUNING_FRAC / 2, 0, hold_out_tuning=True)


def test_compare_seeds_profiles_and_evaluates_outside_the_tuning_split(dev_trace):
    """``compare_seeds`` (the acceptance figures) solves on each seed's held-out profile (the
    solve cache sees its fingerprint) and evaluates exactly the rest outside the tuning split
    (the DP rank-load curve counts the evaluated requests and tokens)."""
    from vllm_semmoe.evaluation.evaluate import compare_seeds

    keys = []

    def cache(key, solve):
        keys.append(key)
        return solve()

    rows = compare_seeds(dev_trace, 0.2, SEEDS, 8, ["vanilla"], EvalConfig(mode="dp"), solve_cache=cache)
    curves = rows["vanilla"]["rank_load_curve"]["per_seed"]
    assert len(keys) == len(curves) == len(SEEDS)
    for seed, key, curve in zip(SEEDS, keys, curves):
        profile, held_out = dev_trace.split(0.2, seed, hold_out_tuning=True)
        assert profile.fingerprint() in key
        assert curve["requests"][-1] == held_out.num_requests and sum(curve["tokens"][-1]) == held_out.num_tokens


def test_cli_eval_holds_out_the_tuning_split_and_says_so(dev_trace, dev_trace_path, tmp_path, capsys):
    from vllm_semmoe.cli import main

    _, rest = dev_trace.tuning_split()
    base = ["eval", "--profile", str(dev_trace_path), "--profile-frac", "0.2", "--mode", "dp", "--method", "vanilla"]
    out = tmp_path / "one.json"
    assert main([*base, "--seed", "3", "--json", str(out)]) == 0
    assert "tuning split (the requests the knobs were chosen on) is held out" in capsys.readouterr().out
    payload = json.loads(out.read_text())
    assert payload["tuning_split_held_out"] is True
    assert payload["profile_tokens"] + payload["eval_tokens"] == rest.num_tokens
    assert main([*base, "--seeds", "0,1", "--json", str(out)]) == 0
    for seed, curve in zip((0, 1), json.loads(out.read_text())["methods"]["vanilla"]["rank_load_curve"]["per_seed"]):
        assert sum(curve["tokens"][-1]) == dev_trace.split(0.2, seed, hold_out_tuning=True)[1].num_tokens
    assert main([*base, "--seed", "3", "--no-hold-out-tuning", "--json", str(out)]) == 0
    assert "NOT held out" in capsys.readouterr().out
    payload = json.loads(out.read_text())
    assert payload["profile_tokens"] + payload["eval_tokens"] == dev_trace.num_tokens


@pytest.mark.parametrize("method", ["vanilla", "semmoe"])
def test_capture_replay_is_evaluate_on_the_engine_steps(tmp_path, monkeypatch, method):
    """The capture summary's ``replayed`` figures are computed offline from the written capture:
    :func:`replay_capture` on an engine's segment (read in chunks of steps) equals ``evaluate``
    with one batch per step, as the engine scheduled them (Sem-MoE's scheduler with Sem-MoE's
    tables, vLLM's slices with a baseline's); under DP the engine's rank's local activations."""
    import numpy as np

    import vllm_semmoe.evaluation.evaluate as ev
    from vllm_semmoe.core.capture_store import SegmentWriter
    from vllm_semmoe.core.synthetic import synthetic_trace
    from vllm_semmoe.core.tables import device_counts

    trace = synthetic_trace(num_layers=4, num_experts=16, top_k=2, vocab_size=300, num_requests=30)
    tables = build_tables(trace, get_policy(method).solve(trace, 4))
    path = str(tmp_path / "cap.npz")
    for dp_rank in (0, 1):
        writer = SegmentWriter(path, num_layers=4, num_experts=16, top_k=2, vocab_size=300, dp_rank=dp_rank,
                               dp_size=2)
        for r in range(trace.num_requests):  # every request of the trace is one engine step
            rows = slice(trace.offsets[r], trace.offsets[r + 1])
            n = rows.stop - rows.start
            writer.append([f"r{r}"], [n], np.zeros(n, np.int64), np.arange(n), trace.tokens[rows],
                          trace.experts[rows])
        writer.close()
    monkeypatch.setattr(ev, "REPLAY_STEPS", 7)
    replayed = ev.replay_capture(path, tables)
    whole = evaluate(trace, tables.placement, tables if method == "semmoe" else None,
                     EvalConfig(mode="tp", batch_tokens=0))
    for key in ("lar", "lar_token", "oracle_lar", "imbalance", "expert_imbalance"):
        assert replayed[key] == pytest.approx(whole[key], rel=1e-9), key
    assert (replayed["steps"], replayed["tokens"]) == (trace.num_requests, trace.num_tokens)
    dp = ev.replay_capture(path, tables, dp_rank=1, dp_size=2)
    local = int(device_counts(trace.experts, tables.placement.expert_device, 4)[:, :, 2:].sum())
    assert (dp["local_activations"], dp["remote_activations"]) == (local, trace.experts.size - local)
    SegmentWriter(str(tmp_path / "empty.npz"), num_layers=4, num_experts=16, top_k=2, vocab_size=300).close()
    assert ev.replay_capture(str(tmp_path / "empty.npz"), tables) == {}  # no step yet
