"""The whole TP decision in Triton (:mod:`csrc_triton.scores`, :mod:`csrc_triton.align` with its
repair, the device grouping) against Numba, and its promise: three launches, nothing read back.

On CPU the kernels run in Triton's interpreter; compiled for sm_80 / sm_90 the scores kernels'
PTX is checked for what would break exactness; on a GPU (``-k cuda``, ``scripts/gpu_check.sh``)
the compiled decision runs against Numba and inside a CUDA graph.
"""

import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from torch.utils._python_dispatch import TorchDispatchMode

from test_scheduling_torch import cases, expert_cases
from vllm_semmoe.core import scheduling
from vllm_semmoe.kernels import scheduling_torch

triton = pytest.importorskip("triton")
from csrc_triton import align as align_kernel  # noqa: E402
from csrc_triton import scores as scores_kernel  # noqa: E402
from csrc_triton import shuffle  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_interpreter")  # tests/conftest.py

t = torch.from_numpy


@settings(max_examples=25, deadline=None)
@given(cases())
def test_layer_scores_equal_numba(case):
    """The A-table rule: the kernel's scores are Numba's, bit for bit, for either combination."""
    rows, history, t2d, oov, markov, E, combine = case
    want = scheduling.tp_layer_scores(rows, history, t2d, oov, markov, combine)
    got = scores_kernel.layer_scores(t(rows), t(history), t(t2d), t(oov), t(markov), combine)
    np.testing.assert_array_equal(got.numpy(), want)


def _same_value(got_device, want_device, scores):
    """Both decisions respect the slices and score the same total, to float32 rounding."""
    B, E = scores.shape
    rows = np.arange(B)
    value = scores[rows, want_device].sum()
    assert abs(scores[rows, got_device].sum() - value) <= 1e-4 * max(1.0, value)
    assert np.bincount(got_device, minlength=E).max() <= scheduling.slice_capacity(B, E)


@settings(max_examples=25, deadline=None)
@given(expert_cases())
def test_expert_scores_agree_with_numba(case):
    """The X-table rule: scores agree to float32 rounding; where they are equal the decisions
    are too, elsewhere the decision has Numba's value."""
    *tables, weights, E = case
    want = scheduling.tp_expert_scores(*tables, np.asarray(weights, np.float64))
    got = scores_kernel.expert_scores(*(t(a) for a in tables), torch.tensor(weights, dtype=torch.float64))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    got_device = scheduling_torch.tp_decide(got, E)[0].numpy()
    want_device = scheduling.tp_decide(want, E)[0]
    if np.array_equal(got.numpy(), want):
        np.testing.assert_array_equal(got_device, want_device)
    else:
        _same_value(got_device, want_device, want)


def repair_batches():
    """``([B, E] float32 scores, rounds)`` that the price rounds leave over capacity:
    identical tokens that move together whatever the prices; tokens that after 7 rounds all sit
    on device 0, which they value below device 1 (negative losses); near-identical ones; exact
    ties; and two devices over by one at the same load whose tokens both lose least on device
    2, which has room for one (the lower device moves first and takes it; the other's token goes
    to device 3)."""
    same = np.tile(np.array([[1.0, 0.5, 0.25]], np.float32), (150, 1))  # candidates in several pairwise tiles
    negative = np.tile(np.array([[0.5, 1.0, 0.0]], np.float32), (30, 1))
    negative[:, 1] += (np.arange(30) % 3) * np.float32(1e-3)
    level = np.array([[1, 0, 0.5, 0]] * 5 + [[0, 1, 0.5, 0]] * 5 + [[0, 0, 1, 0]] * 3 + [[0, 0, 0, 1]], np.float32)
    rng = np.random.default_rng(5)
    near = np.zeros((33, 4), np.float32)
    near[:, 0] = 1.0
    near += rng.integers(0, 2, near.shape).astype(np.float32) * 1e-3
    ties = (rng.integers(0, 3, (40, 3)) / 2).astype(np.float32)
    rounds = scheduling_torch.ROUNDS
    return [pytest.param(same, rounds, id="identical"), pytest.param(negative, 7, id="negative"),
            pytest.param(near, 1, id="near"), pytest.param(ties, 1, id="ties"), pytest.param(level, 1, id="level")]


@pytest.mark.parametrize("select", ["by-size", "always"])
@pytest.mark.parametrize("s, rounds", repair_batches())
def test_align_repair_equals_numba(s, rounds, select, monkeypatch):
    """Rounds and repair in one program: Numba's devices and loads, on batches that need the
    repair (checked: the rounds alone leave a device over), walked in one tile or several, with
    the movers selected first where there are many candidates or always."""
    if select == "always":
        monkeypatch.setattr(align_kernel, "REPAIR_SELECT_FROM", 0)
    B, E = s.shape
    cap = scheduling.slice_capacity(B, E)
    score = t(s)
    assert align_kernel.align_rounds(score, cap, rounds)[2].tolist() == [1]  # the repair is needed
    want = scheduling.balanced_assignment(s.astype(np.float64), np.ones(B), float(cap), rounds)[0]
    # a batch walk in 16-token tiles (ties across tiles: the lowest unit moves) or in one (the
    # interpreter makes the selection's 64 passes over many tiles slow: small batches only)
    for tile in (32, 4096) if select == "by-size" or B <= 40 else (4096,):
        device, load, over = align_kernel.align_rounds(score, cap, rounds, repair=True, tile=tile)
        np.testing.assert_array_equal(device.numpy(), want)
        np.testing.assert_array_equal(load.numpy(), np.bincount(want, minlength=E).astype(np.float64))
        assert over.tolist() == [0]
    if rounds == scheduling_torch.ROUNDS:
        np.testing.assert_array_equal(scheduling_torch.align(score, cap).numpy(), scheduling.align(s, cap))


@pytest.fixture(scope="module")
def tables():
    from vllm_semmoe.core.policy import get_policy
    from vllm_semmoe.core.synthetic import synthetic_trace
    from vllm_semmoe.core.tables import build_tables

    trace = synthetic_trace(num_layers=4, num_experts=16, top_k=2, vocab_size=512, num_requests=30)
    return build_tables(trace, get_policy("semmoe").solve(trace, 4, mode="tp", redundant=1), mode="tp")


def _steps(host, num_layers, sizes, seed=0):
    """``(layer, rows, previous)`` of each layer of one step per batch size, the history from
    random routing."""
    rng = np.random.default_rng(seed)
    for B in sizes:
        rows = host.rows(rng.integers(0, 600, B))
        routed = {}
        for layer in range(num_layers):
            yield layer, rows, host.previous(layer, routed, B)
            routed[layer] = host.history(layer, rng.integers(0, 16, (B, 2)))


@pytest.mark.parametrize("history", ["experts", "devices"])
def test_decide_equals_host_scheduler(tables, history):
    """``TorchTpScheduler.decide`` on Triton tensors is ``TpScheduler.decide``: the same devices
    and permutation at every layer of a step, with either table's history."""
    from vllm_semmoe.core.schedulers import TpScheduler
    from vllm_semmoe.kernels.scheduling_torch import TorchTpScheduler

    host = TpScheduler(tables, history=history)
    on_device = TorchTpScheduler(host, torch.device("cpu"))
    for layer, rows, previous in _steps(host, tables.num_layers, (1, 5, 70)):
        assert shuffle.uses_triton(t(rows))
        want = host.decide(layer, rows, previous, 4)
        got = on_device.decide(layer, t(rows), t(previous), 4)
        assert got[3] == want[3]
        for g, w, name in zip(got[:3], want[:3], ("device", "slot_token", "token_slot")):
            np.testing.assert_array_equal(g.numpy(), w, err_msg=f"{name}, layer {layer}, {len(rows)} tokens")


#: aten ops a decision may run outside its kernels: allocating their outputs
ALLOCATIONS = {"aten.empty.memory_format", "aten.empty_strided.default"}


class _OpsOutsideKernels(TorchDispatchMode):
    """Records every aten op run while active, except those Triton's interpreter runs to stand
    in for a device launch (copying the arguments to its host buffers and back); a host read
    (``.item()``, ``bool()``, ``.tolist()``: ``aten._local_scalar_dense``), a copy or any
    PyTorch compute would show here."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        while frame is not None and not frame.f_globals.get("__name__", "").startswith("triton."):
            frame = frame.f_back
        if frame is None:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("history", ["experts", "devices"])
def test_decision_is_three_launches_and_no_host_read(tables, history, monkeypatch):
    """On Triton tensors a decision is the scores kernel, the align kernel (rounds and repair)
    and the grouping kernel, and nothing else: no host read, no PyTorch op but allocations (what
    a CUDA graph can capture). Run on a batch whose rounds need the repair, after a warm-up
    call (which makes the kernels' constant tensors once, as a graph is captured after one)."""
    from vllm_semmoe.core.schedulers import TpScheduler
    from vllm_semmoe.kernels.scheduling_torch import TorchTpScheduler

    host = TpScheduler(tables, history=history)
    on_device = TorchTpScheduler(host, torch.device("cpu"))
    layer, rows, previous = list(_steps(host, tables.num_layers, (64,), seed=1))[-1]
    rows, previous = t(rows), t(previous)
    on_device.decide(layer, rows, previous, 4)
    launches = []
    run = interpreter.InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", counted)
    with _OpsOutsideKernels() as seen:
        got = on_device.decide(layer, rows, previous, 4)
    assert len(launches) == 3, launches
    assert set(seen.ops) <= ALLOCATIONS, seen.ops
    want = host.decide(layer, rows.numpy(), previous.numpy(), 4)
    np.testing.assert_array_equal(got[0].numpy(), want[0])
    rounds_only = align_kernel.align_rounds(on_device.scores(layer, rows, previous), got[3], scheduling_torch.ROUNDS)
    assert rounds_only[2].tolist() == [1]  # the batch needed the repair
    # the detector sees a host read where there is one: the PyTorch-ops path reads one flag
    with _OpsOutsideKernels() as seen:
        scheduling_torch._align_rounds_torch(torch.rand(8, 2, dtype=torch.float64), 4.0, 2)[1].max().item()
    assert "aten._local_scalar_dense.default" in seen.ops


def test_errors():
    with pytest.raises(ValueError, match="float32"):
        scores_kernel.layer_scores(t(np.zeros(2, np.int64)), t(np.zeros(2, np.int64)), torch.zeros(3, 2),
                                   torch.zeros(2), torch.zeros(4, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="combine"):
        scores_kernel.layer_scores(t(np.zeros(2, np.int64)), t(np.zeros(2, np.int64)), torch.zeros(3, 2),
                                   torch.zeros(2), torch.zeros(4, 2), combine=7)
    with pytest.raises(ValueError, match="prev must be"):
        scores_kernel.expert_scores(t(np.zeros(2, np.int64)), t(np.zeros((2, 3, 1), np.int64)), torch.zeros(3, 2),
                                    torch.zeros(2), torch.zeros(2, 4, 4), torch.zeros(4), torch.zeros(4, 2),
                                    torch.zeros(3, dtype=torch.float64))
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET")
        with pytest.raises(RuntimeError, match="CUDA tensors"):
            scores_kernel.layer_scores(*(torch.zeros(1, dtype=torch.int64),) * 2, *(torch.zeros(1, 1),) * 3)


compilable = pytest.mark.skipif(not isinstance(shuffle.ADD, triton.JITFunction),
                                reason="Triton was imported under TRITON_INTERPRET=1")


@compilable
@pytest.mark.parametrize("arch", [80, 90])
def test_scores_kernels_compile_exact_for_cuda(arch):
    """Triton -> PTX -> cubin without a GPU, the runtime ints left unspecialised; the A-table
    rule's PTX has IEEE float64 division and no contracted multiply-add (which would round
    differently from Numba). (The X-table rule's has them: libdevice's log and exp.)"""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kinds = {"B": "i32", "E": "i32", "N": "i32", "K": "i32"}
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET")
        for fn, constexprs in ((scores_kernel._layer_scores_kernel, {"COMBINE": 1, "BLOCK_B": 64, "BLOCK_E": 8}),
                               (scores_kernel._layer_scores_kernel, {"COMBINE": 0, "BLOCK_B": 64, "BLOCK_E": 8}),
                               (scores_kernel._expert_scores_kernel, {"BLOCK_B": 32, "BLOCK_E": 8, "BLOCK_N": 64})):
            kernel = scores_kernel._kernel(fn, False)
            assert {p.name for p in kernel.params if p.do_not_specialize} == set(kinds) & {p.name for p in kernel.params}
            sig = {p.name: kinds.get(p.name, "constexpr" if p.name in constexprs else None) for p in kernel.params}
            for name in sig:
                if sig[name] is None:
                    sig[name] = {"rows_ptr": "*i64", "hist_ptr": "*i64", "prev_ptr": "*i64", "weights_ptr": "*fp64",
                                 "params_ptr": "*fp64"}.get(name, "*fp32")
            src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
            asm = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=align_kernel.COMPILE_OPTIONS).asm
            assert "cubin" in asm
            if fn is scores_kernel._layer_scores_kernel:
                assert "fma.rn" not in asm["ptx"]
                assert ("div.rn.f64" in asm["ptx"]) == (constexprs["COMBINE"] == 1)


@compilable
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("history", ["experts", "devices"])
def test_cuda_decide_equals_numba_and_captures(tables, history):
    """Compiled on a GPU: ``TorchTpScheduler.decide`` against ``TpScheduler.decide`` (A table:
    equal; X table: equal where the scores are, else Numba's value), then captured in a CUDA
    graph and replayed on new inputs with the same result as eager."""
    from vllm_semmoe.core.schedulers import TpScheduler
    from vllm_semmoe.kernels.scheduling_torch import TorchTpScheduler

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET")
        host = TpScheduler(tables, history=history)
        on_device = TorchTpScheduler(host, torch.device("cuda"))
        for layer, rows, previous in _steps(host, tables.num_layers, (1, 7, 64, 512, 4096)):
            want = host.decide(layer, rows, previous, 4)
            got = [x.cpu().numpy() for x in on_device.decide(layer, t(rows).cuda(), t(previous).cuda(), 4)[:3]]
            scores = host.scores(layer, rows, previous)
            if history == "devices" or np.array_equal(on_device.scores(layer, rows, previous).cpu().numpy(), scores):
                for g, w, name in zip(got, want[:3], ("device", "slot_token", "token_slot")):
                    np.testing.assert_array_equal(g, w, err_msg=f"{name}, layer {layer}, {len(rows)} tokens")
            else:
                _same_value(got[0], want[0], scores)
        steps = list(_steps(host, tables.num_layers, (512, 512), seed=2))
        layer, rows, previous = steps[tables.num_layers - 1]
        rows_in, prev_in = t(rows).cuda(), t(previous).cuda()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            on_device.decide(layer, rows_in, prev_in, 4)  # warm-up: compiles, makes the constants
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = on_device.decide(layer, rows_in, prev_in, 4)
        layer2, rows2, previous2 = steps[-1]
        assert layer2 == layer
        rows_in.copy_(t(rows2))
        prev_in.copy_(t(previous2))
        graph.replay()
        eager = on_device.decide(layer, t(rows2).cuda(), t(previous2).cuda(), 4)
        for c, e in zip(captured[:3], eager[:3]):
            assert torch.equal(c, e)
