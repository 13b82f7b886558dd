"""Device scores of the Attention-TP decision, one kernel per rule, a tile of tokens per program.

The decision of every MoE layer starts from ``[B, E]`` float32 scores, each token's share of
activations that would be local on each device. As PyTorch ops that is 15 to 40 small kernels
(a loop over the history layers, a loop over the devices for a sequential sum); here each rule
is one launch over ``cdiv(B, BLOCK_B)`` programs, nothing read back.

- :func:`layer_scores`: the A-table rule, :func:`vllm_semmoe.core.scheduling.tp_layer_scores`,
  operation for operation (float32 products, float64 divisions and sequential sums, first index
  on ties): equal to Numba's scores, not merely close.
- :func:`expert_scores`: the X-table rule, :func:`vllm_semmoe.core.scheduling.tp_expert_scores`,
  in float64 with Numba's order of accumulation over the history; its logarithms, exponentials
  and the sums inside the two softmaxes are the device's (tree sums), so its scores agree with
  Numba's to float32 rounding.

Floating-point contraction is off (:data:`csrc_triton.align.COMPILE_OPTIONS`) and constants not
exact in float32 travel in a float64 tensor (Triton passes Python floats as float32).
"""

from __future__ import annotations

import functools
import inspect

import torch

from .align import COMPILE_OPTIONS
from .shuffle import ADD, interpret_mode, triton, tl, uses_triton

__all__ = ["COMBINE_CONFIDENCE", "COMBINE_PRODUCT", "expert_scores", "layer_scores"]

COMBINE_CONFIDENCE = 0  # as vllm_semmoe.core.scheduling.COMBINE_CONFIDENCE
COMBINE_PRODUCT = 1  # as vllm_semmoe.core.scheduling.COMBINE_PRODUCT

if triton is not None:
    _MAX = tl.standard._elementwise_max
    _MIN = tl.standard._elementwise_min


def _layer_scores_kernel(rows_ptr, hist_ptr, t2d_ptr, oov_ptr, markov_ptr, params_ptr, out_ptr, B, E,
                         COMBINE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr):
    """Grid ``(cdiv(B, BLOCK_B),)``. rows ``[B]`` int64 (-1: unseen); hist ``[B]`` int64 (-1:
    unknown); t2d ``[J, E]`` float32; oov ``[E]`` float32; markov ``[E*E, E]`` float32; params
    ``[2]`` float64 = (1e-9, 1e-30); writes out ``[B, E]`` float32."""
    b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    in_b = b < B
    cols = tl.arange(0, BLOCK_E)
    in_e = cols < E
    tile = in_b[:, None] & in_e[None, :]
    row = tl.load(rows_ptr + b, mask=in_b, other=-1)
    seen = row >= 0
    t2d = tl.load(t2d_ptr + tl.where(seen, row, 0)[:, None] * E + cols[None, :], mask=tile & seen[:, None], other=0.0)
    oov = tl.load(oov_ptr + cols, mask=in_e, other=1.0)
    base = tl.where(seen[:, None], t2d, oov[None, :])
    h = tl.load(hist_ptr + b, mask=in_b, other=-1)
    known = h >= 0
    markov = tl.load(markov_ptr + tl.where(known, h, 0)[:, None] * E + cols[None, :], mask=tile & known[:, None],
                     other=0.0)
    if COMBINE == 1:
        tiny = tl.load(params_ptr)
        floor = tl.load(params_ptr + 1)
        # scores[b, e] * markov[h, e] / max(oov[e], 1e-9): a float32 product, a float64 division
        scaled = ((base * markov).to(tl.float64) / tl.maximum(oov.to(tl.float64), tiny)[None, :]).to(tl.float32)
        scaled = tl.where(tile, scaled, 0.0)
        total = tl.full([BLOCK_B], 0.0, tl.float64)
        for e in range(0, E):  # sequential float64 sum in device order; the max picks column e exactly
            column = tl.reduce(tl.where(cols[None, :] == e, scaled, float("-inf")), 1, _MAX)
            total = total + column.to(tl.float64)
        normalised = (scaled.to(tl.float64) / tl.maximum(total, floor)[:, None]).to(tl.float32)
        out = tl.where(known[:, None], normalised, base)
    else:
        top_markov = tl.reduce(tl.where(in_e[None, :], markov, float("-inf")), 1, _MAX)
        top_base = tl.reduce(tl.where(in_e[None, :], base, float("-inf")), 1, _MAX)
        out = tl.where((known & (top_markov > top_base))[:, None], markov, base)
    tl.store(out_ptr + b[:, None] * E + cols[None, :], out, mask=tile)


def _expert_scores_kernel(rows_ptr, prev_ptr, t2d_ptr, oov_ptr, evidence_ptr, prior_ptr, holds_ptr, weights_ptr,
                          params_ptr, out_ptr, B, E, N, K,
                          BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid ``(cdiv(B, BLOCK_B),)``. rows ``[B]`` int64 (-1: unseen); prev ``[B, 2, K]`` int64
    (-1: unknown); t2d ``[J, E]`` float32; oov ``[E]`` float32; evidence ``[2, N, N]`` float32;
    prior ``[N]`` float32; holds ``[N, E]`` float32; weights ``[3]`` float64; params ``[2]``
    float64 = (1e-9, unused); writes out ``[B, E]`` float32."""
    b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    in_b = b < B
    cols = tl.arange(0, BLOCK_E)
    in_e = cols < E
    ms = tl.arange(0, BLOCK_N)
    in_n = ms < N
    tile = in_b[:, None] & in_e[None, :]
    tiny = tl.load(params_ptr)
    row = tl.load(rows_ptr + b, mask=in_b, other=-1)
    seen = row >= 0
    t2d = tl.load(t2d_ptr + tl.where(seen, row, 0)[:, None] * E + cols[None, :], mask=tile & seen[:, None], other=1.0)
    oov = tl.load(oov_ptr + cols, mask=in_e, other=1.0).to(tl.float64)
    base = tl.where(seen[:, None], t2d.to(tl.float64), oov[None, :])
    logs = tl.load(weights_ptr) * tl.log(tl.maximum(base, tiny))
    # log q(m) = log p(m) + sum_j w_j sum_k log X_j[n_jk, m], added in Numba's order (j, then k)
    prior = tl.load(prior_ptr + ms, mask=in_n, other=0.0).to(tl.float64)
    q = tl.full([BLOCK_B, BLOCK_N], 0.0, tl.float64) + prior[None, :]
    known = tl.full([BLOCK_B], 0, tl.int1)
    for j in tl.static_range(2):
        w = tl.load(weights_ptr + 1 + j)
        for k in range(0, K):
            n = tl.load(prev_ptr + b * (2 * K) + j * K + k, mask=in_b, other=-1)
            has = n >= 0
            known = known | has
            ev = tl.load(evidence_ptr + j * N * N + tl.where(has, n, 0)[:, None] * N + ms[None, :],
                         mask=has[:, None] & in_n[None, :], other=0.0)
            q = tl.where(has[:, None], q + w * ev.to(tl.float64), q)
    q = tl.where(in_n[None, :], q, float("-inf"))
    q = tl.exp(q - tl.reduce(q, 1, _MAX)[:, None])
    q = q / tl.reduce(q, 1, ADD)[:, None]
    for e in range(0, E):  # local share on device e: q summed over the experts it holds
        holds = tl.load(holds_ptr + ms * E + e, mask=in_n, other=0.0).to(tl.float64)
        local = tl.reduce(q * holds[None, :], 1, ADD)
        oov_e = tl.load(oov_ptr + e).to(tl.float64)
        gain = tl.log(tl.maximum(local, tiny) / tl.maximum(oov_e, tiny))
        logs = tl.where((cols[None, :] == e) & known[:, None], logs + gain[:, None], logs)
    logs = tl.where(in_e[None, :], logs, float("-inf"))
    x = tl.exp(logs - tl.reduce(logs, 1, _MAX)[:, None])
    x = x / tl.reduce(x, 1, ADD)[:, None]
    tl.store(out_ptr + b[:, None] * E + cols[None, :], x.to(tl.float32), mask=tile)


#: integer arguments Triton must not specialise: a value of 1 would become a compile-time constant
RUNTIME_INTS = ("B", "E", "N", "K")


@functools.lru_cache(maxsize=None)
def _kernel(fn, interpret: bool):
    # `interpret` is only part of the cache key: triton.jit reads the same setting itself.
    return triton.jit(fn, do_not_specialize=[p for p in RUNTIME_INTS if p in inspect.signature(fn).parameters])


@functools.lru_cache(maxsize=None)
def _params(device: torch.device) -> torch.Tensor:
    """The kernels' float64 constants on ``device`` (made once per device: no copy per call)."""
    return torch.tensor([1e-9, 1e-30], dtype=torch.float64, device=device)


def _check(name, t, dim, dtypes):
    if t.dim() != dim or t.dtype not in dtypes:
        raise ValueError(f"{name} must be a {dim}-D {' or '.join(map(str, dtypes))} tensor, "
                         f"got {tuple(t.shape)} {t.dtype}")
    return t.contiguous()


def _launch(fn, B, block_e, width, args, **constexprs):
    """Launch ``fn`` over tiles of tokens: BLOCK_B tokens × ``width`` columns of float64 per program."""
    block_b = max(1, min(triton.next_power_of_2(B), 2048 // width))
    options = {} if interpret_mode() else dict(COMPILE_OPTIONS, num_warps=4)
    _kernel(fn, interpret_mode())[(triton.cdiv(B, block_b),)](*args, BLOCK_B=block_b, BLOCK_E=block_e,
                                                              **constexprs, **options)


_INT = (torch.int64,)
_F32 = (torch.float32,)


def layer_scores(rows: torch.Tensor, history: torch.Tensor, t2d: torch.Tensor, oov: torch.Tensor,
                 markov: torch.Tensor, combine: int = COMBINE_PRODUCT) -> torch.Tensor:
    """``[B, E]`` float32 scores of the A-table rule, equal to
    :func:`vllm_semmoe.core.scheduling.tp_layer_scores`, one launch.

    Args:
        rows: ``[B]`` int64 (-1: unseen); history: ``[B]`` int64 ``d2 * E + d1`` (-1: unknown);
        t2d: ``[J, E]`` float32; oov: ``[E]`` float32; markov: ``[E*E, E]`` float32; all on a
        CUDA device (or any under ``TRITON_INTERPRET=1``).
        combine: ``COMBINE_PRODUCT`` or ``COMBINE_CONFIDENCE``.
    """
    if not uses_triton(rows):
        raise RuntimeError("layer_scores needs Triton and CUDA tensors (or TRITON_INTERPRET=1)")
    if combine not in (COMBINE_CONFIDENCE, COMBINE_PRODUCT):
        raise ValueError(f"combine must be {COMBINE_CONFIDENCE} or {COMBINE_PRODUCT}, got {combine}")
    rows, history = _check("rows", rows, 1, _INT), _check("history", history, 1, _INT)
    t2d, oov, markov = _check("t2d", t2d, 2, _F32), _check("oov", oov, 1, _F32), _check("markov", markov, 2, _F32)
    B, E = rows.shape[0], oov.shape[0]
    out = torch.empty((B, E), dtype=torch.float32, device=rows.device)
    if B == 0:
        return out
    block_e = max(2, triton.next_power_of_2(E))
    _launch(_layer_scores_kernel, B, block_e, block_e,
            (rows, history, t2d, oov, markov, _params(rows.device), out, B, E), COMBINE=int(combine))
    return out


def expert_scores(rows: torch.Tensor, prev: torch.Tensor, t2d: torch.Tensor, oov: torch.Tensor,
                  log_evidence: torch.Tensor, log_prior: torch.Tensor, holds: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
    """``[B, E]`` float32 scores of the X-table rule, as
    :func:`vllm_semmoe.core.scheduling.tp_expert_scores` to float32 rounding, one launch.

    Args:
        rows: ``[B]`` int64 (-1: unseen); prev: ``[B, 2, K]`` int64 logical experts at the two
        previous layers (-1: unknown); t2d: ``[J, E]`` float32; oov: ``[E]`` float32;
        log_evidence: ``[2, N, N]`` float32; log_prior: ``[N]`` float32; holds: ``[N, E]``
        float32; weights: ``[3]`` float64 (T2D exponent, lag-1, lag-2 weight) on the same device
        (a tensor, so that no call copies it there).
    """
    if not uses_triton(rows):
        raise RuntimeError("expert_scores needs Triton and CUDA tensors (or TRITON_INTERPRET=1)")
    rows, prev = _check("rows", rows, 1, _INT), _check("prev", prev, 3, _INT)
    t2d, oov = _check("t2d", t2d, 2, _F32), _check("oov", oov, 1, _F32)
    log_evidence, log_prior = _check("log_evidence", log_evidence, 3, _F32), _check("log_prior", log_prior, 1, _F32)
    holds, weights = _check("holds", holds, 2, _F32), _check("weights", weights, 1, (torch.float64,))
    B, E, N = rows.shape[0], oov.shape[0], holds.shape[0]
    if prev.shape[:2] != (B, 2) or weights.shape[0] != 3:
        raise ValueError(f"prev must be [B={B}, 2, K] and weights [3], got {tuple(prev.shape)} and "
                         f"{tuple(weights.shape)}")
    out = torch.empty((B, E), dtype=torch.float32, device=rows.device)
    if B == 0:
        return out
    block_e = max(2, triton.next_power_of_2(E))
    block_n = max(2, triton.next_power_of_2(N))
    _launch(_expert_scores_kernel, B, block_e, max(block_e, block_n),
            (rows, prev, t2d, oov, log_evidence, log_prior, holds, weights, _params(rows.device), out,
             B, E, N, prev.shape[2]), BLOCK_N=block_n)
    return out
