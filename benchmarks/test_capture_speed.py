"""Cost of durable capture per forward step: appending one step record to an engine's segment.

Run: ``.venv/bin/python -m pytest benchmarks/test_capture_speed.py``. Shapes are DeepSeek-V2-Lite's
(26 MoE layers, top-6 of 64 experts): a 64-request decode step and a 2048-token prefill chunk.
Bytes per step are in extra_info.
"""

import os

import numpy as np
import pytest

from vllm_semmoe.core.capture_store import SegmentWriter

L, N, K = 26, 64, 6


@pytest.mark.parametrize("requests, tokens", [(64, 64), (8, 2048)], ids=["decode-64", "prefill-2048"])
def test_append_step(benchmark, tmp_path, requests, tokens):
    rng = np.random.default_rng(0)
    writer = SegmentWriter(tmp_path / "cap.npz", num_layers=L, num_experts=N, top_k=K, vocab_size=102400)
    names = [f"cmpl-{i:032x}-0" for i in range(requests)]
    step = (names, rng.integers(1, 500, requests), np.sort(rng.integers(0, requests, tokens)),
            rng.integers(0, 500, tokens), rng.integers(0, 102400, tokens), rng.integers(0, N, (tokens, L, K)))
    before = os.path.getsize(writer.path)
    benchmark(writer.append, *step)
    benchmark.extra_info["bytes_per_step"] = (os.path.getsize(writer.path) - before) / writer.records if writer.records > 1 else 0
