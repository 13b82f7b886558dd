"""The demo: the whole pipeline on a real vLLM engine (called by the CLI)."""

from __future__ import annotations

import os
import time

from ..evaluation.evaluate import EvalConfig, evaluate
from ..core.modes import ServingMode
from ..core.policy import get_policy
from .prompts import load_prompts
from ..core.tables import build_tables
from ..core.capture_store import load_trace
from .engine import run_prompts
from .profiling import profile, say


def demo(model: str, dataset: str, workdir: str, *, ep_size: int = 8, profile_prompts: int = 300,
         eval_prompts: int = 100, skip: int = 3000, max_tokens: int = 16, batch_tokens: int = 512,
         seed: int = 0, executed_dp: int = 2, dtype: str = "float32", enforce_eager: bool = False) -> dict:
    """Profile → solve → serve other prompts with each placement, twice:

    1. **executed EP** (the delivery): the prompts are served by DP ``executed_dp`` + EP engines
       (one process per rank, :func:`.bench_serve.run_bench_serve`): ``vanilla`` as stock vLLM
       (identity placement, vLLM's balancer, its all-gather MoE dispatch, metered), ``semmoe``
       with Sem-MoE's placement, DP routing and the sparse dispatch. Per method:
       engine-counted ``moe_bytes_per_token``, the engines' ``live_lar``, a digest of the text.
       In ``dtype`` (float32 by default: bit-identical texts; in bfloat16 vLLM's CPU fused-MoE
       kernel sums a token's experts in physical order, so a re-placed model rounds differently),
       in vLLM's default compiled mode unless ``enforce_eager``.
    2. **simulated EP** ``ep_size`` on one device (TP mode, the paper's EP 8; ``simulated_ep``):
       the placement applied by the plugin, the routing captured; ``replayed_lar`` is the
       offline evaluator counted on that capture one engine step at a time, and
       ``offline_replay_lar`` the same evaluator on the same routing in ``batch_tokens``
       batches (the engine's step budget is set to that size). Both count; nothing moves.
    """
    from .bench_serve import run_bench_serve

    os.makedirs(workdir, exist_ok=True)
    start = time.perf_counter()
    profile_path = os.path.join(workdir, "profile.npz")
    profile(model, dataset, profile_prompts, profile_path, skip=skip, max_tokens=max_tokens)
    profile_trace = load_trace(profile_path)
    prompts = load_prompts(dataset, eval_prompts, skip=skip + profile_prompts)
    methods = {}
    for method, policy in (("vanilla", "vllm"), ("semmoe", "semmoe")):
        say(f"{method}: serving {len(prompts)} other prompts on DP {executed_dp} + EP engines")
        run = run_bench_serve(model, dataset, os.path.join(workdir, "executed_ep"), dp=executed_dp, policy=policy,
                              num_prompts=eval_prompts, concurrency=16, max_tokens=max_tokens,
                              profile_trace=profile_path, profile_prompts=profile_prompts, skip=skip, dtype=dtype,
                              enforce_eager=enforce_eager)
        methods[method] = {key: run[key] for key in (
            "moe_bytes_per_token", "moe_bytes", "live_lar", "output_digest", "ok", "failed", "tokens",
            "ttft_p50_s", "throughput_tok_s", "compiled")}

        solve_start = time.perf_counter()
        solver = get_policy(method)
        placement = solver.solve(profile_trace, ep_size, mode=ServingMode.TP, seed=seed)
        tables_dir = os.path.join(workdir, f"tables_{method}")
        tables = build_tables(profile_trace, placement, mode=ServingMode.TP)
        tables.save(tables_dir)
        solve_s = time.perf_counter() - solve_start
        say(f"{method}: EP {ep_size} placement solved in {solve_s:.1f} s; generating {len(prompts)} prompts "
             "on one device")
        capture = os.path.join(workdir, f"served_{method}.npz")
        _, summary = run_prompts(model, prompts, max_tokens=max_tokens,
                                 semmoe={"tables": tables_dir, "capture": capture},
                                 max_num_batched_tokens=batch_tokens, enable_chunked_prefill=True)
        served = load_trace(capture)
        offline = evaluate(served, placement, tables if solver.schedules_data else None,
                           EvalConfig(mode=ServingMode.TP, batch_tokens=batch_tokens))
        methods[method]["simulated_ep"] = {
            "ep_size": ep_size,
            "replayed_lar": summary["replayed"]["lar"],
            "offline_replay_lar": offline["lar"],
            "engine_steps": summary["replayed"]["steps"],
            "tokens": served.num_tokens,
            "solve_s": solve_s,
        }
    return {
        "model": model,
        "executed_dp": executed_dp,
        "dtype": dtype,
        "compiled": all(m["compiled"] for m in methods.values()),
        "ep_size": ep_size,
        "profile": {"dataset": dataset, "prompts": profile_prompts, "skip": skip,
                    "tokens": profile_trace.num_tokens},
        "eval": {"prompts": eval_prompts, "skip": skip + profile_prompts, "max_tokens": max_tokens,
                 "batch_tokens": batch_tokens},
        "methods": methods,
        "outputs_identical": methods["vanilla"]["output_digest"] == methods["semmoe"]["output_digest"],
        "wall_s": time.perf_counter() - start,
    }
