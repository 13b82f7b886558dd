"""Attention-DP in vLLM: the rank chooser, and DP=2 + EP serving with Sem-MoE routing."""

import contextlib
import io
import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_semmoe.assets import tiny_moe_path
from vllm_semmoe.core.placement import Placement
from vllm_semmoe.core.synthetic import synthetic_trace
from vllm_semmoe.core.capture_store import read_segment
from vllm_semmoe.core.tables import build_tables, load_tables

from vllm_semmoe.vllm_adapter.dp_routing import DpRouter
from shared_fixtures import DATA_DIR, per_label


#: requests each DP 2 server of :func:`dp2_served` answers
NUM_PROMPTS = 40


@pytest.fixture(scope="module")
def tables():
    trace = synthetic_trace(num_layers=4, num_experts=32, top_k=4, vocab_size=6144, num_requests=80, seed=1)
    e2d = np.tile(np.arange(32) // 16, (4, 1))
    return build_tables(trace, Placement(e2d, 2, "semmoe"), mode="dp")


def test_votes_prefer_the_rank_holding_the_prompts_experts(tables):
    router = DpRouter(tables, 2, balance=0.0)
    rows = tables.t2d_score.astype(np.float32).sum(axis=0)  # [J, E]
    token_for_rank = [int(tables.t2d_tokens[np.argmax(rows[:, r] - rows[:, 1 - r])]) for r in range(2)]
    for rank in range(2):
        assert router.choose([token_for_rank[rank]] * 20, [0, 0], f"r{rank}") == rank
    assert router.requests.tolist() == [1, 1] and router.prompt_tokens.tolist() == [20, 20]


def test_router_counters_stay_on_metrics_after_vllms_stat_logger_starts(tables):
    """An API server builds the router with vLLM's DP client, before vLLM's stat logger, which
    then removes every ``vllm:*`` collector from the default registry; with one API server that
    registry is ``/metrics``, and the router's counters must still be on it."""
    from prometheus_client import REGISTRY, generate_latest
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    def requests_per_rank() -> dict:
        return per_label(generate_latest(REGISTRY).decode(), "vllm:semmoe_requests_total", "dp_rank")

    router = DpRouter(tables, 2, balance=0.0)
    before = requests_per_rank()
    rank = router.choose([int(tables.t2d_tokens[0])] * 5, [0, 0], "a")
    unregister_vllm_metrics()
    assert requests_per_rank() == {**before, rank: before.get(rank, 0.0) + 1.0}


def test_guard_excludes_busy_ranks(tables):
    router = DpRouter(tables, 2, balance=0.0, slack=2)
    prompt = [int(tables.t2d_tokens[0])] * 5
    preferred = router.choose(prompt, [0, 0], "a")
    scores = [0, 0]
    scores[preferred] = 3  # more than `slack` above the other rank
    assert router.choose(prompt, scores, "b") == 1 - preferred


def test_in_flight_work_balances_lock_stepped_ranks(tables):
    """Every request prefers the same rank; each generates one token per step and finishes
    after 8 steps, one request arriving per step (the router sees the tokens and finishes as
    vLLM's output hook passes them on). With the balance knob the in-flight work stays within a
    few requests of even; without it everything goes to the preferred rank."""
    prompt = [int(tables.t2d_tokens[0])] * 30

    def serve(router):
        ranks, spread, running = [], 0, {}
        for step in range(200):
            unfinished = np.bincount([ranks[int(r[1:])] for r in running], minlength=2)
            spread = max(spread, int(unfinished.max() - unfinished.min()))
            ranks.append(router.choose(prompt, unfinished.tolist(), f"r{step}"))
            running[f"r{step}"] = 0
            outputs = [SimpleNamespace(request_id=r, new_token_ids=[7]) for r in running]
            for r in running:
                running[r] += 1
            finished = {r for r, n in running.items() if n == 8}
            router.observe(outputs, finished)
            running = {r: n for r, n in running.items() if r not in finished}
        return np.bincount(ranks, minlength=2), spread

    assert serve(DpRouter(tables, 2, balance=0.0, price_step=0.0))[0].min() == 0
    total, spread = serve(DpRouter(tables, 2))  # the default knobs
    assert spread <= 3 and total.max() / total.mean() < 1.15
    # the prices alone (learned from the work sent) balance the totals too
    total, _ = serve(DpRouter(tables, 2, balance=0.0))
    assert total.max() / total.mean() < 1.15


def test_router_prices_follow_the_work_it_sends(tables):
    """The router keeps the prices of :func:`scheduling.dp_choose_balanced` across requests:
    the chosen rank's price rises with the request's work (zero mean)."""
    router = DpRouter(tables, 2, balance=0.0, price_step=0.5, decode_weight=10.0)
    prompt = [int(tables.t2d_tokens[0])] * 10
    rank = router.choose(prompt, [0, 0], "r0")
    # the first request is the mean request: its rank's price rises by 0.5 x 1, both fall by 0.25
    expected = np.full(2, -0.25)
    expected[rank] += 0.5
    np.testing.assert_allclose(router.price, expected)


def test_in_flight_work_is_prompt_plus_generated_tokens(tables):
    """In-flight work per rank: prompt plus generated tokens of the router's unfinished requests
    (from the outputs vLLM passes on), and the mean of those for requests vLLM counts beyond the
    router's own (another API server's)."""
    router = DpRouter(tables, 2, decode_weight=10.0)
    for rid, length in (("a", 5), ("b", 7), ("c", 100)):
        router.record(rid, 0, length)
    np.testing.assert_allclose(router.in_flight_work([3, 0]), [112, 0])
    # a and c generate 3 and 1 tokens; another request's output (not this router's) is ignored
    router.observe([SimpleNamespace(request_id="a", new_token_ids=[1, 2, 3]),
                    SimpleNamespace(request_id="c", new_token_ids=[4]),
                    SimpleNamespace(request_id="elsewhere", new_token_ids=[5])], None)
    np.testing.assert_allclose(router.in_flight_work([3, 0]), [116, 0])
    # b finishes: 2 of this router's requests left on rank 0 (8 + 101 tokens); vLLM counts one
    # more there and one on rank 1, each weighing the mean of the router's own (109 / 2)
    router.observe([], {"b", "never-sent"})
    assert router.in_flight_requests.tolist() == [2, 0]
    np.testing.assert_allclose(router.in_flight_work([3, 1]), [109 + 54.5, 54.5])
    # before any request is in flight, others' requests weigh the mean work routed (prompt + 10)
    router.observe([], {"a", "c"})
    np.testing.assert_allclose(router.in_flight_work([1, 0]), [(15 + 17 + 110) / 3, 0])
    assert router.requests.tolist() == [3, 0]  # the routed counts are kept


def test_tables_must_split_over_ranks(tables):
    with pytest.raises(ValueError, match="cannot be split over 3 DP ranks"):
        DpRouter(tables, 3)


def _rank_counters(workdir, name: str) -> list[dict]:
    return [json.loads((workdir / f"served_{name}.dp{rank}.npz.live.json").read_text()) for rank in range(2)]


def _captured_steps(workdir, name: str, rank: int) -> list[dict]:
    """The steps DP rank ``rank`` computed, as its engine captured them (one record per forward)."""
    return read_segment(str(workdir / f"served_{name}.npz.parts" / f"dp{rank}.seg"))[1]


def _remote_rows(steps: list[dict], placement, rank: int) -> int:
    """Rows ``rank`` must send for its captured ``steps``: per token and MoE layer, one per
    other rank that serves one of the token's experts (the send set, computed here
    independently): the rank's own copy where it holds one, else the other rank (with two
    ranks every copy this rank lacks is there, so the choice among copies cannot matter)."""
    holds = placement.holds()  # [L, N, E]
    experts = np.concatenate([step["experts"] for step in steps])  # [n, L, K] logical
    layers = np.arange(experts.shape[1])[None, :, None]
    dest = np.where(holds[layers, experts, rank], rank, 1 - rank)
    return int(sum((dest == other).any(axis=-1).sum() for other in range(2) if other != rank))


#: tokens of the dummy batch an idle DP rank runs so that its MoE layers join the other ranks'
#: collectives (vLLM's ``Worker.execute_dummy_batch``: ``uniform_decode_query_len``, one token
#: without speculative decoding)
DUMMY_BATCH_TOKENS = 1


def _moe_rows(steps: list[dict], layers_run: int, num_layers: int) -> tuple[int, int]:
    """``(rows, forwards)`` a DP rank handed to its MoE layers' collectives, per MoE layer: the
    tokens of its captured steps plus :data:`DUMMY_BATCH_TOKENS` per dummy batch. The dummy
    batches are the forwards the capture does not hold (they serve no request): the rank's MoE
    layer calls (``layers_run``, every call of every layer) over its MoE layers, less its
    captured steps."""
    assert layers_run % num_layers == 0, f"{layers_run} MoE layer calls over {num_layers} layers"
    forwards = layers_run // num_layers
    dummies = forwards - len(steps)
    assert dummies >= 0, f"{len(steps)} captured steps but {forwards} forwards"
    return sum(len(step["token"]) for step in steps) + dummies * DUMMY_BATCH_TOKENS, forwards


@pytest.fixture(scope="module")
def dp2_served(tmp_path_factory) -> SimpleNamespace:
    """DP 2 + EP on the tiny model, compiled (as ``vllm serve`` runs by default), the same
    :data:`NUM_PROMPTS` ShareGPT prompts per server, tables solved on one profile, through one
    ``semmoe bench-serve --policy vllm,sparse,semmoe --redundant 0,1``: stock vLLM (metered), stock
    vLLM with the sparse dispatch, then Sem-MoE (placement, routing, sparse dispatch) without and
    with one replica slot per rank, one server each (one API server: the checks are the engines' and
    the router's; the counters on ``/metrics`` across API servers: ``test_multinode.py``), all in
    one work directory. ``runs``: by name
    (``semmoe_r1``: one replica slot per rank), ``cli``: the command's JSON, ``printed``: its report.
    In float32: Sem-MoE's routing puts requests in other batches than stock vLLM's, and vLLM is
    not batch-invariant in bfloat16, where a different batch can flip a near-tied greedy token;
    that would hide what the identical-texts check asks: that the plugin changes no output."""
    from vllm_semmoe.cli import main
    from vllm_semmoe.tools.profiling import profile

    tmp = tmp_path_factory.mktemp("dp2_served")
    model, dataset = str(tiny_moe_path()), str(DATA_DIR / "text" / "sharegpt_4k.jsonl.gz")
    trace = tmp / "profile.npz"
    switch = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    profile(model, dataset, 60, str(trace), skip=3000)
    # the in-process engine's setting ends with it: the servers start as `vllm serve` starts them
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == switch
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = main(["bench-serve", "--model", model, "--dataset", dataset, "--dp", "2",
                   "--policy", "vllm,sparse,semmoe", "--redundant", "0,1", "--num-prompts", str(NUM_PROMPTS),
                   "--concurrency", "8", "--max-tokens", "8", "--profile-trace", str(trace), "--workdir", str(tmp),
                   "--api-server-count", "1", "--dtype", "float32", "--json", str(tmp / "bench.json")])
    assert rc == 0, printed.getvalue()
    cli = json.loads((tmp / "bench.json").read_text())
    runs = {_run_name(run): run for run in cli["runs"].values()}
    assert sorted(runs) == ["semmoe", "semmoe_r1", "sparse", "vllm"], sorted(cli["runs"])
    return SimpleNamespace(workdir=tmp, runs=runs, cli=cli, printed=printed.getvalue())


def _check_runs(workdir, runs: dict) -> None:
    """Every server answered every request, compiled, with load on both ranks and a live LAR."""
    for name, run in runs.items():
        # served as `vllm serve` runs by default: compiled (the engines' own config line says so)
        assert run["compiled"], name
        assert run["ok"] == NUM_PROMPTS and run["failed"] == 0, run["errors"]
        assert all(tokens > 0 for tokens in run["rank_prompt_tokens"])
        assert 0.0 < run["live_lar"] < 1.0
        json.dumps(run)
        assert "enforce_eager=False" in (workdir / f"server_{name}.log").read_text()


def _run_name(run: dict) -> str:
    """What :func:`run_bench_serve` names a run's capture and counters by (``served_<name>...``)."""
    return f"{run['policy']}{'_r%d' % run['redundant'] if run['redundant'] else ''}"


def _check_counters(model, tmp_path, runs) -> None:
    """The engines' byte counters against what they must be, computed here from the model's
    shape, the run's dtype and the captured routing, not from what the counters counted.

    Every MoE layer of every real step and of every dummy batch an idle rank runs in lock-step
    moves rows (:func:`_moe_rows`). Stock vLLM's all-gather / reduce-scatter stage
    (``MoEPrepareAndFinalizeNaiveDPEPModular``): ``prepare`` all-gathers every rank's hidden
    states, so a rank sends each of its rows to each other rank (``hidden_size`` values of the
    run's dtype); ``finalize`` reduce-scatters the partial sums of every row over every rank, so
    a rank sends back the partial sums of the other ranks' rows. Sparse: the rows the captured
    routing must send (:func:`_remote_rows`, from the capture and the placement), plus at most
    the dummy batches' rows; combine = the other rank's dispatch.
    """
    import torch

    config = json.loads((Path(model) / "config.json").read_text())
    layers = load_tables(str(tmp_path / "tables_vanilla_dp2")).num_layers
    for run in runs.values():
        policy = run["policy"]
        row = config["hidden_size"] * torch.empty(0, dtype=getattr(torch, run["dtype"])).element_size()
        ranks = _rank_counters(tmp_path, _run_name(run))
        steps = [_captured_steps(tmp_path, _run_name(run), rank) for rank in range(2)]
        moved = [_moe_rows(steps[rank], ranks[rank]["moe_traffic"]["layers_run"], layers) for rank in range(2)]
        rows = [r for r, _ in moved]
        # every MoE layer call is a collective of both ranks: they run the same forwards
        assert moved[0][1] == moved[1][1], (policy, moved)
        method = "vanilla" if policy in ("vllm", "sparse") else "semmoe"
        tables = f"tables_{method}_dp2{'_r%d' % run['redundant'] if run['redundant'] else ''}"
        placement = load_tables(str(tmp_path / tables)).placement
        for rank, live in enumerate(ranks):
            traffic = live["moe_traffic"]
            assert traffic["tokens"] == rows[rank] * layers, (policy, rank)
            if policy == "vllm":  # all-gathered to the other rank, its rows reduce-scattered back
                assert traffic["dispatch_bytes"] == rows[rank] * layers * row, (policy, rank)
                assert traffic["combine_bytes"] == rows[1 - rank] * layers * row, (policy, rank)
            else:
                captured = _remote_rows(steps[rank], placement, rank) * row
                dummy_rows = (rows[rank] - sum(len(step["token"]) for step in steps[rank])) * layers
                assert captured <= traffic["dispatch_bytes"] <= captured + dummy_rows * row, (policy, rank)
                assert traffic["combine_bytes"] == ranks[1 - rank]["moe_traffic"]["dispatch_bytes"], (policy, rank)
            # the exchange's own activation count covers the recorder's (captured ids, placement)
            assert traffic["local_activations"] >= live["local_activations"], (policy, rank)


def test_dp2_sparse_dispatch_is_exact_and_moves_only_what_is_remote(dp2_served):
    """DP 2 + EP on the tiny model, the same 40 prompts served by stock vLLM (metered), by stock
    vLLM with the sparse dispatch, and by Sem-MoE (placement, routing, sparse dispatch) without
    and with one replica slot per rank (:func:`dp2_served`): the sparse dispatch gives stock
    vLLM's text, token for token; the engines' byte counters are
    what the routing implies (:func:`_check_counters`, replicas serving their own rank's tokens);
    Sem-MoE moves fewer bytes than the sparse dispatch alone, which moves fewer than stock, and
    the replica slot raises the engines' LAR and cuts their bytes. (Replicas' exactness:
    ``test_serve_dp2_matches_tp1[ep_replicas]``.)"""
    tmp_path, runs = dp2_served.workdir, dp2_served.runs
    _check_runs(tmp_path, runs)
    assert runs["sparse"]["outputs"] == runs["vllm"]["outputs"]
    _check_counters(tiny_moe_path(), tmp_path, runs)
    assert runs["semmoe"]["moe_bytes_per_token"] < runs["sparse"]["moe_bytes_per_token"] \
        < runs["vllm"]["moe_bytes_per_token"]
    print("DP 2 + EP, live LAR and MoE bytes per token:",
          json.dumps({name: [run["live_lar"], run["moe_bytes_per_token"]] for name, run in runs.items()}))
    # the replica slot serves this rank's tokens: more activations local, fewer bytes
    assert runs["semmoe_r1"]["live_lar"] > runs["semmoe"]["live_lar"]
    assert runs["semmoe_r1"]["moe_bytes_per_token"] < runs["semmoe"]["moe_bytes_per_token"]
    # the router saw every request it routed and, through vLLM's output hook, every token they
    # generated (its in-flight work), as the clients counted them, and every finish (none is
    # left in flight)
    for name in ("semmoe", "semmoe_r1"):
        run = runs[name]
        assert run["failed"] == 0 and run["metrics"]["requests_total"] == run["ok"], name
        assert run["metrics"]["generated_tokens_total"] == run["completion_tokens"] > 0, name
        assert run["metrics"]["finished_requests_total"] == run["ok"], name
    log = (tmp_path / "server_semmoe.log").read_text()
    assert "Sem-MoE DP routing over 2 ranks" in log and "sparse EP MoE dispatch on 4 MoE layers" in log
    assert "1 replica slot(s) per rank" in (tmp_path / "server_semmoe_r1.log").read_text()


def test_bench_serve_reports_every_run_it_served(dp2_served):
    """``semmoe bench-serve --dp 2 --policy vllm,sparse,semmoe --redundant 0,1``
    (:func:`dp2_served`): one server per policy and replica count, in that order; each is a row
    of the printed table and a key of the JSON, with its bytes per token as a ratio of the first
    policy's; the verdict on the outputs is what the servers' texts say. (``--repeat``'s order
    and medians: ``test_bench_serve_repeat.py``.)"""
    import re

    result, printed = dp2_served.cli, dp2_served.printed
    runs = result["runs"]
    assert list(runs) == ["vllm", "sparse", "semmoe", "semmoe R=1"]
    base = runs["vllm"]["moe_bytes_per_token"]
    for name, run in runs.items():
        row = rf"{re.escape(name)}\s+{run['ok']}\s+{run['failed']}\s+{run['moe_bytes_per_token']:.0f}\s+" \
              rf"{run['moe_bytes_per_token'] / base:.3f}x\s+{run['live_lar']:.4f}\s"
        assert any(re.match(row, line) for line in printed.splitlines()), (name, printed)
    same = len({json.dumps(run["outputs"]) for run in runs.values()}) == 1
    assert result["outputs_identical"] == same
    assert ("outputs identical across policies" if same else "OUTPUTS DIFFER across policies") in printed
