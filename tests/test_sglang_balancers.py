"""SGLang's DP-attention load-balance methods (``total_requests``, ``total_tokens``) as
locality-blind baselines: the rules against hand-worked arrivals and an independent restatement,
and their figures beside every method's in ``semmoe eval --mode dp``."""

import json
from collections import deque

import numpy as np
import pytest

from vllm_semmoe.core import scheduling
from vllm_semmoe.evaluation.evaluate import DP_BASELINES, EvalConfig, evaluate
from vllm_semmoe.core.policy import get_policy
from vllm_semmoe.core.synthetic import synthetic_trace
from vllm_semmoe.core.tables import build_tables


def sglang_by_hand(method: str, tokens, ep_size: int, window: int) -> list[int]:
    """SGLang's ``DPBudget.dispatch`` restated with plain lists, one request at a time: the
    per-rank counters hold the last ``window`` requests (each dispatch adds one request and its
    prompt tokens; the oldest leaves once more than ``window`` are in flight)."""
    total_requests, total_tokens = [0] * ep_size, [0] * ep_size
    in_flight = deque()
    ranks = []
    for n in tokens:
        while len(in_flight) > window:
            old_rank, old_tokens = in_flight.popleft()
            total_requests[old_rank] -= 1
            total_tokens[old_rank] -= old_tokens
        if method == "total_requests":
            rank = total_requests.index(min(total_requests))
        else:
            rank = min(range(ep_size), key=lambda i: (total_tokens[i], total_requests[i]))
        total_requests[rank] += 1
        total_tokens[rank] += n
        in_flight.append((rank, n))
        ranks.append(rank)
    return ranks


def test_total_requests_counts_requests_and_breaks_ties_to_the_lowest_rank():
    # prompt lengths do not matter: two ranks alternate, three ranks cycle
    assert scheduling.sglang_total_requests_assign(4, 2, 100).tolist() == [0, 1, 0, 1]
    assert scheduling.sglang_total_requests_assign(7, 3, 100).tolist() == [0, 1, 2, 0, 1, 2, 0]
    # window 1: only the previous request is in flight, so the other rank is always the emptier
    assert scheduling.sglang_total_requests_assign(4, 2, 1).tolist() == [0, 1, 0, 1]
    # window 2 over 3 ranks: requests leave before the third rank would be reached again
    assert scheduling.sglang_total_requests_assign(5, 3, 2).tolist() == [0, 1, 2, 0, 1]


def test_total_tokens_counts_prompt_tokens_not_requests():
    tokens = np.array([100.0, 1.0, 1.0, 1.0])
    # one long prompt holds rank 0; the short ones all go to rank 1, where total_requests alternates
    assert scheduling.sglang_total_tokens_assign(tokens, 2, 100).tolist() == [0, 1, 1, 1]
    assert scheduling.sglang_total_requests_assign(len(tokens), 2, 100).tolist() == [0, 1, 0, 1]
    # once the long prompt leaves the window (window 2), rank 0 is the emptier again
    assert scheduling.sglang_total_tokens_assign(tokens, 2, 2).tolist() == [0, 1, 1, 0]


def test_total_tokens_ties_go_to_the_rank_with_fewer_requests():
    # after [1 -> 0, 2 -> 1, 1 -> 0] both ranks hold 2 tokens, rank 0 in two requests, rank 1 in
    # one: the tie goes to rank 1 (a lowest-rank tie rule would pick rank 0)
    tokens = np.array([1.0, 2.0, 1.0, 5.0])
    assert scheduling.sglang_total_tokens_assign(tokens, 2, 100).tolist() == [0, 1, 0, 1]
    # a full tie (tokens and requests) goes to the lowest rank
    assert scheduling.sglang_total_tokens_assign(np.array([3.0, 3.0, 3.0]), 3, 100).tolist() == [0, 1, 2]


@pytest.mark.parametrize("ep_size,window", [(2, 1), (3, 5), (4, 16), (8, 256)])
def test_rules_equal_the_restatement_on_random_arrivals(ep_size, window):
    rng = np.random.default_rng(ep_size * 1000 + window)
    tokens = rng.integers(1, 6, 500)  # a narrow range: many ties on tokens
    requests = scheduling.sglang_total_requests_assign(len(tokens), ep_size, window)
    by_tokens = scheduling.sglang_total_tokens_assign(tokens.astype(np.float64), ep_size, window)
    assert requests.tolist() == sglang_by_hand("total_requests", tokens.tolist(), ep_size, window)
    assert by_tokens.tolist() == sglang_by_hand("total_tokens", tokens.tolist(), ep_size, window)
    if window > 1:  # with one request in flight both rules just avoid its rank
        assert requests.tolist() != by_tokens.tolist()


@pytest.fixture(scope="module")
def dp_rows():
    """DP evaluation of Sem-MoE (its tables) and of vanilla (the engines' round-robin default)
    on routing with token-expert affinity (synthetic: quick to solve)."""
    profile, trace = synthetic_trace(num_layers=4, num_experts=32, top_k=4, num_requests=400, seed=1).split(0.3, seed=0)
    config = EvalConfig(mode="dp", dp_window=32, dp_decode_weight=64.0)
    semmoe = get_policy("semmoe").solve(profile, 4, mode="dp")
    vanilla = get_policy("vanilla").solve(profile, 4)
    return trace, vanilla, {
        "semmoe": evaluate(trace, semmoe, build_tables(profile, semmoe, mode="dp"), config),
        "vanilla": evaluate(trace, vanilla, None, config),
    }


def test_evaluate_reports_each_baselines_balance_and_locality(dp_rows):
    trace, vanilla, rows = dp_rows
    lengths = np.diff(trace.offsets)
    work = scheduling.request_work(lengths, 64.0)
    expected = {
        "sglang_total_requests": sglang_by_hand("total_requests", lengths.tolist(), 4, 32),
        "sglang_total_tokens": sglang_by_hand("total_tokens", lengths.tolist(), 4, 32),
    }
    for name, ranks in expected.items():
        imbalance = scheduling.window_imbalance(np.array(ranks), work, 4, 32)
        for row in rows.values():
            assert row[f"window_imbalance_{name}"] == pytest.approx(imbalance)
    for row in rows.values():
        for name in DP_BASELINES:
            assert 0.0 < row[f"lar_{name}"] < 1.0
    # vanilla is served round-robin: the round-robin baseline is its own rank choice
    assert rows["vanilla"]["lar_round_robin"] == pytest.approx(rows["vanilla"]["lar"])
    # the SGLang baselines' LAR counts their own rank choice on the placement: recomputed here
    # from the trace and the placement's expert ranks
    device = np.repeat(np.array(expected["sglang_total_tokens"]), lengths)  # [T]
    home = vanilla.expert_device[np.arange(trace.num_layers)[None, :, None], trace.experts.astype(np.int64)]
    local = (home == device[:, None, None]).mean()
    assert rows["vanilla"]["lar_sglang_total_tokens"] == pytest.approx(local)
    # on Sem-MoE's placement, its own rank choice keeps more activations local than any
    # locality-blind balancer
    semmoe = rows["semmoe"]
    assert semmoe["lar"] > max(semmoe[f"lar_{name}"] for name in DP_BASELINES)


def test_eval_cli_prints_the_sglang_columns(small_trace, tmp_path, capsys):
    from vllm_semmoe.cli import main

    path = tmp_path / "small.npz"
    small_trace.save(path)
    out = tmp_path / "e.json"
    assert main(["eval", "--profile", str(path), "--profile-frac", "0.3", "--ep", "4", "--mode", "dp",
                 "--method", "vanilla", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for column in ("window_imbalance_sglang_total_requests", "window_imbalance_sglang_total_tokens",
                   "lar_sglang_total_requests", "lar_sglang_total_tokens", "lar_least_loaded"):
        assert column in printed
    row = json.loads(out.read_text())["methods"]["vanilla"]
    assert {f"window_imbalance_{name}" for name in DP_BASELINES} | {f"lar_{name}" for name in DP_BASELINES} <= set(row)
