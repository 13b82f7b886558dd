"""The PyTorch TP decision (``scheduling_torch``) gives exactly the Numba decision: same device
per token, same permutation, for any tables and batch (ties included)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_semmoe.core import scheduling
from vllm_semmoe.kernels import scheduling_torch


@st.composite
def cases(draw):
    E = draw(st.sampled_from([2, 3, 4, 8]))
    J = draw(st.integers(1, 12))
    B = draw(st.integers(1, 70))
    seed = draw(st.integers(0, 2**31 - 1))
    levels = draw(st.sampled_from([0, 3]))  # 3: few distinct values, so scores tie often
    rng = np.random.default_rng(seed)

    def table(*shape):
        x = rng.integers(0, levels, shape).astype(np.float32) + 0.5 if levels else rng.random(shape, np.float32)
        return (x / x.sum(axis=-1, keepdims=True)).astype(np.float32)

    t2d, oov, markov = table(J, E), table(E), table(E * E, E)
    rows = rng.integers(-1, J, B).astype(np.int64)
    history = np.where(rng.random(B) < 0.3, -1, rng.integers(0, E * E, B)).astype(np.int64)
    combine = draw(st.sampled_from([scheduling.COMBINE_PRODUCT, scheduling.COMBINE_CONFIDENCE]))
    return rows, history, t2d, oov, markov, E, combine


@settings(max_examples=150, deadline=None)
@given(cases())
def test_torch_decision_equals_numba(case):
    rows, history, t2d, oov, markov, E, combine = case
    want = scheduling.tp_schedule(rows, history, t2d, oov, markov, E, combine)
    scores = scheduling.tp_layer_scores(rows, history, t2d, oov, markov, combine)
    t = torch.from_numpy
    got_scores = scheduling_torch.tp_layer_scores(t(rows), t(history), t(t2d), t(oov), t(markov), combine)
    np.testing.assert_array_equal(got_scores.numpy(), scores)
    got = scheduling_torch.tp_schedule(t(rows), t(history), t(t2d), t(oov), t(markov), E, combine)
    for g, w, name in zip(got, want, ("device", "slot_token", "token_slot")):
        np.testing.assert_array_equal(g.numpy(), w, err_msg=name)


@st.composite
def expert_cases(draw):
    E = draw(st.sampled_from([2, 4, 8]))
    N = E * draw(st.integers(1, 4))
    K = draw(st.integers(1, 3))
    J = draw(st.integers(1, 12))
    B = draw(st.integers(1, 70))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))

    def dist(*shape):
        x = rng.random(shape) + 0.05
        return x / x.sum(axis=-1, keepdims=True)

    t2d, oov, prior = dist(J, E).astype(np.float32), dist(E).astype(np.float32), dist(N)
    evidence = np.log(dist(2, N, N) / prior).astype(np.float32)
    holds = np.zeros((N, E), np.float32)
    holds[np.arange(N), rng.permutation(np.arange(N) % E)] = 1.0
    rows = rng.integers(-1, J, B).astype(np.int64)
    prev = rng.integers(0, N, (B, 2, K)).astype(np.int64)
    prev[rng.random(B) < 0.3] = -1  # tokens without history
    prev[:, 1][rng.random(B) < 0.3] = -1  # ... or with one layer of it
    weights = (draw(st.sampled_from([0.5, 1.0])), draw(st.sampled_from([0.0, 0.4])), 0.2)
    return rows, prev, t2d, oov, evidence, np.log(prior).astype(np.float32), holds, weights, E


@settings(max_examples=100, deadline=None)
@given(expert_cases())
def test_torch_expert_rule_equals_numba(case):
    """The X-table rule: scores agree to float32 rounding (PyTorch and Numba round log/exp in
    the last bits differently), and the decision has the same value as Numba's."""
    *tables, weights, E = case
    want = scheduling.tp_expert_scores(*tables, np.asarray(weights, np.float64))
    got = scheduling_torch.tp_expert_scores(*(torch.from_numpy(a) for a in tables), weights).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    device = scheduling.tp_decide(want, E)[0]
    got_device = scheduling_torch.tp_decide(torch.from_numpy(got), E)[0].numpy()
    value = want[np.arange(len(want)), device].sum()
    assert abs(want[np.arange(len(want)), got_device].sum() - value) <= 1e-4 * max(1.0, value)
    assert np.bincount(got_device, minlength=E).max() <= scheduling.slice_capacity(len(want), E)


def test_repair_path_matches():
    """Scores where the price rounds leave a device over capacity: the repair step agrees too."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        scores = np.zeros((33, 4), np.float32)
        scores[:, 0] = 1.0  # every token wants device 0
        scores += rng.integers(0, 2, scores.shape).astype(np.float32) * 1e-3
        cap = scheduling.slice_capacity(33, 4)
        want = scheduling.align(scores, cap)
        got = scheduling_torch.align(torch.from_numpy(scores), cap, rounds=1)  # force the repair
        want_1 = scheduling.balanced_assignment(scores.astype(np.float64), np.ones(33), float(cap), 1)[0]
        np.testing.assert_array_equal(got.numpy(), want_1)
        assert np.bincount(want, minlength=4).max() <= cap


@pytest.mark.parametrize("history", ["experts", "devices"])
def test_torch_scheduler_decides_as_the_host_scheduler(history):
    """``TorchTpScheduler`` (the engine's decision on CUDA tensors; run here on CPU tensors) gives
    ``TpScheduler``'s permutation at every layer of a step, with the two-layer history of either
    table (X: the experts; A: the majority devices, with a replica slot per device)."""
    from vllm_semmoe.core.policy import get_policy
    from vllm_semmoe.core.schedulers import TpScheduler
    from vllm_semmoe.core.synthetic import synthetic_trace
    from vllm_semmoe.core.tables import build_tables
    from vllm_semmoe.kernels.scheduling_torch import TorchTpScheduler

    trace = synthetic_trace(num_layers=4, num_experts=16, top_k=2, vocab_size=512, num_requests=30)
    tables = build_tables(trace, get_policy("semmoe").solve(trace, 4, mode="tp", redundant=1), mode="tp")
    host = TpScheduler(tables, history=history)
    assert host.uses_experts == (history == "experts")
    on_device = TorchTpScheduler(host, torch.device("cpu"))
    rng = np.random.default_rng(0)
    for B in (1, 5, 64, 300):
        rows = host.rows(rng.integers(0, 600, B))
        routed = {}
        for layer in range(tables.num_layers):
            previous = host.previous(layer, routed, B)
            want = host.decide(layer, rows, previous, 4)
            got = on_device.decide(layer, rows, previous, 4)
            assert got[3] == want[3]
            for g, w, name in zip(got[:3], want[:3], ("device", "slot_token", "token_slot")):
                np.testing.assert_array_equal(g.numpy(), w, err_msg=f"{name}, layer {layer}, {B} tokens")
            routed[layer] = host.history(layer, rng.integers(0, 16, (B, 2)))
