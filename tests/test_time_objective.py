"""The time objective picks, per target, the candidate with the least modelled step time on a
part of the profile it was not solved on; what it picks is what the grid and ``solve`` serve."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vllm_semmoe.evaluation.cost_model import HARDWARE, layer_times, step_traffic, summarize, tp_decision_seconds
from vllm_semmoe.core.policy.eplb import served_by_vllm_eplb
from vllm_semmoe.evaluation.step_time import Target, schedule, serving_devices
from vllm_semmoe.evaluation.time_objective import VARIANTS, choose, cross_validation_folds, solve_variant

TARGETS = (Target("deepep-normal-2node", 2048), Target("deepep-ll-1node", 64))


@pytest.fixture(scope="module")
def profile(dev_trace):
    from vllm_semmoe.core.trace import first_layers

    return first_layers(dev_trace.select_requests(np.arange(160)), 3)


@pytest.fixture(scope="module")
def choices(profile):
    return choose(profile, 8, "tp", 1, TARGETS, seed=3)


def _time_by_hand(trace, placement, tables, target: Target) -> float:
    """The candidate's modelled step time, counted from the schedule with the cost model's
    primitives (not through :func:`vllm_semmoe.evaluation.step_time.stream_traffic`), plus the
    measured TP decision of every step where tables schedule the tokens."""
    idx, offsets, device, source = schedule(trace, placement, tables, "tp", target.batch_tokens)
    experts = source.experts[idx].astype(np.int64)
    serving = serving_devices(placement, experts, device, offsets)
    traffic = step_traffic(serving, device, offsets, placement.ep_size, experts=experts, node_groups=(2,))
    total = summarize(layer_times(traffic, target.shape, HARDWARE[target.hardware], "tp_shuffle"), traffic)["total_us"]
    if tables is not None:
        total += float(np.mean(tp_decision_seconds(np.diff(offsets)))) * 1e6
    return total


def test_each_target_gets_the_fastest_candidate_cross_validated(profile, choices):
    folds = cross_validation_folds(profile, 3)
    first, second = folds[0]
    assert first.num_requests + second.num_requests == profile.num_requests
    assert not set(first.request_ids.tolist()) & set(second.request_ids.tolist())
    assert folds[1][0] is second and folds[1][1] is first
    for target in TARGETS:
        c = choices[target]
        assert set(c.times_us) == set(VARIANTS)
        by_hand = {}
        for variant in VARIANTS:
            times = []
            for fit, check in ((first, second), (second, first)):
                placement, tables = solve_variant(variant, fit, 8, "tp", 1, seed=3)
                times.append(_time_by_hand(check, placement, tables, target))
            by_hand[variant] = float(np.mean(times))
        assert by_hand == pytest.approx(c.times_us, rel=1e-9)
        assert c.variant == min(by_hand, key=by_hand.get)


def test_variants_are_what_they_say(profile):
    for variant in VARIANTS:
        placement, tables = solve_variant(variant, profile, 8, "dp", 1, seed=0)
        assert (tables is not None) == (variant in ("locality", "balanced", "hot"))
        assert placement.redundant == (0 if variant == "stock" else 1)
        assert served_by_vllm_eplb(placement) == (variant == "eplb")
    with pytest.raises(ValueError, match="unknown variant 'greedy'"):
        solve_variant("greedy", profile, 8, "tp")


def test_solve_objective_time_writes_the_chosen_variant(dev_trace, tmp_path, capsys):
    from vllm_semmoe.cli import main
    from vllm_semmoe.core.tables import load_tables

    from vllm_semmoe.core.trace import first_layers

    trace = first_layers(dev_trace.select_requests(np.arange(120)), 2)
    path = tmp_path / "t.npz"
    trace.save(path)
    assert main(["solve", "--trace", str(path), "--ep", "8", "--objective", "time", "--hardware",
                 "deepep-normal-2node", "--batch-tokens", "2048", "--redundant", "1", "--out",
                 str(tmp_path / "tables"), "--json", str(tmp_path / "m.json")]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("time objective:"))
    variant = line.split(": ")[2].split(" (")[0]
    assert variant in VARIANTS
    manifest = json.loads((tmp_path / "m.json").read_text())
    method = {"locality": "semmoe", "balanced": "semmoe", "hot": "semmoe", "eplb": "eplb", "stock": "vanilla"}[variant]
    assert manifest["method"] == method
    assert manifest["redundant"] == (0 if variant == "stock" else 1)
    expected, _ = solve_variant(variant, trace, 8, "tp", 1, seed=0)
    assert np.array_equal(load_tables(tmp_path / "tables").placement.expert_device, expected.expert_device)


def test_hot_copies_go_to_the_heaviest_expert_per_copy_where_its_tokens_are():
    from vllm_semmoe.core.policy.semmoe import _hot_copies

    home = np.array([0, 0, 1, 1])
    # expert 0: 90 activations, 60 of them by device 1's units; expert 2: 50, 30 by device 0's
    use = np.array([[30, 5, 30, 1],
                    [60, 5, 20, 1]], float)
    out = _hot_copies(use, home, 1)
    # expert 0 (90 per copy) is copied first, onto device 1 (its only device without a copy);
    # then expert 2 (50) onto device 0, the one free slot left
    assert out.tolist() == [[2], [0]]
    # with two slots each: after 0 -> 1 and 2 -> 0, expert 0 has 45 per copy, 2 has 25: the next
    # heaviest expert with a free device is 3? no: 1 (10) and 3 (2) are lighter than 2's 25, but
    # 2 is already on both devices; so 1 -> device 1 (free, not home there), then 3 -> device 0
    out2 = _hot_copies(use, home, 2)
    assert sorted(out2[0].tolist()) == [2, 3] and sorted(out2[1].tolist()) == [0, 1]
