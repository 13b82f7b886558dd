"""Shapes we have no real trace for still solve (Qwen3-30B-A3B: 48 layers x 128 experts, top-8)."""

import numpy as np

from vllm_semmoe.evaluation.evaluate import EvalConfig, evaluate
from vllm_semmoe.core.policy import get_policy
from vllm_semmoe.core.synthetic import synthetic_trace
from vllm_semmoe.core.tables import build_tables


def test_qwen3_30b_shape_solves_and_beats_vanilla():
    trace = synthetic_trace(num_layers=48, num_experts=128, top_k=8, num_requests=120, seed=0)
    profile, rest = trace.split(0.5, seed=0)
    placement = get_policy("semmoe").solve(profile, 8)
    assert placement.expert_device.shape == (48, 128)
    assert np.all(np.bincount(placement.expert_device[47], minlength=8) == 16)
    tables = build_tables(profile, placement)
    ours = evaluate(rest, placement, tables, EvalConfig(mode="tp"))
    vanilla = evaluate(rest, get_policy("vanilla").solve(profile, 8), None, EvalConfig(mode="tp"))
    assert ours["lar"] > vanilla["lar"] + 0.05
