"""End-to-end jobs on a real vLLM engine: profiling and the demo (called by the CLI)."""

from __future__ import annotations

import os
import sys
import time

from ..capture_store import compact_capture
from ..evaluate import EvalConfig, evaluate
from ..policy import get_policy
from ..prompts import load_prompts
from ..tables import build_tables
from ..trace import load_trace
from .engine import run_prompts


def _say(message: str) -> None:
    print(f"[semmoe] {message}", file=sys.stderr, flush=True)


def profile(model: str, dataset: str, num_prompts: int, out: str, *, skip: int = 0, max_tokens: int = 16,
            max_model_len: int = 512, tables: str | None = None, **llm_kwargs) -> dict:
    """Run prompts through vLLM with capture on and write the routing trace to ``out``."""
    prompts = load_prompts(dataset, num_prompts, skip=skip)
    _say(f"profiling {len(prompts)} prompts from {dataset} on {model}")
    semmoe = {"capture": os.path.abspath(out)}
    if tables:
        semmoe["tables"] = tables
    _, summary = run_prompts(model, prompts, max_tokens=max_tokens, semmoe=semmoe,
                             max_model_len=max_model_len, **llm_kwargs)
    trace = compact_capture(out)  # the engine has stopped: one .npz instead of its parts
    _say(f"wrote {out}: {trace.num_requests} requests, {trace.num_tokens} tokens "
         f"({int(trace.is_decode.sum())} decode), {trace.num_layers} MoE layers x {trace.num_experts} experts")
    return summary


def demo(model: str, dataset: str, workdir: str, *, ep_size: int = 8, profile_prompts: int = 300,
         eval_prompts: int = 100, skip: int = 3000, max_tokens: int = 16, batch_tokens: int = 512,
         seed: int = 0) -> dict:
    """Profile → solve → serve other prompts with the placement, live LAR vs offline prediction.

    Both placements (vanilla, semmoe) are applied to the running model (a single device holds
    all experts, so EP ``ep_size`` is simulated: each token's device and each expert's device
    come from the tables, and the captured routing is counted against them). ``live_lar`` is
    measured from the engine's own forward steps; ``predicted_lar`` is ``semmoe eval`` on the
    same prompts' routing with the offline batching. The engine's step budget
    (``max_num_batched_tokens``) is set to ``batch_tokens``, the offline batch size, so both
    schedule batches of the same size.
    """
    os.makedirs(workdir, exist_ok=True)
    start = time.perf_counter()
    profile_path = os.path.join(workdir, "profile.npz")
    profile(model, dataset, profile_prompts, profile_path, skip=skip, max_tokens=max_tokens)
    profile_trace = load_trace(profile_path)
    prompts = load_prompts(dataset, eval_prompts, skip=skip + profile_prompts)
    methods = {}
    for method in ("vanilla", "semmoe"):
        solve_start = time.perf_counter()
        placement = get_policy(method).solve(profile_trace, ep_size, mode="tp", seed=seed)
        tables_dir = os.path.join(workdir, f"tables_{method}")
        tables = build_tables(profile_trace, placement, mode="tp")
        tables.save(tables_dir)
        solve_s = time.perf_counter() - solve_start
        _say(f"{method}: placement solved in {solve_s:.1f} s; generating {len(prompts)} other prompts")
        capture = os.path.join(workdir, f"served_{method}.npz")
        _, summary = run_prompts(model, prompts, max_tokens=max_tokens,
                                 semmoe={"tables": tables_dir, "capture": capture},
                                 max_num_batched_tokens=batch_tokens, enable_chunked_prefill=True)
        served = load_trace(capture)
        predicted = evaluate(served, placement, tables if method == "semmoe" else None,
                             EvalConfig(mode="tp", batch_tokens=batch_tokens))
        methods[method] = {
            "live_lar": summary["live"]["lar"],
            "predicted_lar": predicted["lar"],
            "live_steps": summary["live"]["steps"],
            "tokens": served.num_tokens,
            "solve_s": solve_s,
        }
    return {
        "model": model,
        "ep_size": ep_size,
        "mode": "tp",
        "profile": {"dataset": dataset, "prompts": profile_prompts, "skip": skip,
                    "tokens": profile_trace.num_tokens},
        "eval": {"prompts": eval_prompts, "skip": skip + profile_prompts, "max_tokens": max_tokens,
                 "batch_tokens": batch_tokens},
        "methods": methods,
        "wall_s": time.perf_counter() - start,
    }
