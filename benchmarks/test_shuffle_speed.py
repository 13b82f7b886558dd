"""Speed of the SRS / SAG shuffle on CPU: the PyTorch references (what CPU serving runs).

Run: ``.venv/bin/python -m pytest benchmarks/test_shuffle_speed.py``. The Triton kernels in
:mod:`csrc_triton.shuffle` are for CUDA GPUs; on CPU they only run in Triton's interpreter,
whose speed means nothing, so they are not timed here. Throughput (tokens/s) is in extra_info.
"""

import numpy as np
import pytest
import torch

from csrc_triton import shuffle
from vllm_semmoe.core import scheduling

B, E, H = 4096, 8, 2048  # a prefill chunk at EP8, a DeepSeek-V2-Lite-sized hidden state


@pytest.fixture(scope="module")
def batch():
    cap = scheduling.slice_capacity(B, E)
    rng = np.random.default_rng(0)
    device = np.repeat(np.arange(E), cap)[:B]
    rng.shuffle(device)
    slot_token, token_slot = shuffle.device_grouping_reference(torch.from_numpy(device), E, cap)
    x = torch.randn(B, H, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    return device, cap, slot_token, token_slot, x


def _throughput(benchmark):
    benchmark.extra_info["tokens_per_s"] = B / benchmark.stats.stats.mean


def test_device_grouping_reference(benchmark, batch):
    device, cap, *_ = batch
    device = torch.from_numpy(device)
    benchmark(shuffle.device_grouping_reference, device, E, cap)
    _throughput(benchmark)


def test_shuffle_permutation_numba(benchmark, batch):
    """The Numba permutation in ``scheduling``, for comparison with the torch reference."""
    device, cap, *_ = batch
    scheduling.shuffle_permutation(device, E, cap)  # compile
    benchmark(scheduling.shuffle_permutation, device, E, cap)
    _throughput(benchmark)


def test_srs_pack_reference(benchmark, batch):
    _, cap, slot_token, _, x = batch
    out = torch.empty(E * cap, H, dtype=x.dtype)
    benchmark(shuffle.srs_pack_reference, x, slot_token, out)
    _throughput(benchmark)


def test_sag_unpack_reference(benchmark, batch):
    _, _, slot_token, token_slot, x = batch
    y = shuffle.srs_pack_reference(x, slot_token)
    out = torch.empty_like(x)
    benchmark(shuffle.sag_unpack_reference, y, token_slot, out)
    _throughput(benchmark)
