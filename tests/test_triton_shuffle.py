"""Triton shuffle kernels (SRS pack, SAG unpack, device grouping) against their references.

On CPU the kernels run in Triton's interpreter: the dispatchers read ``TRITON_INTERPRET`` at call
time and wrap kernels per mode, so a module fixture sets it for these tests only, whatever
imported Triton first. On a machine with a GPU the kernels also run compiled on CUDA; without
one they are still compiled to cubin for sm_80 / sm_90, which catches what the interpreter
accepts but the compiler rejects.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from csrc_triton import shuffle
from vllm_semmoe.core import scheduling

triton = pytest.importorskip("triton")


pytestmark = pytest.mark.usefixtures("triton_interpreter")  # tests/conftest.py


def balanced_devices(B, E, seed, skew=False):
    """``[B]`` devices with at most ``slice_capacity(B, E)`` tokens each (skew: pile up on few)."""
    cap = scheduling.slice_capacity(B, E)
    rng = np.random.default_rng(seed)
    order = rng.permutation(E) if skew else np.arange(E)
    device = np.repeat(order, cap)[:B]  # the last devices in `order` may get few or none
    rng.shuffle(device)
    return device, cap


def check_grouping(device_np, E, cap):
    device = torch.from_numpy(device_np)
    assert shuffle.uses_triton(device)
    slot_token, token_slot = shuffle.device_grouping(device, E, cap)
    want_slot_token, want_token_slot = scheduling.shuffle_permutation(device_np, E, cap)
    assert slot_token.dtype == token_slot.dtype == torch.int64
    np.testing.assert_array_equal(slot_token.numpy(), want_slot_token)
    np.testing.assert_array_equal(token_slot.numpy(), want_token_slot)
    ref_slot_token, ref_token_slot = shuffle.device_grouping_reference(device, E, cap)
    assert torch.equal(ref_slot_token, slot_token) and torch.equal(ref_token_slot, token_slot)
    return slot_token, token_slot


def bits(t):
    """Raw bits, so NaN payloads and -0.0 count (bit-exactness, not float equality)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def hidden(B, H, dtype, seed):
    x = torch.randn(B, H, generator=torch.Generator().manual_seed(seed)).to(dtype)
    specials = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")]).to(dtype)
    x.view(-1)[: min(4, x.numel())] = specials[: min(4, x.numel())]
    return x


# ---- device grouping -------------------------------------------------------------------------
@pytest.mark.parametrize("E", [1, 2, 3, 8])
@pytest.mark.parametrize("B", [1, 2, 7, 64, 300, 1000])
def test_device_grouping_matches_shuffle_permutation(B, E):
    device, cap = balanced_devices(B, E, seed=B * 10 + E)
    check_grouping(device, E, cap)


@pytest.mark.parametrize(
    "device, E, cap",
    [
        (np.array([0]), 1, 1),  # one token
        (np.array([5]), 8, 1),  # one token, seven empty slices
        (np.zeros(300, np.int64), 4, 300),  # all tokens on one device, capacity = B
        (np.full(50, 3), 4, 50),  # ... on the last device
        (np.array([5, 2, 2, 5, 5, 2, 2]), 8, 4),  # only two of eight devices used
        (np.arange(2000) % 3, 3, 667),  # B > kernel block: ranks carry across blocks
        (np.array([1, 0, 1, 0], np.int32), 2, 3),  # int32 ids, spare capacity
    ],
)
def test_device_grouping_edge_cases(device, E, cap):
    slot_token, _ = check_grouping(device, E, cap)
    assert (slot_token == shuffle.PAD).sum() == E * cap - len(device)


def test_device_grouping_without_tokens():
    for fn in (shuffle.device_grouping, shuffle.device_grouping_reference):
        slot_token, token_slot = fn(torch.empty(0, dtype=torch.int64), 4, 1)
        assert slot_token.tolist() == [-1] * 4 and token_slot.numel() == 0


@st.composite
def assignments(draw):
    E = draw(st.sampled_from([1, 2, 3, 4, 8]))
    B = draw(st.integers(1, 1000))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    weights = rng.random(E) ** draw(st.sampled_from([1, 4]))  # mild or strong skew
    device = rng.choice(E, size=B, p=weights / weights.sum())
    cap = int(np.bincount(device, minlength=E).max()) + draw(st.integers(0, 3))
    return device, E, cap


@settings(max_examples=25, deadline=None)
@given(assignments())
def test_device_grouping_random(case):
    check_grouping(*case)


@pytest.mark.parametrize("fn", [shuffle.device_grouping, shuffle.device_grouping_reference])
def test_device_grouping_rejects_bad_input(fn):
    with pytest.raises(ValueError, match="device 1 gets 3 tokens, more than capacity 2"):
        fn(torch.tensor([1, 0, 1, 1]), 2, 2)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 2\)"):
        fn(torch.tensor([0, 2, 1]), 2, 2)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 3\).*min -1"):
        fn(torch.tensor([0, -1, 1]), 3, 2)
    with pytest.raises(ValueError, match="1-D integer"):
        fn(torch.zeros(3), 2, 2)


# ---- SRS pack / SAG unpack -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B, E, H", [(1, 1, 1), (7, 3, 13), (64, 8, 100), (300, 8, 1500), (1000, 3, 7)])
def test_pack_unpack_bit_exact(B, E, H, dtype):
    """H = 1500 is walked in two BLOCK_H chunks; B = 7 over E = 3 leaves padding."""
    device, cap = balanced_devices(B, E, seed=B + H)
    slot_token, token_slot = check_grouping(device, E, cap)
    x = hidden(B, H, dtype, seed=B)
    assert shuffle.uses_triton(x)
    packed = shuffle.srs_pack(x, slot_token)
    assert packed.shape == (E * cap, H) and packed.dtype == dtype
    assert torch.equal(bits(packed), bits(shuffle.srs_pack_reference(x, slot_token)))
    pad = slot_token == shuffle.PAD
    assert torch.equal(bits(packed[pad]), bits(torch.zeros(int(pad.sum()), H, dtype=dtype)))  # +0.0
    assert torch.equal(bits(packed[~pad]), bits(x[slot_token[~pad]]))
    unpacked = shuffle.sag_unpack(packed, token_slot)
    assert torch.equal(bits(unpacked), bits(shuffle.sag_unpack_reference(packed, token_slot)))
    assert torch.equal(bits(unpacked), bits(x))  # round trip restores token order


@settings(max_examples=25, deadline=None)
@given(assignments(), st.integers(1, 300), st.sampled_from([torch.float32, torch.bfloat16]))
def test_round_trip_random(case, H, dtype):
    device, E, cap = case
    slot_token, token_slot = check_grouping(device, E, cap)
    x = hidden(len(device), H, dtype, seed=H)
    packed = shuffle.srs_pack(x, slot_token)
    assert torch.equal(bits(packed), bits(shuffle.srs_pack_reference(x, slot_token)))
    assert torch.equal(bits(shuffle.sag_unpack(packed, token_slot)), bits(x))


def test_out_buffers_and_strided_views():
    """``out=`` writes into a preallocated (here strided) buffer; strided inputs work too."""
    device, cap = balanced_devices(30, 4, seed=1)
    slot_token, token_slot = check_grouping(device, 4, cap)
    wide = hidden(30, 40, torch.bfloat16, seed=2)
    x = wide[:, 5:22]  # row stride 40
    buf = torch.full((4 * cap, 50), 7.0, dtype=torch.bfloat16)
    out = buf[:, 10:27]
    assert shuffle.srs_pack(x, slot_token, out=out) is out
    assert torch.equal(bits(out), bits(shuffle.srs_pack_reference(x, slot_token)))
    assert (buf[:, :10] == 7).all() and (buf[:, 27:] == 7).all()  # nothing outside the view
    back = torch.empty(30, 17, dtype=torch.bfloat16)
    assert shuffle.sag_unpack(out, token_slot, out=back) is back
    assert torch.equal(bits(back), bits(x))
    ref_back = torch.empty_like(back)
    assert shuffle.sag_unpack_reference(out, token_slot, out=ref_back) is ref_back
    assert torch.equal(bits(ref_back), bits(x))
    with pytest.raises(ValueError, match="out must be"):
        shuffle.srs_pack(x, slot_token, out=torch.empty(4 * cap, 17))  # wrong dtype
    with pytest.raises(ValueError, match="out must be"):
        shuffle.sag_unpack(out, token_slot, out=torch.empty(29, 17, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 0.0), (torch.float16, 0.0), (torch.bfloat16, 2**-7)])
def test_sag_unpack_scaled(dtype, rtol):
    """fp32 product cast back: exact for fp32 / fp16. The interpreter casts fp32 -> bf16 by
    truncation (the compiled kernel and torch round to nearest even), hence one bf16 ulp."""
    device, cap = balanced_devices(200, 8, seed=3)
    slot_token, token_slot = check_grouping(device, 8, cap)
    x = torch.randn(200, 33, generator=torch.Generator().manual_seed(4)).to(dtype)
    packed = shuffle.srs_pack(x, slot_token)
    scale = torch.rand(200, generator=torch.Generator().manual_seed(5)) * 4 - 2
    got = shuffle.sag_unpack_scaled(packed, token_slot, scale)
    want = shuffle.sag_unpack_scaled_reference(packed, token_slot, scale)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=rtol, atol=0)
    exact = dtype == torch.float32
    torch.testing.assert_close(got.float(), x.float() * scale[:, None], rtol=0 if exact else 2**-7,
                               atol=0 if exact else 1e-3)
    assert torch.equal(bits(shuffle.sag_unpack_scaled(packed, token_slot, None)), bits(x))
    bf16_scale = scale.to(torch.bfloat16)  # any float dtype, upcast to fp32 in the kernel
    torch.testing.assert_close(shuffle.sag_unpack_scaled(packed, token_slot, bf16_scale),
                               shuffle.sag_unpack_scaled_reference(packed, token_slot, bf16_scale),
                               rtol=rtol, atol=0)
    with pytest.raises(ValueError, match="scale must be"):
        shuffle.sag_unpack_scaled(packed, token_slot, scale[:-1])


def test_without_interpreter_cpu_uses_the_reference():
    device, cap = balanced_devices(50, 4, seed=6)
    x = hidden(50, 9, torch.float32, seed=7)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET")
        assert not shuffle.uses_triton(x)
        slot_token, token_slot = shuffle.device_grouping(torch.from_numpy(device), 4, cap)
        assert torch.equal(bits(shuffle.sag_unpack(shuffle.srs_pack(x, slot_token), token_slot)), bits(x))
    assert shuffle.uses_triton(x)  # read again at call time


# ---- the compiled path -----------------------------------------------------------------------
# Under TRITON_INTERPRET=1 at import, Triton's own library functions (such as the add combiner the
# kernels reduce with) are interpreter-only, so nothing compiles in that process.
compilable = pytest.mark.skipif(not isinstance(shuffle.ADD, triton.JITFunction),
                                reason="Triton was imported under TRITON_INTERPRET=1")


def _nvidia_compiler():
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        return GPUTarget, ASTSource
    except ImportError:  # pragma: no cover
        pytest.skip("no Triton NVIDIA backend")


@compilable
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("arch", [80, 90])
def test_kernels_compile_for_cuda(arch):
    """The compiler (not the interpreter) accepts the kernels: Triton -> PTX -> cubin, no GPU."""
    GPUTarget, ASTSource = _nvidia_compiler()
    target = GPUTarget("cuda", arch, 32)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET")
        grouping = shuffle._jit(shuffle._device_grouping_kernel, False)
        gather = shuffle._jit(shuffle._gather_rows_kernel, False)
    sig = {"device_ptr": "*i64", "slot_token_ptr": "*i64", "token_slot_ptr": "*i64", "count_ptr": "*i64",
           "B": "i32", "capacity": "i32", "BLOCK_B": "constexpr", "BLOCK_C": "constexpr"}
    src = ASTSource(fn=grouping, signature=sig, constexprs={"BLOCK_B": 1024, "BLOCK_C": 256})
    assert "cubin" in triton.compile(src, target=target).asm
    for dtype, has_scale in [("bf16", True), ("fp16", False), ("fp32", True)]:
        sig = {"src_ptr": f"*{dtype}", "index_ptr": "*i64", "scale_ptr": "*fp32", "out_ptr": f"*{dtype}",
               "n_rows": "i32", "n_src": "i32", "H": "i32", "stride_sr": "i64", "stride_sh": "i32",
               "stride_or": "i32", "stride_oh": "constexpr", "HAS_SCALE": "constexpr", "BLOCK_R": "constexpr",
               "BLOCK_H": "constexpr"}
        src = ASTSource(fn=gather, signature=sig,
                        constexprs={"stride_oh": 1, "HAS_SCALE": has_scale, "BLOCK_R": 4, "BLOCK_H": 1024})
        asm = triton.compile(src, target=target).asm
        assert "cubin" in asm
        if dtype == "bf16" and has_scale:
            assert "cvt.rn.bf16.f32" in asm["ptx"]  # round to nearest even, like torch


@compilable
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_kernels_match_reference():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET")
        for B, E, H in [(1, 1, 1), (7, 3, 13), (1000, 8, 1500), (16384, 8, 7168)]:
            device_np, cap = balanced_devices(B, E, seed=B)
            device = torch.from_numpy(device_np).cuda()
            assert shuffle.uses_triton(device)
            slot_token, token_slot = shuffle.device_grouping(device, E, cap)
            want = scheduling.shuffle_permutation(device_np, E, cap)
            np.testing.assert_array_equal(slot_token.cpu().numpy(), want[0])
            np.testing.assert_array_equal(token_slot.cpu().numpy(), want[1])
            for dtype in (torch.float32, torch.bfloat16):
                x = hidden(B, H, dtype, seed=B).cuda()
                packed = shuffle.srs_pack(x, slot_token)
                assert torch.equal(bits(packed), bits(shuffle.srs_pack_reference(x, slot_token)))
                assert torch.equal(bits(shuffle.sag_unpack(packed, token_slot)), bits(x))
                scale = torch.rand(B, device="cuda")
                assert torch.equal(bits(shuffle.sag_unpack_scaled(packed, token_slot, scale)),
                                   bits(shuffle.sag_unpack_scaled_reference(packed, token_slot, scale)))
        with pytest.raises(ValueError, match="more than capacity"):
            shuffle.device_grouping(torch.tensor([1, 1, 1], device="cuda"), 2, 2)
