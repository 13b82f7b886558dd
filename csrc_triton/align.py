"""Price rounds of the Attention-TP decision (:func:`vllm_semmoe.scheduling.align`) in one kernel.

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

import torch

from .shuffle import _ADD, _jit, _interpret, triton, tl, uses_triton

__all__ = ["COMPILE_OPTIONS", "align_rounds", "uses_triton"]

COMPILE_OPTIONS = {"enable_fp_fusion": False}  # no contracted multiply-adds: Numba's rounding

if triton is not None:
    _MAX = tl.standard._elementwise_max
    _MIN = tl.standard._elementwise_min


def _align_kernel(score_ptr, params_ptr, device_ptr, load_ptr, B, E, rounds,
                  BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr):
    """Grid ``(1,)``. score ``[B, E]`` float64 (contiguous); params ``[3]`` float64 = (initial
    step, capacity, step decay); writes device ``[B]`` int64 (the last round's choice) and load
    ``[E]`` float64 (tokens per device under it)."""
    step = tl.load(params_ptr)
    cap = tl.load(params_ptr + 1)
    decay = tl.load(params_ptr + 2)
    cols = tl.arange(0, BLOCK_E)
    in_e = cols < E
    price = tl.full([BLOCK_E], 0.0, tl.float64)
    load = tl.full([BLOCK_E], 0.0, tl.float64)
    offs = tl.arange(0, BLOCK_B).to(tl.int64)
    r = tl.full([], 0, tl.int32)
    done = tl.full([], 0, tl.int32)
    while (r < rounds) & (done == 0):
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
            load += tl.reduce(hit, 0, _ADD)
        over = tl.reduce(tl.where(in_e, load, 0.0), 0, _MAX) > cap
        done = tl.where(over, 0, 1)
        raised = price + step * (load / cap - 1.0)
        price = tl.where(over, tl.where(raised > 0.0, raised, 0.0), price)
        step = tl.where(over, step * decay, step)
        r += 1
    tl.store(load_ptr + cols, load, mask=in_e)


def align_rounds(score: torch.Tensor, capacity: int, rounds: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The price rounds of :func:`vllm_semmoe.scheduling.balanced_assignment` (unit weights).

    Args:
        score: ``[B, E]`` float64 on a CUDA device (or any device under ``TRITON_INTERPRET=1``).
        capacity: tokens a device may take; rounds: most price rounds.
    Returns:
        ``(device [B] int64, load [E] float64)``: the last round's choice and its loads; a device
        may still be over ``capacity`` (the caller repairs).
    """
    if triton is None or not uses_triton(score):
        raise RuntimeError("align_rounds needs Triton and a CUDA tensor (or TRITON_INTERPRET=1)")
    if score.dim() != 2 or score.dtype != torch.float64:
        raise ValueError(f"score must be a [B, E] float64 tensor, got {tuple(score.shape)} {score.dtype}")
    score = score.contiguous()
    B, E = score.shape
    device = torch.zeros(B, dtype=torch.int64, device=score.device)
    load = torch.zeros(E, dtype=torch.float64, device=score.device)
    if B == 0:
        return device, load
    step = 0.05 * (score.max() - score.min() + 1e-9)  # float64 on the device, as Numba computes it
    params = torch.stack([step, step.new_tensor(float(capacity)), step.new_tensor(0.93)])
    block_e = max(2, triton.next_power_of_2(E))
    block_b = max(16, min(1024, triton.next_power_of_2(B), 4096 // block_e))
    kernel = _jit(_align_kernel, _interpret())
    launch = kernel[(1,)]
    options = {} if _interpret() else COMPILE_OPTIONS
    launch(score, params, device, load, B, E, rounds, BLOCK_B=block_b, BLOCK_E=block_e, **options)
    return device, load
