"""GPU check, engine part (run by scripts/gpu_check.sh): device-side TP decision vs Numba on the
GPU, the tiny model through CUDA vLLM with placement + capture, and the decision timed against a
MoE layer. Writes ``OUT/engine.json``.

``--no-vllm`` (a GPU machine without a CUDA vLLM, e.g. no network to install one): the parts that
need none: the decision against Numba, and the decision and the shuffle kernels timed on the GPU
against the expert FLOPs of a MoE layer of the same batch (one dense bf16 GEMM of those FLOPs,
a lower bound of the layer's time, so the shares printed are upper bounds)."""

import json
import os
import sys
import time


def decision_matches(trials: int = 200) -> dict:
    import numpy as np
    import torch

    from vllm_semmoe.core import scheduling
    from vllm_semmoe.kernels import scheduling_torch

    rng = np.random.default_rng(0)
    bad = 0
    for _ in range(trials):
        E, J, B = int(rng.choice([2, 4, 8])), int(rng.integers(1, 64)), int(rng.integers(1, 2048))
        t2d = rng.random((J, E), np.float32)
        t2d /= t2d.sum(1, keepdims=True)
        oov = rng.random(E, np.float32)
        oov /= oov.sum()
        markov = rng.random((E * E, E), np.float32)
        markov /= markov.sum(1, keepdims=True)
        rows = rng.integers(-1, J, B).astype(np.int64)
        hist = np.where(rng.random(B) < 0.3, -1, rng.integers(0, E * E, B)).astype(np.int64)
        want = scheduling.tp_schedule(rows, hist, t2d, oov, markov, E)
        got = scheduling_torch.tp_schedule(*(torch.from_numpy(a).cuda() for a in (rows, hist, t2d, oov, markov)), E)
        bad += any(not np.array_equal(g.cpu().numpy(), w) for g, w in zip(got, want))
    # the engine's rule (X table): scores to float32 rounding, decisions of the same value
    worst = 0.0
    for _ in range(trials // 4):
        args, weights, E = _expert_rule_inputs(rng, int(rng.integers(1, 2048)))
        want = scheduling.tp_expert_scores(*args, np.asarray(weights))
        got = scheduling_torch.tp_expert_scores(*(torch.from_numpy(a).cuda() for a in args), weights).cpu().numpy()
        worst = max(worst, float(np.abs(got - want).max()))
        rows_ = np.arange(len(want))
        value_got = float(want[rows_, scheduling_torch.tp_decide(torch.from_numpy(got).cuda(), E)[0].cpu().numpy()].sum())
        value_want = float(want[rows_, scheduling.tp_decide(want, E)[0]].sum())
        bad += abs(value_got - value_want) > 1e-4 * max(1.0, value_want)
    return {"decision_trials": trials + trials // 4, "decision_mismatches": bad, "expert_rule_max_score_diff": worst}


def _expert_rule_inputs(rng, B, E=8, N=64, K=6, J=4096):
    """Random inputs of :func:`vllm_semmoe.core.scheduling.tp_expert_scores` (DeepSeek-V2-Lite's shape)."""
    import numpy as np

    def dist(*shape):
        x = rng.random(shape) + 0.05
        return x / x.sum(axis=-1, keepdims=True)

    prior = dist(N)
    holds = np.zeros((N, E), np.float32)
    holds[np.arange(N), rng.permutation(np.arange(N) % E)] = 1.0
    prev = rng.integers(0, N, (B, 2, K)).astype(np.int64)
    args = (rng.integers(-1, J, B).astype(np.int64), prev, dist(J, E).astype(np.float32), dist(E).astype(np.float32),
            np.log(dist(2, N, N) / prior).astype(np.float32), np.log(prior).astype(np.float32), holds)
    return args, (0.3, 0.3, 0.2), E


def time_moe_vs_decision(worker) -> dict:
    """On the engine's GPU: one MoE layer (gate, top-k, experts) vs the device-side decision."""
    import numpy as np
    import torch

    from vllm_semmoe.kernels import scheduling_torch
    from vllm_semmoe.vllm_adapter import compat
    from vllm_semmoe.vllm_adapter.replacement import moe_runners

    runner = getattr(worker, "model_runner", worker)
    layer = moe_runners(runner.get_model())[0]
    H = layer.routed_experts.w2_weight.shape[1]
    results = {}
    for B in (64, 512, 4096):
        x = torch.randn(B, H, device="cuda", dtype=torch.bfloat16)
        args, weights, E = _expert_rule_inputs(np.random.default_rng(B), B)
        args = tuple(torch.from_numpy(a).cuda() for a in args)

        def moe():
            logits, _ = layer.gate(x)
            w, ids = compat.select_experts(layer, x, logits)
            return compat.experts_forward(layer.routed_experts, x, w, ids)

        def decide():
            return scheduling_torch.tp_decide(scheduling_torch.tp_expert_scores(*args, weights), E)

        out = {"moe_layer_ms": _cuda_ms(moe), "decision_ms": _cuda_ms(decide)}
        out["decision_share"] = out["decision_ms"] / (out["decision_ms"] + out["moe_layer_ms"])
        results[str(B)] = out
    return results


def _cuda_ms(fn, reps: int = 20) -> float:
    """Mean milliseconds of ``fn()`` on the GPU (CUDA events; 3 warm-up calls, then ``reps``)."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def time_without_vllm() -> dict:
    """Per batch B (DeepSeek-V2-Lite's MoE shape: H 2048, top-6 of 64 experts, intermediate 1408,
    EP 8): the device-side decision, whole and by part (scores, price rounds as the Triton kernel
    and as PyTorch ops, the flag read, the host repair when it runs, the permutation), the rounds
    kernel at other tile sizes and warp counts, the Triton SRS pack + SAG unpack (bf16 rows)
    against their PyTorch references, and one dense bf16 GEMM with the layer's expert FLOPs."""
    import numpy as np
    import torch

    from csrc_triton import align as align_kernel
    from csrc_triton import shuffle
    from vllm_semmoe.core import scheduling
    from vllm_semmoe.kernels import scheduling_torch

    H, K, I = 2048, 6, 1408
    rounds = scheduling_torch.ROUNDS
    results = {}
    for B in (64, 512, 4096, 16384):
        args, weights, E = _expert_rule_inputs(np.random.default_rng(B), B)
        args = tuple(torch.from_numpy(a).cuda() for a in args)
        x = torch.randn(B, H, device="cuda", dtype=torch.bfloat16)
        scores = scheduling_torch.tp_expert_scores(*args, weights)
        device, slot_token, token_slot = scheduling_torch.tp_decide(scores, E)
        packed = shuffle.srs_pack(x, slot_token)
        scores = scores.to(torch.float64)
        cap = scheduling.slice_capacity(B, E)
        rounds_device, load, over = align_kernel.align_rounds(scores, cap, rounds)
        a = torch.randn(B * K, H, device="cuda", dtype=torch.bfloat16)
        w13 = torch.randn(H, 2 * I, device="cuda", dtype=torch.bfloat16)
        w2 = torch.randn(I, H, device="cuda", dtype=torch.bfloat16)
        out = {
            "decision_ms": _cuda_ms(lambda: scheduling_torch.tp_decide(scheduling_torch.tp_expert_scores(*args, weights), E)),
            "scores_ms": _cuda_ms(lambda: scheduling_torch.tp_expert_scores(*args, weights)),
            "rounds_triton_ms": _cuda_ms(lambda: align_kernel.align_rounds(scores, cap, rounds)),
            "rounds_torch_ops_ms": _cuda_ms(lambda: scheduling_torch._align_rounds_torch(scores, float(cap), rounds)),
            "flag_read_ms": _cuda_ms(lambda: bool(over.item())),
            "repair_ms": _cuda_ms(lambda: scheduling_torch._repair(scores, rounds_device, load, float(cap))),
            "permutation_ms": _cuda_ms(lambda: scheduling_torch.shuffle_permutation(device, E, cap)),
            "shuffle_triton_ms": _cuda_ms(lambda: shuffle.sag_unpack(shuffle.srs_pack(x, slot_token), token_slot)),
            "shuffle_reference_ms": _cuda_ms(lambda: shuffle.sag_unpack_reference(
                shuffle.srs_pack_reference(x, slot_token), token_slot)),
            "expert_flops_gemm_ms": _cuda_ms(lambda: (a @ w13)[:, :I] @ w2),
        }
        for tile, warps in ((4096, 8), (8192, 8), (8192, 16), (16384, 16)):
            out[f"rounds_triton_ms_tile{tile}_warps{warps}"] = _cuda_ms(
                lambda: align_kernel.align_rounds(scores, cap, rounds, tile=tile, num_warps=warps))
            same = align_kernel.align_rounds(scores, cap, rounds, tile=tile, num_warps=warps)
            out.setdefault("tiles_agree", True)
            out["tiles_agree"] &= torch.equal(same[0], rounds_device) and torch.equal(same[1], load)
        out["decision_share_upper_bound"] = out["decision_ms"] / (out["decision_ms"] + out["expert_flops_gemm_ms"])
        out["shuffle_share_upper_bound"] = out["shuffle_triton_ms"] / (out["shuffle_triton_ms"] + out["expert_flops_gemm_ms"])
        out["repair_ran"] = bool(over.item())
        out["permutation_equal_numba"] = bool(np.array_equal(
            scheduling_torch.shuffle_permutation(device, E, cap)[0].cpu().numpy(),
            scheduling.shuffle_permutation(device.cpu().numpy(), E, cap)[0]))
        out["packed_equal_reference"] = bool(torch.equal(packed, shuffle.srs_pack_reference(x, slot_token)))
        results[str(B)] = out
    return results


def main_without_vllm(out_dir: str) -> None:
    import torch

    summary = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "vllm": None}
    import triton

    summary["triton"] = triton.__version__
    summary.update(decision_matches())
    summary["timing_without_vllm"] = time_without_vllm()
    with open(os.path.join(out_dir, "engine.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary))
    ok = summary["decision_mismatches"] == 0 and all(
        v["packed_equal_reference"] and v["tiles_agree"] and v["permutation_equal_numba"]
        for v in summary["timing_without_vllm"].values())
    sys.exit(0 if ok else 1)


def main() -> None:
    if sys.argv[1] == "--no-vllm":
        return main_without_vllm(sys.argv[2])
    out_dir = sys.argv[1]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import gc

    import torch

    from vllm import LLM, SamplingParams

    from vllm_semmoe.assets import tiny_moe_path
    from vllm_semmoe.core.policy import get_policy
    from vllm_semmoe.core.synthetic import synthetic_trace
    from vllm_semmoe.core.tables import build_tables
    from vllm_semmoe.core.capture_store import load_trace
    from vllm_semmoe.vllm_adapter.config import SemMoEConfigError
    from vllm_semmoe.vllm_adapter.recording import flush_capture

    summary = {"gpu": torch.cuda.get_device_name(0)}
    import vllm
    summary["vllm"] = vllm.__version__
    summary.update(decision_matches())
    trace = synthetic_trace(num_layers=4, num_experts=32, top_k=4, vocab_size=6144, num_requests=40)
    tables = os.path.join(out_dir, "tables")
    build_tables(trace, get_policy("semmoe").solve(trace, 4)).save(tables)
    prompts = ["The history of the city", "The game was released on", "The first season of the show"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    common = dict(model=str(tiny_moe_path()), dtype="bfloat16", max_model_len=256, seed=0,
                  gpu_memory_utilization=0.2, enable_prefix_caching=False)

    def run(**kw):
        llm = LLM(**common, **kw)
        try:
            tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
            extra = llm.collective_rpc(flush_capture) if kw.get("additional_config") else None
            timing = llm.collective_rpc(time_moe_vs_decision)[0] if kw.get("additional_config") else None
            return tokens, extra, timing
        finally:
            del llm
            gc.collect()
            torch.cuda.empty_cache()

    t = time.time()
    plain, _, _ = run()
    summary["plain_default_compile_s"] = round(time.time() - t, 1)
    capture = os.path.join(out_dir, "capture.npz")
    semmoe = {"additional_config": {"semmoe": {"tables": tables, "capture": capture}}}
    try:
        run(**semmoe)
        summary["full_cudagraphs_refused"] = False
    except SemMoEConfigError as exc:
        summary["full_cudagraphs_refused"] = "full CUDA graphs" in str(exc)
    except Exception as exc:  # wrapped by vLLM's engine start
        summary["full_cudagraphs_refused"] = "full CUDA graphs" in str(exc)
    t = time.time()
    placed, flushed, timing = run(compilation_config={"cudagraph_mode": "PIECEWISE"}, **semmoe)
    summary["semmoe_piecewise_s"] = round(time.time() - t, 1)
    summary["tokens_equal_plain"] = placed == plain
    captured = load_trace(capture)
    summary["captured_requests"] = int(captured.num_requests)
    summary["captured_decode_tokens"] = int(captured.is_decode.sum())
    summary["captured_expected_decode_tokens"] = len(prompts) * 15
    summary["steps"] = flushed[0].get("steps") if flushed else None
    summary["moe_vs_decision"] = timing
    with open(os.path.join(out_dir, "engine.json"), "w") as f:
        json.dump(summary, f, indent=2)
    ok = (summary["decision_mismatches"] == 0 and summary["tokens_equal_plain"] and summary["full_cudagraphs_refused"]
          and summary["captured_decode_tokens"] == summary["captured_expected_decode_tokens"])
    print(json.dumps(summary))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
