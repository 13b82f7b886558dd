"""Triton kernels for Sem-MoE's shuffled reduce-scatter / all-gather (SRS/SAG).

Each kernel comes with a PyTorch reference used on CPU; see the online data-scheduling work.

- :func:`device_grouping`: the device-grouping "argsort" (stable counting sort of tokens by
  target device into equal slices; same result as ``scheduling.shuffle_permutation``).
- :func:`srs_pack`: permute-and-pack ``[B, H] -> [E*cap, H]`` before the reduce-scatter.
- :func:`sag_unpack` / :func:`sag_unpack_scaled`: unpack-and-inverse-permute
  ``[E*cap, H] -> [B, H]`` after the all-gather (optionally times a per-token scale).
- :func:`csrc_triton.scores.layer_scores` / :func:`csrc_triton.scores.expert_scores`: the TP
  decision's ``[B, E]`` scores (A-table and X-table rules), one launch each.
- :func:`csrc_triton.align.align_rounds`: the price rounds of the TP decision and their repair
  (``scheduling.align``) in one launch. With the scores and :func:`device_grouping` that is the
  whole decision of ``vllm_semmoe.kernels.scheduling_torch`` on CUDA: three launches, no host read.

The dispatchers run Triton on CUDA tensors or under ``TRITON_INTERPRET=1`` (read at call time)
and the ``*_reference`` functions otherwise; see :mod:`csrc_triton.shuffle`.
"""

from .shuffle import *  # noqa: F401,F403  (re-exports the public API)
from .shuffle import __all__  # noqa: F401
