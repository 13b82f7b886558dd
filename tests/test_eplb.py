"""DeepSeek EPLB with redundant experts (``--method eplb --redundant R``) and how vLLM serves it."""

import json

import numpy as np
import pytest

from vllm_semmoe.evaluation.evaluate import EvalConfig, evaluate
from vllm_semmoe.core.schedulers import scheduled_devices
from vllm_semmoe.core.policy import get_policy
from vllm_semmoe.core.policy.eplb import (balanced_packing, expert_loads, load_imbalance, rank_loads, rank_rows,
                                     rebalance_experts, replicate_experts, to_placement, vllm_replica_index,
                                     vllm_serving_device)


def rank_sets(placement):
    """``[E]`` per layer: the set of experts each rank holds (home or replica)."""
    holds = placement.holds()
    return [[set(np.flatnonzero(holds[l, :, g])) for g in range(placement.ep_size)] for l in range(len(holds))]


def test_replicate_experts_gives_each_copy_to_the_largest_load_per_copy():
    # row 0: 10 -> 5 (2 copies) still beats 4 -> 3.33 (3 copies); row 1: 6 -> 3, then 5 beats 3
    phy2log, rank, logcnt = replicate_experts(np.array([[10.0, 4, 1, 1], [6, 5, 1, 0]]), 6)
    np.testing.assert_array_equal(phy2log, [[0, 1, 2, 3, 0, 0], [0, 1, 2, 3, 0, 1]])
    np.testing.assert_array_equal(rank, [[0, 0, 0, 0, 1, 2], [0, 0, 0, 0, 1, 1]])
    np.testing.assert_array_equal(logcnt, [[3, 1, 1, 1], [2, 2, 1, 1]])


def test_balanced_packing_fills_the_lightest_pack_with_room():
    # 9 -> A, 7 -> B, 6 -> B (7 < 9), 5 -> A (9 < 13), 4 -> B (13 < 14; B full), 1 -> A
    pack, rank = balanced_packing(np.array([[9.0, 7, 6, 5, 4, 1]]), 2)
    np.testing.assert_array_equal(pack, [[0, 1, 1, 0, 1, 0]])
    np.testing.assert_array_equal(rank, [[0, 0, 1, 1, 2, 2]])
    pack, rank = balanced_packing(np.array([[1.0, 5, 3]]), 3)  # one item per pack: item i in pack i
    np.testing.assert_array_equal(pack, [[0, 1, 2]])
    np.testing.assert_array_equal(rank, [[0, 0, 0]])


def test_rebalance_and_its_mapping_to_a_placement_by_hand():
    w = np.array([[10.0, 4, 1, 1]])
    # copies: expert 0 x3 (3.33 each), 1 (4), 2 (1), 3 (1); packed onto 2 ranks of 3 slots:
    # 4 -> r0, 3.33 -> r1, 3.33 -> r1, 3.33 -> r0, 1 -> r1 (full), 1 -> r0
    phy2log, log2phy, logcnt = rebalance_experts(w, 6, 2)
    np.testing.assert_array_equal(phy2log, [[1, 0, 3, 0, 0, 2]])
    np.testing.assert_array_equal(log2phy, [[[3, 4, 1], [0, -1, -1], [5, -1, -1], [2, -1, -1]]])
    np.testing.assert_array_equal(logcnt, [[3, 1, 1, 1]])
    # a Placement holds at most one copy per rank: rank 1's second copy of expert 0 goes to the
    # expert with the largest load per copy that rank 1 lacks (expert 1), which also evens the load
    placement = to_placement(phy2log, w, 2)
    assert rank_sets(placement) == [[{0, 1, 3}, {0, 1, 2}]]
    assert placement.expert_device[0, 2] == 1 and placement.expert_device[0, 3] == 0
    np.testing.assert_allclose(rank_loads(phy2log, w, 2), [[4 + 10 / 3 + 1, 20 / 3 + 1]])
    np.testing.assert_allclose(rank_loads(placement.physical_to_logical(), w, 2), [[8, 8]])


def test_mapping_splits_two_copies_on_one_rank():
    w = np.array([[12.0, 5, 5, 4, 1, 1]])
    phy2log, _, logcnt = rebalance_experts(w, 9, 3)
    np.testing.assert_array_equal(logcnt, [[3, 2, 1, 1, 1, 1]])
    # DeepSeek's packing: r0 {2, 1, 1}, r1 {0, 0, 4}, r2 {3, 0, 5}: two ranks hold an expert twice
    np.testing.assert_array_equal(phy2log, [[2, 1, 1, 0, 0, 4, 3, 0, 5]])
    placement = to_placement(phy2log, w, 3)
    # r0's second copy of 1 (2.5) swaps with 4 (1) from r1 (the lighter heavier-rank, ties to the
    # lower rank); then r1's second copy of 0 (4) swaps with r0's 2 (5), the closer load of the
    # two swaps that leave 11.5 on the heavier rank
    assert rank_sets(placement) == [[{0, 1, 4}, {0, 1, 2}, {0, 3, 5}]]
    np.testing.assert_array_equal(placement.replica_count(), logcnt)
    np.testing.assert_allclose(rank_loads(placement.physical_to_logical(), w, 3), [[7.5, 11.5, 9]])


def test_mapping_moves_copies_until_every_expert_has_a_home():
    # rank 0 holds three one-copy experts but only two homes: a copy moves to a rank with a free
    # home, swapped against that rank's replica of the same load (expert 1 <-> expert 4)
    w = np.array([[3.0, 2, 1, 4, 4, 4]])
    placement = to_placement(np.array([[0, 1, 2, 3, 4, 5, 3, 4, 5]]), w, 3)
    assert rank_sets(placement) == [[{0, 2, 4}, {3, 4, 5}, {1, 3, 5}]]
    np.testing.assert_allclose(rank_loads(placement.physical_to_logical(), w, 3), [[6, 6, 6]])


def test_vllm_replica_choice_hashes_the_token_row():
    # (row * 2654435769 mod 2^32) mod copies: row 1 -> 2654435769 (odd, digit sum 51), row 2 -> 1013904242
    np.testing.assert_array_equal(vllm_replica_index(np.array([0, 1, 2, 1, 2]), np.array([3, 3, 3, 2, 2])),
                                  [0, 0, 2, 1, 0])
    # copies of expert 0 in DeepSeek's map above: slots 1 (rank 0), 3 and 4 (rank 1), in slot order
    served = vllm_serving_device(np.array([[1, 0, 3, 0, 0, 2]]), 2, np.zeros((3, 1, 1), np.int64),
                                 np.arange(3)[:, None])
    np.testing.assert_array_equal(served[:, 0, 0], [0, 0, 1])
    # the row counts tokens of the same step on the same rank
    np.testing.assert_array_equal(rank_rows(np.array([[0], [1], [0], [0], [1]]), np.array([0, 3]))[:, 0],
                                  [0, 0, 1, 0, 0])


def old_eplb(loads, ep):
    """The ``eplb`` placement before replication: heaviest expert first onto the lightest rank with room."""
    out = np.empty(loads.shape, np.int64)
    for l, row in enumerate(loads):
        load, count = np.zeros(ep), np.zeros(ep, int)
        for e in sorted(range(len(row)), key=lambda x: (-row[x], x)):
            g = min((g for g in range(ep) if count[g] < len(row) // ep), key=lambda g: (load[g], g))
            out[l, e], load[g], count[g] = g, load[g] + row[e], count[g] + 1
    return out


def test_r0_is_the_unreplicated_eplb(small_trace):
    placement = get_policy("eplb").solve(small_trace, 8)
    assert placement.redundant == 0
    np.testing.assert_array_equal(placement.expert_device, old_eplb(expert_loads(small_trace), 8))


@pytest.fixture(scope="module")
def skewed():
    """A synthetic trace whose tokens prefer fixed experts with Zipf-distributed token frequencies
    (each layer's hottest expert serves well over its mean share)."""
    from vllm_semmoe.core.synthetic import synthetic_trace

    trace = synthetic_trace(num_layers=4, num_experts=16, top_k=2, num_requests=120, mean_request_tokens=30, seed=3)
    loads = expert_loads(trace)
    assert (loads.max(axis=1) / loads.mean(axis=1)).min() > 1.4
    return trace


def test_expert_load_balance_improves_with_replicas(skewed):
    loads = expert_loads(skewed)
    served, expected = {}, {}
    for R in (0, 1, 2):
        placement = get_policy("eplb").solve(skewed, 4, redundant=R)
        assert placement.redundant == R and (placement.replica_count().sum(axis=1) == 16 + 4 * R).all()
        served[R] = evaluate(skewed, placement, None, EvalConfig(mode="tp", batch_tokens=64))["expert_imbalance"]
        expected[R] = load_imbalance(rank_loads(placement.physical_to_logical(), loads, 4))
    assert served[2] < served[0] and served[1] < served[0]
    assert expected[2] <= expected[1] < expected[0]


def test_mapping_keeps_deepseeks_copies_and_balance_on_the_profile(small_trace):
    """What the Placement format costs on real routing: every expert keeps the copies DeepSeek
    gave it (none has more than a copy per rank here), and the mapped placement balances the
    profile's load better than no replicas."""
    loads = expert_loads(small_trace).astype(float)
    unreplicated = load_imbalance(rank_loads(rebalance_experts(loads, 64, 8)[0], loads, 8))
    for R in (1, 2):
        phy2log, _, logcnt = rebalance_experts(loads, 64 + 8 * R, 8)
        assert logcnt.max() <= 8
        placement = get_policy("eplb").solve(small_trace, 8, redundant=R)
        np.testing.assert_array_equal(placement.replica_count(), logcnt)
        assert load_imbalance(rank_loads(placement.physical_to_logical(), loads, 8)) < unreplicated


def served_by_hand(placement, experts, device, batch):
    """vLLM's replica choice restated token by token: rows counted per (batch, rank), copies
    listed by ascending physical slot, copy ``(row * 2654435769 % 2**32) % copies``."""
    p2l = placement.physical_to_logical()
    S = placement.experts_per_device
    T, L, K = experts.shape
    out = np.empty((T, L, K), np.int64)
    for l in range(L):
        rows = {}
        for t in range(T):
            key = (t // batch, int(device[t, l]))
            row = rows.get(key, 0)
            rows[key] = row + 1
            for k in range(K):
                slots = [p for p in range(p2l.shape[1]) if p2l[l, p] == experts[t, l, k]]
                out[t, l, k] = slots[(row * 2654435769 % 2**32) % len(slots)] // S
    return out


def test_evaluator_serves_eplb_replicas_as_vllm_does(small_trace):
    """Without Sem-MoE's tables, vLLM's EPLB picks a token's copy by its row, not by where it is:
    an activation is local only where the picked copy is on the token's rank."""
    trace = small_trace.select_requests(np.arange(20))
    placement = get_policy("eplb").solve(small_trace, 8, redundant=2)
    config = EvalConfig(mode="tp", batch_tokens=64)
    device = scheduled_devices(trace, placement, None, config)
    served = served_by_hand(placement, trace.experts.astype(np.int64), device, 64)
    row = evaluate(trace, placement, None, config)
    assert row["lar"] == pytest.approx((served == device[:, :, None]).mean())
    load = np.stack([np.bincount(served[:, l].ravel(), minlength=8) for l in range(trace.num_layers)])
    assert row["expert_imbalance"] == pytest.approx((load.max(axis=1) / load.mean(axis=1)).mean())


def test_cost_grid_spreads_eplb_copies_as_vllm_does(skewed):
    """The grid's EPLB rows count the copy vLLM's hash picks: a replica on the token's own rank
    is local only when the hash picks it, so EPLB's LAR stays below what the locality-first
    rule (Sem-MoE's serving) would give the same placement."""
    from vllm_semmoe.evaluation.cost_grid import run_grid
    from vllm_semmoe.evaluation.step_time import schedule
    from vllm_semmoe.core.tables import placement_device_counts

    result = run_grid(skewed, 4, modes=("tp",), methods=("vanilla", "eplb"), redundant=(0, 2), batches=(64,),
                      hardware=("1-node-nvlink",))
    profile, rest = skewed.split(0.2, 0)
    placement = get_policy("eplb").solve(profile, 4, redundant=2)
    idx, offsets, device, source = schedule(rest, placement, None, "tp", 64)
    experts = source.experts[idx].astype(np.int64)
    vllm = vllm_serving_device(placement.physical_to_logical(), 4, experts, rank_rows(device, offsets[:-1]))
    local_first = placement_device_counts(experts, placement)
    eplb = [r for r in result["rows"] if r["method"] == "eplb" and r["redundant"] == 2]
    assert eplb and all(r["lar"] == pytest.approx((vllm == device[:, :, None]).mean()) for r in eplb)
    assert eplb[0]["lar"] < np.take_along_axis(local_first, device[:, :, None], axis=2).sum() / experts.size


def test_solve_export_reload_in_vllms_redundant_layout(dev_trace_path, tmp_path):
    """``semmoe solve --method eplb --redundant 2`` → ``semmoe export --format vllm-eplb``: vLLM's
    ``num_redundant_experts = E*R`` layout, which reads back to the same placement."""
    from vllm_semmoe.cli import main
    from vllm_semmoe.tools.interop import load_placement_file
    from vllm_semmoe.core.policy.eplb import copy_devices
    from vllm_semmoe.core.tables import load_tables

    tables = tmp_path / "tables"
    assert main(["solve", "--trace", str(dev_trace_path), "--ep", "8", "--method", "eplb", "--redundant", "2",
                 "--out", str(tables)]) == 0
    placement = load_tables(tables).placement
    assert placement.method == "eplb" and placement.redundant == 2
    out = tmp_path / "eplb.json"
    assert main(["export", "--tables", str(tables), "--format", "vllm-eplb", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["num_redundant_experts"] == 16 and record["num_slots"] == 64 + 16
    back = load_placement_file(out, 8)
    np.testing.assert_array_equal(back.p2l, placement.physical_to_logical())
    again = back.placement("eplb")
    np.testing.assert_array_equal(again.expert_device, placement.expert_device)
    np.testing.assert_array_equal(again.replicas, placement.replicas)
    # the ranks vLLM lists for each expert's copies are the ranks the placement gives it
    devices, count = copy_devices(back.p2l, 8)
    np.testing.assert_array_equal(count, placement.replica_count())
    held = np.zeros(placement.holds().shape, bool)
    for l, n, c in np.argwhere(devices >= 0):
        held[l, n, devices[l, n, c]] = True
    np.testing.assert_array_equal(held, placement.holds())


def test_bench_ep_replays_eplb_copies_as_evaluated(dev_trace):
    """``bench-ep``'s plan moves EPLB's tokens to the copies vLLM's hash picks: in TP mode (the
    same steps as the offline evaluation) its LAR is the evaluation's to the last activation."""
    from vllm_semmoe.tools.bench_ep import analytic_counts, plan_bench_ep
    from vllm_semmoe.core.trace import first_layers
    from vllm_semmoe.evaluation.evaluate import compare_methods

    trace = first_layers(dev_trace.select_requests(np.arange(120)), 3)
    profile, rest = trace.split(0.2, 0)
    plan = plan_bench_ep(trace, 4, "tp", ["eplb"], batch_tokens=128, redundant=1)
    counts = analytic_counts(plan, "eplb")
    row = compare_methods(profile, rest, 4, ["eplb"], EvalConfig(mode="tp", batch_tokens=128), redundant=1)["eplb"]
    assert plan.placements["eplb"].redundant == 1 and row["redundant"] == 1
    assert counts["local"] / counts["activations"] == pytest.approx(row["lar"], abs=1e-12)
    local_first = plan.placements["eplb"].serving_device(plan.experts[plan.step_rows["eplb"][0]],
                                                         plan.step_device["eplb"])
    assert counts["local"] < (local_first == plan.step_device["eplb"][:, :, None]).sum()
