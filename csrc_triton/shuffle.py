"""Shuffle kernels of Attention-TP: device grouping, SRS pack and SAG unpack.

After attention every TP rank holds partial sums of all ``B`` tokens' hidden states ``[B, H]``.
The shuffled reduce-scatter (SRS) permutes the rows so that the tokens routed to device ``e``
fill slice ``e`` (``capacity`` rows, ``PAD`` = -1 where a slice is not full) and then
reduce-scatters; the shuffled all-gather (SAG) gathers the ``[E*capacity, H]`` slices and applies
the inverse permutation. See :func:`vllm_semmoe.core.scheduling.shuffle_permutation`.

Every operation has a pure-PyTorch ``*_reference`` with the same semantics (bit-exact, except
the fp32 rounding of :func:`sag_unpack_scaled`) and a dispatcher that runs the Triton kernel when
the tensor is on a CUDA device or ``TRITON_INTERPRET=1`` is set (read at call time), and the
reference otherwise (including when Triton is not installed).

Kernels are plain functions here and are wrapped by ``triton.jit`` on first use: ``triton.jit``
chooses between the compiler and the interpreter when it is applied, so wrapping lazily lets
``TRITON_INTERPRET`` be set after this module (or Triton) was imported.
"""

from __future__ import annotations

import functools
import os

import torch

try:  # CPU-only installs have no Triton: the references are used
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

PAD = -1  # slot without a token (same as vllm_semmoe.core.scheduling.PAD)

__all__ = [
    "PAD",
    "device_grouping",
    "device_grouping_reference",
    "sag_unpack",
    "sag_unpack_reference",
    "sag_unpack_scaled",
    "sag_unpack_scaled_reference",
    "srs_pack",
    "srs_pack_reference",
    "uses_triton",
]


# ---- dispatch --------------------------------------------------------------------------------
def interpret_mode() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:  # triton >= 3.3 reads the environment on every access
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def uses_triton(t: torch.Tensor) -> bool:
    """Whether the dispatchers run the Triton kernel for tensors like ``t`` (CUDA or interpreter)."""
    return triton is not None and (t.is_cuda or interpret_mode())


@functools.lru_cache(maxsize=None)
def _jit(fn, interpret: bool):
    # `interpret` is only part of the cache key: triton.jit reads the same setting itself.
    return triton.jit(fn)


def _kernel(fn):
    return _jit(fn, interpret_mode())


# ---- kernels ---------------------------------------------------------------------------------
# The kernels call only Triton builtins, and reduce with Triton's own add combiner rather than
# tl.sum / tl.cumsum: those are themselves @triton.jit functions, fixed to compiled or interpreted
# mode when Triton is imported, so calling them would tie TRITON_INTERPRET to import order. The
# interpreter recognises this combiner and runs numpy's sum / cumsum; the compiler emits exactly
# what tl.sum / tl.cumsum emit. (Triton's rule still holds: a process that imported Triton under
# TRITON_INTERPRET=1 cannot compile kernels that use its library functions.)
if triton is not None:
    ADD = getattr(tl.standard, "_sum_combine", None)
    if ADD is None:  # pragma: no cover - other Triton versions: correct, slow in the interpreter
        def _add_fn(a, b):
            return a + b

        ADD = triton.JITFunction(_add_fn)


def _device_grouping_kernel(device_ptr, slot_token_ptr, token_slot_ptr, count_ptr, B, capacity,
                            BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr):
    """Stable counting sort of tokens by device. Grid ``(E,)``: program ``e`` owns slice ``e``.

    device ``[B]`` int; slot_token ``[E*capacity]`` int64 (slice ``e`` written in full, PAD
    after the last token); token_slot ``[B]`` int64 (written for this device's tokens, -1 for
    those past ``capacity``); count ``[E]`` int64 (tokens of device ``e``, for validation).
    A token's rank is the running count plus a cumulative sum of ``device == e`` in its block.
    """
    e = tl.program_id(0)
    base = e.to(tl.int64) * capacity
    offs = tl.arange(0, BLOCK_B).to(tl.int64)
    count = tl.full([], 0, tl.int64)
    for start in range(0, B, BLOCK_B):
        b = start + offs
        hit = (tl.load(device_ptr + b, mask=b < B, other=-1) == e).to(tl.int32)
        rank = count + tl.associative_scan(hit, 0, ADD) - 1
        keep = (hit != 0) & (rank < capacity)
        tl.store(slot_token_ptr + base + rank, b, mask=keep)
        tl.store(token_slot_ptr + b, tl.where(keep, base + rank, -1), mask=hit != 0)
        count += tl.reduce(hit, 0, ADD)
    tl.store(count_ptr + e, count)
    for start in range(0, capacity, BLOCK_C):
        j = start + tl.arange(0, BLOCK_C).to(tl.int64)
        pad = tl.full([BLOCK_C], -1, tl.int64)
        tl.store(slot_token_ptr + base + j, pad, mask=(j < capacity) & (j >= count))


def _gather_rows_kernel(src_ptr, index_ptr, scale_ptr, out_ptr, n_rows, n_src, H,
                        stride_sr, stride_sh, stride_or, stride_oh,
                        HAS_SCALE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """``out[r] = src[index[r]]`` (times ``scale[r]`` in fp32 if HAS_SCALE), zeros where
    ``index[r]`` is outside ``[0, n_src)`` (PAD). Grid ``(cdiv(n_rows, BLOCK_R),)``.

    src ``[n_src, H]``, index ``[n_rows]`` int, scale ``[n_rows]`` float (unused without
    HAS_SCALE), out ``[n_rows, H]`` of src's dtype; strides in elements. H is walked in
    BLOCK_H chunks.
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_r = rows < n_rows
    idx = tl.load(index_ptr + rows, mask=in_r, other=-1).to(tl.int64)
    valid = (idx >= 0) & (idx < n_src)
    src_row = tl.where(valid, idx, 0) * stride_sr
    out_row = rows * stride_or
    if HAS_SCALE:
        scale = tl.load(scale_ptr + rows, mask=in_r, other=0).to(tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H).to(tl.int64)
        in_h = cols < H
        vals = tl.load(src_ptr + src_row[:, None] + cols[None, :] * stride_sh,
                       mask=valid[:, None] & in_h[None, :], other=0)
        if HAS_SCALE:
            vals = (vals.to(tl.float32) * scale[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + out_row[:, None] + cols[None, :] * stride_oh, vals,
                 mask=in_r[:, None] & in_h[None, :])


# ---- device grouping -------------------------------------------------------------------------
def _is_int(t):
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def _check_grouping_args(device, num_devices, capacity):
    if device.dim() != 1 or not _is_int(device):
        raise ValueError(f"device must be a 1-D integer tensor, got {tuple(device.shape)} {device.dtype}")
    if num_devices < 1 or capacity < 0:
        raise ValueError(f"need num_devices >= 1 and capacity >= 0, got {num_devices}, {capacity}")


def _raise_bad_counts(counts, num_devices, capacity):
    """``counts``: ``[E]`` tokens per device (CPU)."""
    over = int(torch.argmax(counts))
    raise ValueError(f"device {over} gets {int(counts[over])} tokens, more than capacity {capacity} "
                     f"(E={num_devices}, B={int(counts.sum())})")


def device_grouping_reference(device: torch.Tensor, num_devices: int, capacity: int):
    """PyTorch reference of :func:`device_grouping` (stable sort + scatter)."""
    _check_grouping_args(device, num_devices, capacity)
    B, E = device.numel(), num_devices
    slot_token = torch.full((E * capacity,), PAD, dtype=torch.int64, device=device.device)
    if B == 0:
        return slot_token, torch.empty(0, dtype=torch.int64, device=device.device)
    lo, hi = torch.aminmax(device)
    if int(lo) < 0 or int(hi) >= E:
        raise ValueError(f"device ids must lie in [0, {E}), got min {int(lo)} max {int(hi)}")
    device = device.long()
    counts = torch.bincount(device, minlength=E)
    if int(counts.max()) > capacity:
        _raise_bad_counts(counts.cpu(), E, capacity)
    order = torch.sort(device, stable=True).indices
    starts = torch.cumsum(counts, 0) - counts
    d = device[order]
    slot = d * capacity + torch.arange(B, device=device.device) - starts[d]
    slot_token[slot] = order
    token_slot = torch.empty(B, dtype=torch.int64, device=device.device)
    token_slot[order] = slot
    return slot_token, token_slot


def device_grouping(device: torch.Tensor, num_devices: int, capacity: int, *, validate: bool = True):
    """The device-grouping "argsort" of the SRS: a stable counting sort of tokens by device.

    Args:
        device: ``[B]`` integer target device of each token, in ``[0, num_devices)``, at most
            ``capacity`` tokens per device.
        num_devices: ``E``; capacity: slots per slice (``ceil(B/E)``, see ``slice_capacity``).
        validate: check ids and counts (raises ``ValueError``). On the kernel path this reads
            back ``E`` counts (one device sync); with ``validate=False`` nothing is synced and
            invalid input gives unspecified output.
    Returns:
        ``(slot_token [E*capacity], token_slot [B])`` int64, equal to
        ``scheduling.shuffle_permutation``: slice ``e`` holds device ``e``'s tokens in original
        order, then PAD; ``token_slot`` is the inverse.
    """
    if not uses_triton(device):
        return device_grouping_reference(device, num_devices, capacity)
    _check_grouping_args(device, num_devices, capacity)
    B, E = device.numel(), num_devices
    slot_token = torch.empty(E * capacity, dtype=torch.int64, device=device.device)
    token_slot = torch.empty(B, dtype=torch.int64, device=device.device)
    if B == 0:
        return slot_token.fill_(PAD), token_slot
    counts = torch.empty(E, dtype=torch.int64, device=device.device)
    device = device.contiguous()
    block_b = min(1024, triton.next_power_of_2(B))
    block_c = min(1024, triton.next_power_of_2(max(capacity, 1)))
    _kernel(_device_grouping_kernel)[(E,)](device, slot_token, token_slot, counts, B, capacity,
                                           BLOCK_B=block_b, BLOCK_C=block_c)
    if validate:
        counts = counts.cpu()
        if int(counts.sum()) != B:  # tokens no program claimed: ids outside [0, E)
            lo, hi = torch.aminmax(device)
            raise ValueError(f"device ids must lie in [0, {E}), got min {int(lo)} max {int(hi)}")
        if int(counts.max()) > capacity:
            _raise_bad_counts(counts, E, capacity)
    return slot_token, token_slot


# ---- row gathers: SRS pack, SAG unpack -------------------------------------------------------
def _check_rows(name, src, index, n_rows, out, scale=None):
    if src.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D [rows, H] input, got shape {tuple(src.shape)}")
    if index.dim() != 1 or not _is_int(index):
        raise ValueError(f"{name}: index must be a 1-D integer tensor, "
                         f"got {tuple(index.shape)} {index.dtype}")
    if index.device != src.device:
        raise ValueError(f"{name}: index on {index.device}, input on {src.device}")
    if scale is not None and (scale.shape != (n_rows,) or scale.device != src.device):
        raise ValueError(f"{name}: scale must be [{n_rows}] on {src.device}, "
                         f"got {tuple(scale.shape)} on {scale.device}")
    if out is not None:
        shape = (n_rows, src.shape[1])
        if tuple(out.shape) != shape or out.dtype != src.dtype or out.device != src.device:
            raise ValueError(f"{name}: out must be {shape} {src.dtype} on {src.device}, "
                             f"got {tuple(out.shape)} {out.dtype} on {out.device}")


def _gather_rows_reference(src, index, scale=None, out=None):
    valid = (index >= 0)[:, None]
    rows = torch.where(valid, src.index_select(0, index.long().clamp(min=0)), 0)
    if scale is not None:
        rows = (rows.float() * scale.float()[:, None]).to(src.dtype)
    if out is None:
        return rows
    return out.copy_(rows)


def _gather_rows(src, index, scale=None, out=None):
    n_rows, H = index.numel(), src.shape[1]
    if out is None:
        out = torch.empty((n_rows, H), dtype=src.dtype, device=src.device)
    if n_rows == 0 or H == 0:
        return out
    index = index.contiguous()
    if scale is not None:
        scale = scale.contiguous()
    block_h = min(1024, triton.next_power_of_2(H))
    block_r = min(64, max(1, 4096 // block_h), triton.next_power_of_2(n_rows))
    grid = (triton.cdiv(n_rows, block_r),)
    _kernel(_gather_rows_kernel)[grid](
        src, index, index if scale is None else scale, out, n_rows, src.shape[0], H,
        src.stride(0), src.stride(1), out.stride(0), out.stride(1),
        HAS_SCALE=scale is not None, BLOCK_R=block_r, BLOCK_H=block_h)
    return out


def srs_pack_reference(x: torch.Tensor, slot_token: torch.Tensor, out: torch.Tensor | None = None):
    """PyTorch reference of :func:`srs_pack`."""
    _check_rows("srs_pack", x, slot_token, slot_token.numel(), out)
    return _gather_rows_reference(x, slot_token, out=out)


def srs_pack(x: torch.Tensor, slot_token: torch.Tensor, out: torch.Tensor | None = None):
    """Fused permute-and-pack before the reduce-scatter: ``out[s] = x[slot_token[s]]``, zeros
    where ``slot_token[s]`` is PAD.

    Args:
        x: ``[B, H]`` partial hidden states (any dtype; only row copies, so bit-exact).
        slot_token: ``[E*cap]`` from :func:`device_grouping`; entries in ``[-1, B)`` (the kernel
            writes zeros for any other entry, the reference raises).
        out: optional ``[E*cap, H]`` buffer of x's dtype (e.g. the collective's input buffer;
            may be a strided view), must not overlap x.
    Returns:
        ``[E*cap, H]`` (``out`` when given).
    """
    if not uses_triton(x):
        return srs_pack_reference(x, slot_token, out)
    _check_rows("srs_pack", x, slot_token, slot_token.numel(), out)
    return _gather_rows(x, slot_token, out=out)


def sag_unpack_reference(y: torch.Tensor, token_slot: torch.Tensor, out: torch.Tensor | None = None):
    """PyTorch reference of :func:`sag_unpack`."""
    _check_rows("sag_unpack", y, token_slot, token_slot.numel(), out)
    return _gather_rows_reference(y, token_slot, out=out)


def sag_unpack(y: torch.Tensor, token_slot: torch.Tensor, out: torch.Tensor | None = None):
    """Unpack-and-inverse-permute after the all-gather: ``out[b] = y[token_slot[b]]``.

    Args:
        y: ``[E*cap, H]`` gathered slices; token_slot: ``[B]`` from :func:`device_grouping`.
        out: optional ``[B, H]`` buffer of y's dtype, must not overlap y.
    Returns:
        ``[B, H]`` in the original token order (bit-exact).
    """
    if not uses_triton(y):
        return sag_unpack_reference(y, token_slot, out)
    _check_rows("sag_unpack", y, token_slot, token_slot.numel(), out)
    return _gather_rows(y, token_slot, out=out)


def sag_unpack_scaled_reference(y, token_slot, scale=None, out=None):
    """PyTorch reference of :func:`sag_unpack_scaled`."""
    _check_rows("sag_unpack_scaled", y, token_slot, token_slot.numel(), out, scale)
    return _gather_rows_reference(y, token_slot, scale, out)


def sag_unpack_scaled(y: torch.Tensor, token_slot: torch.Tensor, scale: torch.Tensor | None = None,
                      out: torch.Tensor | None = None):
    """:func:`sag_unpack` that also multiplies row ``b`` by ``scale[b]`` (``[B]``, any float
    dtype): computed in fp32, cast back to y's (float) dtype. ``scale=None`` is
    :func:`sag_unpack`. fp32 is exact; lower precisions may differ from the reference by the
    final rounding."""
    if scale is None:
        return sag_unpack(y, token_slot, out)
    if not y.dtype.is_floating_point:
        raise ValueError(f"sag_unpack_scaled: y must be floating point, got {y.dtype}")
    if not uses_triton(y):
        return sag_unpack_scaled_reference(y, token_slot, scale, out)
    _check_rows("sag_unpack_scaled", y, token_slot, token_slot.numel(), out, scale)
    return _gather_rows(y, token_slot, scale, out)
