"""Attention-DP in vLLM: the rank chooser, and DP=2 + EP serving with Sem-MoE routing."""

import json
from pathlib import Path

import numpy as np
import pytest

from vllm_semmoe.assets import tiny_moe_path
from vllm_semmoe.placement import Placement
from vllm_semmoe.synthetic import synthetic_trace
from vllm_semmoe.capture_store import read_segment
from vllm_semmoe.tables import build_tables, load_tables
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


def _rank_counters(workdir, policy: str) -> list[dict]:
    return [json.loads((workdir / f"served_{policy}.dp{rank}.npz.live.json").read_text()) for rank in range(2)]


def _remote_rows(workdir, policy: str, rank: int, tables_dir: str) -> int:
    """Rows ``rank`` must send, from its captured routing: per token and MoE layer, one per
    other rank holding one of the token's experts (the send set, computed here independently)."""
    tables = load_tables(tables_dir)
    l2p = tables.placement.logical_to_physical()  # [L, N] logical -> physical slot
    _, steps, _ = read_segment(str(workdir / f"served_{policy}.npz.parts" / f"dp{rank}.seg"))
    experts = np.concatenate([step["experts"] for step in steps])  # [n, L, K] logical
    dest = l2p[np.arange(experts.shape[1])[None, :, None], experts] // (l2p.shape[1] // 2)
    return int(sum((dest == other).any(axis=-1).sum() for other in range(2) if other != rank))


def test_dp2_sparse_dispatch_is_exact_and_moves_only_what_is_remote(tmp_path):
    """DP 2 + EP on the tiny model, the same 40 prompts served by stock vLLM (metered), by stock
    vLLM with the sparse dispatch, and by Sem-MoE (placement, routing, sparse dispatch): the
    sparse dispatch gives stock vLLM's text, token for token; the stock engine's all-gather moves
    every token to the other rank; the sparse engine moves exactly the rows its captured routing
    sends, and Sem-MoE fewer than stock."""
    dataset = str(DATA_DIR / "text" / "sharegpt_4k.jsonl.gz")
    runs = {policy: run_bench_serve(tiny_moe_path(), dataset, str(tmp_path), dp=2, policy=policy, num_prompts=40,
                                    concurrency=8, max_tokens=8, profile_prompts=60)
            for policy in ("vllm", "sparse", "semmoe")}
    for run in runs.values():
        assert run["ok"] == 40 and run["failed"] == 0, run["errors"]
        assert all(tokens > 0 for tokens in run["rank_prompt_tokens"])
        assert 0.0 < run["live_lar"] < 1.0
        json.dumps(run)
    assert runs["sparse"]["outputs"] == runs["vllm"]["outputs"]

    hidden = json.loads((Path(tiny_moe_path()) / "config.json").read_text())["hidden_size"]
    row = hidden * 2  # bfloat16
    layers = 4
    stock = _rank_counters(tmp_path, "vllm")
    # Counted: every MoE layer of every real step and of every dummy batch an idle rank runs in
    # lock-step (``moe_traffic["tokens"]``: MoE-layer rows of both); ``live["tokens"]``: real tokens.
    for rank, live in enumerate(stock):
        traffic = live["moe_traffic"]
        assert traffic["tokens"] >= live["tokens"] * layers
        assert traffic["dispatch_bytes"] == traffic["tokens"] * row  # all-gathered to the other rank
        assert traffic["combine_bytes"] == stock[1 - rank]["moe_traffic"]["tokens"] * row  # its rows, reduce-scattered
    for policy in ("sparse", "semmoe"):
        ranks = _rank_counters(tmp_path, policy)
        tables = str(tmp_path / ("tables_vanilla_dp2" if policy == "sparse" else "tables_semmoe_dp2"))
        for rank, live in enumerate(ranks):
            traffic = live["moe_traffic"]
            captured = _remote_rows(tmp_path, policy, rank, tables) * row  # real steps, from the capture
            dummy_rows = traffic["tokens"] - live["tokens"] * layers
            assert captured <= traffic["dispatch_bytes"] <= captured + dummy_rows * row, (policy, rank)
            assert traffic["combine_bytes"] == ranks[1 - rank]["moe_traffic"]["dispatch_bytes"], (policy, rank)
            # the exchange's own activation count agrees with the recorder's (captured ids, placement)
            assert traffic["local_activations"] >= live["local_activations"], (policy, rank)
    sparse = _rank_counters(tmp_path, "semmoe")
    assert runs["sparse"]["moe_bytes_per_token"] < runs["vllm"]["moe_bytes_per_token"]
    assert runs["semmoe"]["moe_bytes_per_token"] < runs["vllm"]["moe_bytes_per_token"]
    # the same counters on the server's /metrics (aggregated by vLLM's API servers from the engines)
    for policy, ranks in (("vllm", stock), ("semmoe", sparse)):
        metrics = runs[policy]["metrics"]
        for op in ("dispatch", "combine", "metadata"):
            assert metrics["moe_bytes_total"][op] == sum(r["moe_traffic"][f"{op}_bytes"] for r in ranks), policy
        for kind in ("local", "remote"):
            assert metrics[f"{kind}_activations_total"] == sum(r["moe_traffic"][f"{kind}_activations"]
                                                               for r in ranks), policy
    log = (tmp_path / "server_semmoe.log").read_text()
    assert "Sem-MoE DP routing over 2 ranks" in log and "sparse EP MoE dispatch on 4 MoE layers" in log
