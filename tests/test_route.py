"""``semmoe route`` and :func:`vllm_semmoe.core.route.rank_dp_ranks`: Sem-MoE's DP rank choice for a
router outside vLLM ranks the ranks as the engine's router (``DpRouter``) would choose."""

import json
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_semmoe.core import scheduling
from vllm_semmoe.assets import tiny_moe_path
from vllm_semmoe.cli import main
from vllm_semmoe.core.placement import Placement
from vllm_semmoe.core.route import dp_rank_votes, rank_dp_ranks
from vllm_semmoe.core.synthetic import synthetic_trace
from vllm_semmoe.core.tables import build_tables
from vllm_semmoe.vllm_adapter.dp_routing import DpRouter

VOCAB = 6144  # the tiny model's vocabulary: its tokenizer's ids are the trace's token ids


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace(num_layers=4, num_experts=32, top_k=4, vocab_size=VOCAB, num_requests=80, seed=1)


def _tables(trace, ep_size: int):
    e2d = np.tile(np.arange(32) // (32 // ep_size), (4, 1))
    return build_tables(trace, Placement(e2d, ep_size, "semmoe"), mode="dp")


@pytest.fixture(scope="module")
def tables(trace):
    return _tables(trace, 2)


@pytest.fixture(scope="module")
def tables4(trace):
    return _tables(trace, 4)


def _prompts(trace, count: int = 40) -> list[list[int]]:
    """Prompts of the trace's requests, and of unseen token ids (the tables' fallback votes)."""
    prompts = [trace.tokens[trace.offsets[r]:trace.offsets[r + 1]].tolist() for r in range(count)]
    unseen = sorted(set(range(VOCAB)) - set(trace.tokens.tolist()))[:5]
    return prompts + [unseen]


@pytest.mark.parametrize("ep_size,num_ranks", [(2, 2), (4, 4), (4, 2)])
def test_zero_load_ranking_is_the_engines_choice(trace, tables, tables4, ep_size, num_ranks):
    """With no load, the top rank is what a fresh engine router picks for the request, and the
    ranking is by the router's own votes (ties: lower rank first)."""
    t = tables if ep_size == 2 else tables4
    tops = set()
    for i, prompt in enumerate(_prompts(trace)):
        ranking = rank_dp_ranks(t, prompt, num_ranks=num_ranks)
        router = DpRouter(t, num_ranks)
        assert ranking[0].rank == router.choose(prompt, [0] * num_ranks, f"r{i}")
        votes = router.votes(prompt)
        assert [r.rank for r in ranking] == sorted(range(num_ranks), key=lambda e: (-votes[e], e))
        assert [r.votes for r in ranking] == pytest.approx([votes[r.rank] for r in ranking])
        assert [r.score for r in ranking] == [r.votes for r in ranking] and {r.load for r in ranking} == {0.0}
        tops.add(ranking[0].rank)
    assert tops == set(range(num_ranks)), "the prompts prefer every rank"


def test_votes_sum_the_ranks_devices(tables4):
    prompt = [int(t) for t in tables4.t2d_tokens[:12]]
    per_device = dp_rank_votes(tables4, prompt, 4)
    assert dp_rank_votes(tables4, prompt, 2) == pytest.approx([per_device[:2].sum(), per_device[2:].sum()])
    assert dp_rank_votes(tables4, prompt, 1) == pytest.approx([per_device.sum()])
    with pytest.raises(ValueError, match="cannot be split over 3 DP ranks"):
        dp_rank_votes(tables4, prompt, 3)


def test_loaded_ranking_follows_the_engines_router_state(trace, tables):
    """Given the engine router's own state (in-flight work, mean work, prices) after it has
    routed and seen generate some requests, the top rank is the one it then chooses."""
    router = DpRouter(tables, 2)
    prompts = _prompts(trace)
    agree = 0
    for i, prompt in enumerate(prompts):
        scores = router.in_flight_requests.tolist()
        work = router.work(len(prompt))
        ranking = rank_dp_ranks(tables, prompt, loads=router.in_flight_work(scores),
                                mean_work=router.mean_work(pending=work), price=router.price.copy())
        chosen = router.choose(prompt, scores, f"r{i}")
        assert ranking[0].rank == chosen
        agree += ranking[0].votes == max(r.votes for r in ranking)
        # every request generates 3 tokens per step; each finishes after its fifth step
        outputs = [SimpleNamespace(request_id=rid, new_token_ids=[1, 2, 3]) for rid in router.in_flight]
        router.observe(outputs, [f"r{i - 4}"] if i >= 4 else None)
    assert agree < len(prompts), "the load moved some requests off their best-voted rank"


def test_scores_are_what_the_engines_rule_maximises():
    rng = np.random.default_rng(0)
    for _ in range(200):
        E = int(rng.integers(2, 9))
        votes, load, price = rng.random(E) * 50, rng.random(E) * 500, rng.normal(size=E)
        mean_work, work, balance = float(rng.uniform(10, 300)), float(rng.uniform(10, 300)), float(rng.uniform(0, 64))
        values = scheduling.dp_balanced_values(votes, load, mean_work, work, balance, price)
        before = price.copy()
        chosen = scheduling.dp_choose_balanced(votes, load, mean_work, work, balance, price, 0.2)
        assert chosen == int(np.argmax(values))
        gap = balance / mean_work ** 2
        assert values == pytest.approx(votes - work * (before + gap * (load - load.min())))


def test_bad_loads_are_refused(tables):
    with pytest.raises(ValueError, match="loads must be 2 non-negative numbers"):
        rank_dp_ranks(tables, [1, 2, 3], loads=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="loads must be 2 non-negative numbers"):
        rank_dp_ranks(tables, [1, 2, 3], loads=[1.0, -2.0])


@pytest.fixture(scope="module")
def tables_dir(tables, tmp_path_factory):
    path = tmp_path_factory.mktemp("route") / "tables_dp"
    tables.save(path)
    return path


def test_cli_prints_the_ranking_and_the_header(tables, tables_dir, capsys):
    prompt = [int(t) for t in tables.t2d_tokens[:20]]
    ids = ",".join(map(str, prompt))
    want = rank_dp_ranks(tables, prompt, loads=[300.0, 0.0], mean_work=200.0)
    assert main(["route", "--tables", str(tables_dir), "--token-ids", ids, "--loads", "300,0",
                 "--mean-work", "200"]) == 0
    printed = capsys.readouterr().out
    assert f"X-data-parallel-rank: {want[0].rank}" in printed and "20 prompt tokens" in printed
    assert main(["route", "--tables", str(tables_dir), "--token-ids", ids, "--loads", "300,0",
                 "--mean-work", "200", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)  # only the JSON on stdout
    assert payload["rank"] == want[0].rank and payload["header"] == {"X-data-parallel-rank": str(want[0].rank)}
    assert payload["ranks"] == [r.as_dict() for r in want] and payload["tokens"] == 20


def test_cli_tokenizes_a_prompt_as_vllm_does(tables, tables_dir, capsys):
    from transformers import AutoTokenizer

    text = "The quick brown fox jumps over the lazy dog. " * 3
    tokens = AutoTokenizer.from_pretrained(str(tiny_moe_path())).encode(text)
    assert main(["route", "--tables", str(tables_dir), "--prompt", text, "--tokenizer", str(tiny_moe_path()),
                 "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["tokens"] == len(tokens)
    assert payload["ranks"] == [r.as_dict() for r in rank_dp_ranks(tables, tokens)]


def test_cli_errors_are_one_line(trace, tables_dir, tmp_path, capsys):
    with pytest.raises(SystemExit, match="one of the two"):
        main(["route", "--tables", str(tables_dir)])
    with pytest.raises(SystemExit, match="--prompt needs --tokenizer"):
        main(["route", "--tables", str(tables_dir), "--prompt", "hi"])
    assert main(["route", "--tables", str(tables_dir), "--token-ids", "1,2", "--loads", "1,2,3"]) == 2
    err = capsys.readouterr().err
    assert "semmoe: error: loads must be 2 non-negative numbers" in err and "Traceback" not in err
    e2d = np.tile(np.arange(32) // 16, (4, 1))
    build_tables(trace, Placement(e2d, 2, "semmoe"), mode="tp").save(tmp_path / "tp")
    with pytest.raises(SystemExit, match="needs tables solved with --mode dp"):
        main(["route", "--tables", str(tmp_path / "tp"), "--token-ids", "1,2"])


def _prompt_tokens_per_engine(base: str) -> dict[int, float]:
    """``vllm:prompt_tokens_total`` per DP engine on a vLLM server's ``/metrics``."""
    import re
    import urllib.request

    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    counts = {}
    for labels, value in re.findall(r"^vllm:prompt_tokens_total\{([^}]*)\} (\S+)$", text, re.M):
        engine = re.search(r'engine="(\d+)"', labels)
        if engine:
            counts[int(engine.group(1))] = counts.get(int(engine.group(1)), 0.0) + float(value)
    return counts


def check_route_header_steers_requests(base: str, tables_dir, model: str, num_ranks: int = 2) -> None:
    """On a running DP server in mode ``dp`` with ``tables_dir``: for each rank, a prompt whose
    votes prefer it (so the engine's own router, idle, would send it there) and an outside
    router's load report that puts heavy in-flight work on that rank; ``semmoe route`` (the
    command, as an outside router runs it) then names another rank, and the request sent with
    vLLM's ``X-data-parallel-rank`` header set from it lands there (its prompt tokens count on
    that engine, none on the others). Called by the DP serving test that already runs such a
    server (``test_compiled.py``)."""
    import subprocess
    import sys
    import time
    import urllib.request

    from vllm_semmoe.core.tables import load_tables

    tables = load_tables(tables_dir)
    rows = tables.t2d_score.astype(np.float32).sum(axis=0).reshape(len(tables.t2d_tokens), num_ranks, -1).sum(axis=2)
    landed = set()
    for preferred in range(num_ranks):
        others = np.delete(rows, preferred, axis=1).max(axis=1)
        prompt = [int(tables.t2d_tokens[np.argmax(rows[:, preferred] - others)])] * (17 + preferred)
        assert rank_dp_ranks(tables, prompt, num_ranks=num_ranks)[0].rank == preferred
        loads = ",".join("10000" if e == preferred else "0" for e in range(num_ranks))
        routed = subprocess.run([sys.executable, "-m", "vllm_semmoe.cli", "route", "--tables", str(tables_dir),
                                 "--dp", str(num_ranks), "--token-ids", ",".join(map(str, prompt)),
                                 "--loads", loads, "--json"], capture_output=True, text=True, timeout=300)
        assert routed.returncode == 0, routed.stderr
        answer = json.loads(routed.stdout)
        target = answer["rank"]
        assert target != preferred and answer["header"] == {"X-data-parallel-rank": str(target)}, answer
        before = _prompt_tokens_per_engine(base)
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}).encode()
        request = urllib.request.Request(f"{base}/v1/completions", data=body, method="POST",
                                         headers={"Content-Type": "application/json", **answer["header"]})
        with urllib.request.urlopen(request, timeout=180) as resp:
            assert resp.status == 200
        deadline = time.monotonic() + 30  # the API server counts a request's stats as its outputs arrive
        while True:
            after = _prompt_tokens_per_engine(base)
            moved = {e: after.get(e, 0.0) - before.get(e, 0.0) for e in range(num_ranks)}
            if moved[target] >= len(prompt) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert moved == {e: float(len(prompt)) if e == target else 0.0 for e in range(num_ranks)}, (target, moved)
        landed.add(target)
    assert landed == set(range(num_ranks)), landed


@pytest.mark.parametrize("balancing", ["internal", "hybrid", "external"])
def test_engine_start_says_who_routes_under_each_dp_balancing(balancing, tables_dir, caplog):
    """``dp`` mode routes inside vLLM's balancer; at engine start the plugin says where that
    balancer sees only this node's ranks (hybrid) or no choice at all (external: the outside
    router must call ``semmoe route``). vLLM's own ``ParallelConfig`` carries the setting."""
    import logging

    from vllm.config import ParallelConfig

    from vllm_semmoe.vllm_adapter.checks import check_load_balancing
    from vllm_semmoe.vllm_adapter.config import SemMoEConfig

    parallel = ParallelConfig(data_parallel_size=2, data_parallel_size_local=1, data_parallel_rank=0,
                              data_parallel_hybrid_lb=balancing == "hybrid",
                              data_parallel_external_lb=balancing == "external")
    config = SemMoEConfig.from_additional_config({"semmoe": {"tables": str(tables_dir), "mode": "dp"}})
    with caplog.at_level(logging.INFO, logger="vllm.semmoe"):
        check_load_balancing(config, SimpleNamespace(parallel_config=parallel))
    said = " ".join(r.getMessage() for r in caplog.records)
    assert ("routes nothing" in said and "semmoe route" in said) == (balancing == "external")
    assert ("among its own 1 DP rank" in said) == (balancing == "hybrid")
