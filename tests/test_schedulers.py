"""The scheduler objects are the one home of the online decisions: the engine's token shuffle
decides step by step what the offline evaluator decides for the same batches, the engine's DP
router chooses what the offline stream assigns, and the history rule is the tables' own."""

import numpy as np
import pytest

from vllm_semmoe.core import scheduling
from vllm_semmoe.core.policy import get_policy
from vllm_semmoe.core.schedulers import DpScheduler, EvalConfig, TpScheduler, dp_ranks, tp_devices
from vllm_semmoe.core.synthetic import synthetic_trace
from vllm_semmoe.core.tables import build_tables, majority_device, placement_device_counts

E = 4


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace(num_layers=5, num_experts=16, top_k=3, vocab_size=400, num_requests=40)


@pytest.fixture(scope="module")
def replicated_tables(trace):
    """Sem-MoE tables with one replica slot per device (copies change the majority device)."""
    return build_tables(trace, get_policy("semmoe").solve(trace, E, mode="tp", redundant=1), mode="tp")


@pytest.mark.parametrize("history", ["experts", "devices"])
def test_engine_steps_decide_as_the_offline_evaluator(trace, replicated_tables, history):
    """Each request of the trace played as one engine step through ``TpShuffleLayer`` (the
    engine's layer: physical ids recorded layer by layer) lands every token on the device the
    offline evaluator gives it with one batch per request."""
    from vllm_semmoe.vllm_adapter.state import new_moe_counters
    from vllm_semmoe.vllm_adapter.tp_shuffle import StepContext, TpShuffleLayer

    tables = replicated_tables
    want, _ = tp_devices(trace, tables, E, EvalConfig(mode="tp", batch_tokens=0, tp_history=history))
    scheduler = TpScheduler(tables, history=history)
    layers = [TpShuffleLayer(layer, tables, scheduler) for layer in range(trace.num_layers)]
    serving = tables.placement.device_map(None)  # logical -> the home slot a router picks
    for r in range(trace.num_requests):
        rows = slice(trace.offsets[r], trace.offsets[r + 1])
        step = StepContext(trace.tokens[rows], tables, None, new_moe_counters())
        for layer in layers:
            _, token_slot, cap = layer.schedule(step, len(step.rows), E)
            np.testing.assert_array_equal(token_slot // cap, want[rows, layer.layer], err_msg=f"request {r}")
            logical = layer.record(step, serving[layer.layer][trace.experts[rows, layer.layer]], E)
            np.testing.assert_array_equal(logical, trace.experts[rows, layer.layer])


def test_majority_history_counts_every_copy(trace, replicated_tables):
    """The A table's history is the device holding most of a token's experts, replicas counted
    (the device counts the A table was built from), first device on ties."""
    scheduler = TpScheduler(replicated_tables, history="devices")
    counts = placement_device_counts(trace.experts, replicated_tables.placement)
    major = majority_device(counts)
    for layer in range(trace.num_layers):
        np.testing.assert_array_equal(scheduler.history(layer, trace.experts[:, layer]), major[:, layer])
    home_only = np.argmax(np.stack([(replicated_tables.placement.expert_device[0][trace.experts[:, 0]] == d).sum(1)
                                    for d in range(E)], axis=1), axis=1)
    assert (home_only != major[:, 0]).any()  # copies matter on this trace


def test_without_tables_the_slices_are_contiguous():
    """No tables: the reduce-scatter's contiguous equal slices, whatever the history."""
    scheduler = TpScheduler(None)
    device, slot_token, token_slot, cap = scheduler.decide(3, scheduler.rows(np.arange(10)), None, E)
    assert cap == 3 and device.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert slot_token.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, -1, -1]
    np.testing.assert_array_equal(slot_token[token_slot], np.arange(10))


def test_unknown_history_is_refused():
    with pytest.raises(ValueError, match="tp_history must be 'experts' or 'devices'"):
        TpScheduler(None, history="tokens")


def test_online_choices_replay_the_offline_stream(trace):
    """``DpScheduler.choose`` (the engine router's decision), fed each rank's work over the last
    window of requests and the mean work so far, picks the rank ``dp_ranks`` assigns offline to
    every request, with the same prices at the end."""
    tables = build_tables(trace, get_policy("semmoe").solve(trace, E, mode="dp"), mode="dp")
    config = EvalConfig(mode="dp", dp_window=8, dp_decode_weight=20.0)
    want, _ = dp_ranks(trace, tables, E, config)
    scheduler = DpScheduler(tables, balance=config.dp_balance, price_step=config.dp_price_step, decode_weight=20.0)
    lengths = np.diff(trace.offsets)
    work = [scheduler.work(n) for n in lengths]
    load, total, got = np.zeros(E), 0.0, []
    for r in range(trace.num_requests):
        total += work[r]
        votes = scheduler.votes(trace.tokens[trace.offsets[r]:trace.offsets[r + 1]])
        got.append(scheduler.choose(votes, load, total / (r + 1), work[r]))
        load[got[-1]] += work[r]
        if r >= 8:
            load[got[r - 8]] -= work[r - 8]
    assert got == want.tolist()
    assert len(set(got)) == E  # the balance spread the requests


def test_dp_ranks_group_devices():
    """DP rank ``r`` owns EP devices ``r * per_rank ..``: its votes are theirs summed; a split
    that does not divide the EP size is refused."""
    trace = synthetic_trace(num_layers=3, num_experts=16, top_k=2, vocab_size=200, num_requests=10)
    tables = build_tables(trace, get_policy("semmoe").solve(trace, E, mode="dp"), mode="dp")
    tokens = trace.tokens[:30]
    per_device = DpScheduler(tables).votes(tokens)
    np.testing.assert_allclose(DpScheduler(tables, 2).votes(tokens), per_device.reshape(2, 2).sum(axis=1))
    assert DpScheduler(tables, 2).ranks_per_dp == 2
    with pytest.raises(ValueError, match="cannot be split over 3 DP ranks"):
        DpScheduler(tables, 3)
    values = DpScheduler(tables).values(per_device, np.zeros(E), 100.0, 50.0)
    np.testing.assert_array_equal(values, scheduling.dp_balanced_values(per_device, np.zeros(E), 100.0, 50.0,
                                                                        scheduling.DEFAULT_DP_BALANCE, np.zeros(E)))


def test_a_router_over_some_ranks_votes_for_those_ranks():
    """vLLM's hybrid load balancing: an API server balances only its node's DP ranks (2 and 3 of
    4 here) and names them by position. The votes are those ranks' own, not ranks 0 and 1's, and
    a prompt whose experts sit on DP rank 3 goes to position 1."""
    from vllm_semmoe.vllm_adapter.dp_routing import DpRouter

    trace = synthetic_trace(num_layers=3, num_experts=16, top_k=2, vocab_size=200, num_requests=40)
    tables = build_tables(trace, get_policy("semmoe").solve(trace, E, mode="dp"), mode="dp")
    every = DpScheduler(tables).request_votes(trace.tokens, trace.offsets)  # [R, 4]
    some = DpScheduler(tables, ranks=[2, 3]).request_votes(trace.tokens, trace.offsets)
    np.testing.assert_array_equal(some, every[:, [2, 3]])
    request = int(np.argmax(every[:, 3] - every[:, :3].max(axis=1)))  # the request most for rank 3
    prompt = trace.tokens[trace.offsets[request]:trace.offsets[request + 1]]
    router = DpRouter(tables, E, ranks=[2, 3])
    assert router.num_ranks == 2 and router.choose(prompt, [0.0, 0.0], "r0") == 1
    assert router.in_flight_requests.tolist() == [0, 1]
    for bad in ([3, 2], [4], []):
        with pytest.raises(ValueError, match="are not DP ranks of 4"):
            DpScheduler(tables, ranks=bad)
