"""The MoE-layer cost model: hand-checked cases and a brute-force count of the routing."""

import dataclasses

import numpy as np
import pytest

from vllm_semmoe.cost_model import (DSV2_LITE, HARDWARE, Hardware, MoEShape, cost_table, exchange_seconds,
                                    moe_layer_cost, step_counts)
from vllm_semmoe.placement import Placement

from shared_fixtures import serving_by_hand

HW = Hardware("test", nodes=1, nvlink_bytes_s=1000.0, network_bytes_s=100.0, nvlink_latency_s=0.5,
              network_latency_s=2.0, peak_flops=1e3, efficiency=0.5, source="unit test")
HW2 = dataclasses.replace(HW, nodes=2)


def test_exchange_inside_a_node_is_bytes_over_nvlink_plus_one_latency():
    rows = np.zeros((1, 1, 2, 2))
    rows[0, 0, 0, 1] = 10  # rank 0 sends 10 rows of 100 bytes to rank 1
    rows[0, 0, 1, 0] = 4  # at the same time as rank 1 sends 4 back
    assert exchange_seconds(rows, 100.0, HW)[0, 0] == pytest.approx(1000 / 1000.0 + 0.5)


def test_exchange_across_nodes_is_bound_by_the_network_and_the_slowest_rank():
    rows = np.zeros((1, 1, 4, 4))  # ranks 0, 1 on node 0; 2, 3 on node 1
    rows[0, 0, 0, 1] = 10  # same node: 1000 B / 1000 B/s = 1 s, in parallel with
    rows[0, 0, 0, 2] = 10  # the other node: 1000 B / 100 B/s = 10 s
    rows[0, 0, 3, 3] = 99  # the diagonal never moves
    assert exchange_seconds(rows, 100.0, HW2)[0, 0] == pytest.approx(10.0 + 2.0)
    assert exchange_seconds(rows, 100.0, HW)[0, 0] == pytest.approx(2.0 + 0.5)  # all on NVLink: 2000 B sent
    with pytest.raises(ValueError, match="spread evenly"):
        exchange_seconds(np.zeros((1, 1, 3, 3)), 1.0, HW2)


def test_layer_cost_charges_the_straggler_rank_and_reports_what_imbalance_costs():
    rows = np.zeros((1, 1, 2, 2))
    acts = np.array([[[6, 2]]])
    shape = MoEShape(hidden=1, expert_intermediate=1)  # 6 FLOPs per activation -> 6 / 500 s
    cost = moe_layer_cost(rows, acts, tokens=1, shape=shape, hw=HW)
    per = 6 / (1e3 * 0.5)
    assert cost["experts_us"] == pytest.approx(6 * per * 1e6)
    assert cost["experts_mean_us"] == pytest.approx(4 * per * 1e6)
    assert cost["imbalance_cost_us"] == pytest.approx(2 * per * 1e6)
    assert cost["compute_imbalance"] == pytest.approx(1.5)
    assert cost["dispatch_us"] == pytest.approx(0.5e6)  # nothing to send: the exchange's latency alone
    assert cost["total_us"] == pytest.approx(cost["experts_us"] + 2 * 0.5e6)


@pytest.mark.parametrize("redundant", [0, 1, 2])
def test_step_counts_match_a_brute_force_count(redundant):
    rng = np.random.default_rng(redundant)
    T, L, K, N, E = 40, 3, 2, 8, 4
    experts = np.stack([np.stack([rng.choice(N, K, replace=False) for _ in range(L)]) for _ in range(T)])
    dev = rng.integers(0, E, (T, L))
    e2d = np.stack([rng.permutation(np.repeat(np.arange(E), N // E)) for _ in range(L)])
    replicas = np.array([[rng.choice(np.nonzero(e2d[l] != d)[0], redundant, replace=False) for d in range(E)]
                         for l in range(L)]).reshape(L, E, redundant)
    placement = Placement(e2d, E, replicas=replicas)
    serving = placement.serving_device(experts, dev)
    assert np.array_equal(serving, serving_by_hand(placement.expert_device, placement.holds(), experts, dev))
    offsets = np.array([0, 13, 30, 40])
    rows, acts = step_counts(serving, dev, offsets, E)
    want_rows = np.zeros((3, L, E, E), np.int64)
    want_acts = np.zeros((3, L, E), np.int64)
    for s in range(3):
        for t in range(offsets[s], offsets[s + 1]):
            for l in range(L):
                ranks = {int(r) for r in serving[t, l]}
                for r in ranks - {int(dev[t, l])}:
                    want_rows[s, l, dev[t, l], r] += 1
                for r in serving[t, l]:
                    want_acts[s, l, r] += 1
    assert np.array_equal(rows, want_rows)
    assert np.array_equal(acts, want_acts)
    if redundant:  # a copy on the token's rank makes the activation local
        held = placement.holds()[np.arange(L)[None, :, None], experts, dev[:, :, None]]
        assert np.array_equal(serving == dev[:, :, None], held)
        assert held.sum() > (placement.expert_device[np.arange(L)[None, :, None], experts] == dev[:, :, None]).sum()


def test_cost_table_ratios_and_errors():
    counts = {m: {"step_rows": np.full((1, 1, 8, 8), n), "activations_per_rank": np.full((1, 1, 8), 10), "tokens": 8}
              for m, n in (("vanilla", 4), ("semmoe", 2))}
    table = cost_table(counts, DSV2_LITE, hardware=("1-node-nvlink",))
    rows = table["1-node-nvlink"]
    assert rows["vanilla"]["time_ratio_vs_vanilla"] == 1.0
    assert rows["semmoe"]["dispatch_us"] < rows["vanilla"]["dispatch_us"]
    assert rows["semmoe"]["experts_us"] == rows["vanilla"]["experts_us"]
    with pytest.raises(ValueError, match="unknown hardware"):
        cost_table(counts, hardware=("tpu",))
    assert set(HARDWARE) >= {"1-node-nvlink", "2-node-ib400"}
    assert HARDWARE["2-node-ib400"].network_bytes_s == 50e9  # 400 Gb/s


def test_semmoe_cost_command_models_every_method_on_real_routing(dev_trace_path, tmp_path, capsys):
    import json

    from vllm_semmoe.cli import main

    out = tmp_path / "cost.json"
    assert main(["cost", "--trace", str(dev_trace_path), "--ep", "4", "--mode", "dp", "--method", "vanilla,semmoe",
                 "--layers", "3", "--max-batches", "4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["cost"]) == set(HARDWARE)
    for rows in result["cost"].values():
        assert set(rows) == {"vanilla", "semmoe"} and rows["vanilla"]["time_ratio_vs_vanilla"] == 1.0
        assert all(r["total_us"] > r["experts_us"] > 0 for r in rows.values())
    # more locality, fewer rows dispatched per token
    assert result["methods"]["semmoe"]["lar"] > result["methods"]["vanilla"]["lar"]
    assert "2-node-ib400" in capsys.readouterr().out
    assert main(["cost", "--trace", str(dev_trace_path), "--hardware", "tpu"]) == 2
