"""Attention-DP in vLLM: the rank chooser, and DP=2 + EP serving with Sem-MoE routing."""

import json

import numpy as np
import pytest

from vllm_semmoe.assets import tiny_moe_path
from vllm_semmoe.placement import Placement
from vllm_semmoe.synthetic import synthetic_trace
from vllm_semmoe.tables import build_tables
from vllm_semmoe.vllm_adapter.bench_serve import run_bench_serve
from vllm_semmoe.vllm_adapter.dp_routing import DpRouter
from shared_fixtures import DATA_DIR


@pytest.fixture(scope="module")
def tables():
    trace = synthetic_trace(num_layers=4, num_experts=32, top_k=4, vocab_size=6144, num_requests=80, seed=1)
    e2d = np.tile(np.arange(32) // 16, (4, 1))
    return build_tables(trace, Placement(e2d, 2, "semmoe"), mode="dp")


def test_votes_prefer_the_rank_holding_the_prompts_experts(tables):
    router = DpRouter(tables, 2, slack=1e9, price_step=0.0)
    rows = tables.t2d_score.astype(np.float32).sum(axis=0)  # [J, E]
    token_for_rank = [int(tables.t2d_tokens[np.argmax(rows[:, r] - rows[:, 1 - r])]) for r in range(2)]
    for rank in range(2):
        assert router.choose([token_for_rank[rank]] * 20, [0, 0]) == rank
    assert router.requests.tolist() == [1, 1] and router.prompt_tokens.tolist() == [20, 20]


def test_guard_excludes_busy_ranks(tables):
    router = DpRouter(tables, 2, slack=2, price_step=0.0)
    prompt = [int(tables.t2d_tokens[0])] * 5
    preferred = router.choose(prompt, [0, 0])
    scores = [0, 0]
    scores[preferred] = 3  # more than `slack` above the other rank
    assert router.choose(prompt, scores) == 1 - preferred


def test_prices_balance_tokens(tables):
    router = DpRouter(tables, 2, slack=1e9, price_step=0.1)
    prompt = [int(tables.t2d_tokens[0])] * 30  # every request prefers the same rank
    for _ in range(200):
        router.choose(prompt, [0, 0])
    load = router.prompt_tokens
    assert load.max() / load.mean() < 1.1


def test_tables_must_split_over_ranks(tables):
    with pytest.raises(ValueError, match="cannot be split over 3 DP ranks"):
        DpRouter(tables, 3, slack=1, price_step=0.1)


def test_serve_dp2_with_semmoe_routing(tmp_path):
    result = run_bench_serve(tiny_moe_path(), str(DATA_DIR / "text" / "sharegpt_4k.jsonl.gz"), str(tmp_path),
                             dp=2, policy="semmoe", num_prompts=40, concurrency=8, max_tokens=8,
                             profile_prompts=60)
    assert result["ok"] == 40 and result["failed"] == 0, result["errors"]
    assert all(tokens > 0 for tokens in result["rank_prompt_tokens"])
    assert 0.0 < result["live_lar"] < 1.0
    log = next(tmp_path.glob("server_semmoe.log")).read_text()
    assert "Sem-MoE DP routing over 2 ranks" in log
    json.dumps(result)
