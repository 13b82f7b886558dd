"""Price rounds of the Attention-TP decision (:func:`vllm_semmoe.core.scheduling.align`) in one kernel.

Every MoE layer of every step decides which device each token goes to: ``[B, E]`` scores, at
most ``capacity`` tokens per device, Lagrangian prices raised on over-subscribed devices for up
to 40 rounds. As separate PyTorch ops on a GPU that is 40 rounds of about ten small kernels:
launch-bound, about 6 ms per layer on an H200 whatever the batch (``scripts/gpu_check.sh``). This
kernel runs all rounds in one program (one launch), walking the batch in tiles; the rounds stop
at the first one that leaves no device over capacity, as the Numba loop breaks.

The arithmetic is Numba's, operation for operation, in float64 (scores minus prices, first
index on ties, ``price + step * (load / cap - 1)`` clamped at 0, ``step *= 0.93``), with
floating-point contraction off, so the devices and loads equal Numba's, not merely come close.
Constants that are not exact in float32 travel in a float64 tensor: Triton passes Python floats
as float32.
"""

from __future__ import annotations

import functools

import torch

from .shuffle import ADD, interpret_mode, triton, tl, uses_triton

__all__ = ["COMPILE_OPTIONS", "align_rounds"]

COMPILE_OPTIONS = {"enable_fp_fusion": False}  # no contracted multiply-adds: Numba's rounding

if triton is not None:
    _MAX = tl.standard._elementwise_max
    _MIN = tl.standard._elementwise_min


def _align_kernel(score_ptr, params_ptr, device_ptr, load_ptr, over_ptr, B, E, capacity, rounds,
                  BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr):
    """Grid ``(1,)``. score ``[B, E]`` float64 (contiguous); params ``[3]`` float64 = (step
    decay 0.93, step scale 0.05, 1e-9); writes device ``[B]`` int64 (the last round's choice),
    load ``[E]`` float64 (tokens per device under it) and over ``[1]`` int32 (1 when a device is
    still over ``capacity``: the caller repairs)."""
    decay = tl.load(params_ptr)
    scale = tl.load(params_ptr + 1)
    tiny = tl.load(params_ptr + 2)
    cap = capacity.to(tl.float64)
    cols = tl.arange(0, BLOCK_E)
    in_e = cols < E
    offs = tl.arange(0, BLOCK_B).to(tl.int64)
    # initial step = 0.05 * (max - min + 1e-9) over the scores, as Numba computes it
    hi = tl.full([BLOCK_E], float("-inf"), tl.float64)
    lo = tl.full([BLOCK_E], float("inf"), tl.float64)
    for start in range(0, B, BLOCK_B):
        b = start + offs
        m = (b < B)[:, None] & in_e[None, :]
        s = tl.load(score_ptr + b[:, None] * E + cols[None, :], mask=m, other=0.0)
        hi = tl.where(in_e, tl.maximum(hi, tl.reduce(tl.where(m, s, float("-inf")), 0, _MAX)), hi)
        lo = tl.where(in_e, tl.minimum(lo, tl.reduce(tl.where(m, s, float("inf")), 0, _MIN)), lo)
    step = scale * (tl.reduce(hi, 0, _MAX) - tl.reduce(lo, 0, _MIN) + tiny)
    price = tl.full([BLOCK_E], 0.0, tl.float64)
    load = tl.full([BLOCK_E], 0.0, tl.float64)
    over = tl.full([], 1, tl.int32)
    r = tl.full([], 0, tl.int32)
    while (r < rounds) & (over != 0):
        load = tl.full([BLOCK_E], 0.0, tl.float64)
        for start in range(0, B, BLOCK_B):
            b = start + offs
            in_b = b < B
            s = tl.load(score_ptr + b[:, None] * E + cols[None, :], mask=in_b[:, None] & in_e[None, :],
                        other=float("-inf"))
            v = s - price[None, :]
            best_v = tl.reduce(v, 1, _MAX)
            best = tl.reduce(tl.where(v == best_v[:, None], cols[None, :], BLOCK_E), 1, _MIN)
            tl.store(device_ptr + b, best.to(tl.int64), mask=in_b)
            hit = ((best[:, None] == cols[None, :]) & in_b[:, None]).to(tl.float64)
            load += tl.reduce(hit, 0, ADD)
        is_over = tl.reduce(tl.where(in_e, load, 0.0), 0, _MAX) > cap
        over = tl.where(is_over, 1, 0)
        raised = price + step * (load / cap - 1.0)
        price = tl.where(is_over, tl.where(raised > 0.0, raised, 0.0), price)
        step = tl.where(is_over, step * decay, step)
        r += 1
    tl.store(load_ptr + cols, load, mask=in_e)
    tl.store(over_ptr, over)


#: integer arguments Triton must not specialise: a value of 1 would become a compile-time
#: constant (a plain int inside the kernel), found on an H200 with capacity 1
_RUNTIME_INTS = ["B", "E", "capacity", "rounds"]


@functools.lru_cache(maxsize=None)
def _kernel(interpret: bool):
    # `interpret` is only part of the cache key: triton.jit reads the same setting itself.
    return triton.jit(_align_kernel, do_not_specialize=_RUNTIME_INTS)


@functools.lru_cache(maxsize=None)
def _params(device: torch.device) -> torch.Tensor:
    """The kernel's float64 constants on ``device`` (made once per device: no copy per call)."""
    return torch.tensor([0.93, 0.05, 1e-9], dtype=torch.float64, device=device)


def align_rounds(score: torch.Tensor, capacity: int, rounds: int, *, tile: int | None = None,
                 num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The price rounds of :func:`vllm_semmoe.core.scheduling.balanced_assignment` (unit weights),
    one launch, nothing read back.

    Args:
        score: ``[B, E]`` float64 on a CUDA device (or any device under ``TRITON_INTERPRET=1``).
        capacity: tokens a device may take; rounds: most price rounds (>= 1).
        tile, num_warps: scores per tile of the batch walk and Triton's warps; None: 4096 and 4
            for a batch that fits one such tile, else 8192 and 16 (the fastest of those tried
            on an H200 at 512 to 16384 tokens × 8 devices, ``scripts/gpu_check.sh``).
    Returns:
        ``(device [B] int64, load [E] float64, over [1] int32)``: the last round's choice, its
        loads, and 1 where a device is still over ``capacity`` (the caller repairs).
    """
    if not uses_triton(score):  # (False without Triton)
        raise RuntimeError("align_rounds needs Triton and a CUDA tensor (or TRITON_INTERPRET=1)")
    if score.dim() != 2 or score.dtype != torch.float64:
        raise ValueError(f"score must be a [B, E] float64 tensor, got {tuple(score.shape)} {score.dtype}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    score = score.contiguous()
    B, E = score.shape
    if B == 0:
        return (torch.zeros(0, dtype=torch.int64, device=score.device),
                torch.zeros(E, dtype=torch.float64, device=score.device),
                torch.zeros(1, dtype=torch.int32, device=score.device))
    device = torch.empty(B, dtype=torch.int64, device=score.device)  # every entry written in round 1
    load = torch.empty(E, dtype=torch.float64, device=score.device)
    over = torch.empty(1, dtype=torch.int32, device=score.device)
    block_e = max(2, triton.next_power_of_2(E))
    large = B * block_e > 4096
    tile = tile or (8192 if large else 4096)
    num_warps = num_warps or (16 if large else 4)
    block_b = max(16, min(triton.next_power_of_2(B), tile // block_e))
    options = {} if interpret_mode() else dict(COMPILE_OPTIONS, num_warps=num_warps)
    _kernel(interpret_mode())[(1,)](score, _params(score.device), device, load, over, B, E, int(capacity),
                                           rounds, BLOCK_B=block_b, BLOCK_E=block_e, **options)
    return device, load, over
