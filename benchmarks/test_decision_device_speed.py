"""Speed of the device-side (PyTorch) TP decision against the Numba one, one MoE layer of one
512-token batch of the real dev trace. On CPU tensors here (the PyTorch version is for GPUs,
where it saves the host round trip; ``scripts/gpu_check.sh`` times it on a GPU).

Run: ``.venv/bin/python -m pytest benchmarks/test_decision_device_speed.py``.
"""

import numpy as np
import pytest
import torch

from vllm_semmoe import scheduling, scheduling_torch
from vllm_semmoe.policy import get_policy
from vllm_semmoe.tables import build_tables, device_counts, majority_device


@pytest.fixture(scope="module")
def batch(dev_trace):
    profile, trace = dev_trace.split(0.2, seed=0)
    placement = get_policy("semmoe").solve(profile, 8, mode="tp")
    tables = build_tables(profile, placement, mode="tp")
    layer = 10
    rows = tables.token_rows(trace.tokens)[:512]
    major = majority_device(device_counts(trace.experts[:512], placement.expert_device, 8))
    history = (major[:, layer - 2] * 8 + major[:, layer - 1]).astype(np.int64)
    arrays = (rows, history, tables.t2d_score[layer].astype(np.float32), tables.oov_score[layer],
              tables.markov[layer])
    return arrays


def test_decision_numba(benchmark, batch):
    scheduling.tp_schedule(*batch, 8)
    benchmark(scheduling.tp_schedule, *batch, 8)


def test_decision_torch_cpu(benchmark, batch):
    tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in batch]
    got = scheduling_torch.tp_schedule(*tensors, 8)
    want = scheduling.tp_schedule(*batch, 8)
    assert all(np.array_equal(g.numpy(), w) for g, w in zip(got, want))
    benchmark(scheduling_torch.tp_schedule, *tensors, 8)
