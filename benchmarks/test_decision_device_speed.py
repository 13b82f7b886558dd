"""Speed of the device-side (PyTorch) TP decision against the Numba one, one MoE layer of one
512-token batch of the real dev trace, with the engine's rule (T2D and the two previous layers'
experts). On CPU tensors the PyTorch ops; on CUDA tensors (with a GPU) the same calls run the
fused Triton path (scores kernel, price rounds with their repair, grouping: three launches, no
host read). ``scripts/gpu_check.sh`` also times it on a GPU.

Run: ``.venv/bin/python -m pytest benchmarks/test_decision_device_speed.py``.
"""

import numpy as np
import pytest
import torch

from vllm_semmoe.core import scheduling
from vllm_semmoe.kernels import scheduling_torch
from vllm_semmoe.core.schedulers import TpScheduler


@pytest.fixture(scope="module")
def batch(tp_seed0):
    _, trace, placement, tables = tp_seed0
    layer = 10
    rows = tables.token_rows(trace.tokens)[:512]
    experts = trace.experts[:512].astype(np.int64)
    prev = TpScheduler(tables).previous(layer, {l: experts[:, l] for l in range(layer)}, len(experts))
    return (rows, prev, tables.t2d_score[layer].astype(np.float32), tables.oov_score[layer],
            tables.log_evidence()[layer], tables.log_expert_prior()[layer], placement.holds()[layer].astype(np.float32))


def _numba(arrays):
    scores = scheduling.tp_expert_scores(*arrays, np.asarray(scheduling.TP_EVIDENCE_WEIGHTS))
    return scheduling.tp_decide(scores, 8)


def _torch(tensors):
    return scheduling_torch.tp_decide(scheduling_torch.tp_expert_scores(*tensors, scheduling.TP_EVIDENCE_WEIGHTS), 8)


def test_decision_numba(benchmark, batch):
    _numba(batch)
    benchmark(_numba, batch)


def test_decision_torch_cpu(benchmark, batch):
    tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in batch]
    got, want = _torch(tensors)[0].numpy(), _numba(batch)[0]
    assert np.mean(got == want) > 0.99  # the same decision up to float rounding of near-ties
    benchmark(_torch, tensors)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decision_triton_cuda(benchmark, batch):
    tensors = [torch.from_numpy(np.ascontiguousarray(a)).cuda() for a in batch]
    got, want = _torch(tensors)[0].cpu().numpy(), _numba(batch)[0]
    assert np.mean(got == want) > 0.99  # the same decision up to float rounding of near-ties

    def decide():
        out = _torch(tensors)
        torch.cuda.synchronize()  # time the device work, not the launches
        return out

    benchmark(decide)
