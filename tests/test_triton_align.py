"""The Triton price-round kernel of the TP decision (:mod:`csrc_triton.align`) against Numba.

On CPU the kernel runs in Triton's interpreter (float64 numpy, so the same IEEE operations);
compiled for sm_80 / sm_90 its PTX is checked for what would break exactness (contracted
multiply-adds, approximate division); on a GPU it runs compiled against Numba.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_semmoe.core import scheduling
from vllm_semmoe.kernels import scheduling_torch

triton = pytest.importorskip("triton")
from csrc_triton import align as align_kernel  # noqa: E402
from csrc_triton import shuffle  # noqa: E402


pytestmark = pytest.mark.usefixtures("triton_interpreter")  # tests/conftest.py


def scores(B, E, kind, seed):
    """``[B, E]`` float32: random, with many exact ties, or piled on device 0 (prices and repair)."""
    rng = np.random.default_rng(seed)
    if kind == "ties":
        return (rng.integers(0, 3, (B, E)) / 2).astype(np.float32)
    s = rng.random((B, E)).astype(np.float32)
    if kind == "piled":
        s[:, 0] += 2.0
    return s


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 300), E=st.sampled_from([1, 2, 3, 4, 8, 16]), kind=st.sampled_from(["random", "ties", "piled"]),
       seed=st.integers(0, 2**16))
def test_kernel_equals_numba_and_torch_rounds(B, E, kind, seed):
    s = scores(B, E, kind, seed)
    cap = scheduling.slice_capacity(B, E)
    score = torch.from_numpy(s).double()
    device, load, over = align_kernel.align_rounds(score, cap, scheduling_torch.ROUNDS)
    ref_device, ref_load = scheduling_torch._align_rounds_torch(score, float(cap), scheduling_torch.ROUNDS)
    assert torch.equal(device, ref_device) and torch.equal(load, ref_load)
    assert over.tolist() == [int(load.max() > cap)]
    assert torch.equal(load, torch.bincount(device, minlength=E).double())
    # the whole decision (kernel rounds + repair) equals Numba's
    np.testing.assert_array_equal(scheduling_torch.align(torch.from_numpy(s), cap).numpy(), scheduling.align(s, cap))


def test_dispatch_and_errors():
    s = torch.from_numpy(scores(50, 4, "random", 1)).double()
    assert shuffle.uses_triton(s)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET")
        assert not shuffle.uses_triton(s)
        with pytest.raises(RuntimeError, match="CUDA tensor"):
            align_kernel.align_rounds(s, 13, 40)
        np.testing.assert_array_equal(scheduling_torch.align(s, 13).numpy(), scheduling.align(s.numpy(), 13))
    with pytest.raises(ValueError, match="float32 or float64"):
        align_kernel.align_rounds(s.half(), 13, 40)
    # float32 scores are read as float64 inside, as Numba's align converts them
    assert all(torch.equal(a, b) for a, b in zip(align_kernel.align_rounds(s.float(), 13, 40),
                                                 align_kernel.align_rounds(s.float().double(), 13, 40)))
    with pytest.raises(ValueError, match="rounds"):
        align_kernel.align_rounds(s, 13, 0)
    device, load, over = align_kernel.align_rounds(torch.zeros((0, 4), dtype=torch.float64), 1, 40)
    assert device.numel() == 0 and load.tolist() == [0.0] * 4 and over.tolist() == [0]
    # small tiles: the batch walked in many tiles gives the same rounds
    got = align_kernel.align_rounds(s, 13, 40, tile=32)
    want = align_kernel.align_rounds(s, 13, 40, tile=8192)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


compilable = pytest.mark.skipif(not isinstance(shuffle.ADD, triton.JITFunction),
                                reason="Triton was imported under TRITON_INTERPRET=1")


@compilable
@pytest.mark.parametrize("arch", [80, 90])
def test_kernel_compiles_exact_for_cuda(arch):
    """Triton -> PTX -> cubin without a GPU; the PTX has IEEE division and no contracted fp64
    multiply-add (which Triton emits by default and would round differently from Numba)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET")
        kernel = align_kernel._kernel(False)
    # a runtime int of value 1 must stay a tensor inside the kernel (capacity 1 broke on CUDA)
    assert {p.name for p in kernel.params if p.do_not_specialize} == set(align_kernel._RUNTIME_INTS)
    sig = {"score_ptr": "*fp64", "params_ptr": "*fp64", "device_ptr": "*i64", "load_ptr": "*fp64", "over_ptr": "*i32",
           "unit_ptr": "*i64", "target_ptr": "*i32", "owner_ptr": "*i32", "key_ptr": "*i64", "position_ptr": "*fp64",
           "B": "i32", "E": "i32", "capacity": "i32", "rounds": "i32", "REPAIR": "constexpr", "BLOCK_B": "constexpr",
           "BLOCK_E": "constexpr", "BLOCK_C": "constexpr", "SELECT_FROM": "constexpr"}
    src = ASTSource(fn=kernel, signature=sig,
                    constexprs={"REPAIR": True, "BLOCK_B": 512, "BLOCK_E": 8, "BLOCK_C": 64, "SELECT_FROM": 512})
    asm = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=align_kernel.COMPILE_OPTIONS).asm
    assert "cubin" in asm
    assert "div.rn.f64" in asm["ptx"] and "fma.rn.f64" not in asm["ptx"]


@compilable
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_kernel_equals_numba():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET")
        for B, E in [(1, 1), (7, 3), (512, 8), (4096, 8), (16384, 8), (3000, 64)]:
            for kind in ("random", "ties", "piled"):
                s = scores(B, E, kind, seed=B + E)
                cap = scheduling.slice_capacity(B, E)
                got = scheduling_torch.align(torch.from_numpy(s).cuda(), cap).cpu().numpy()
                np.testing.assert_array_equal(got, scheduling.align(s, cap))
