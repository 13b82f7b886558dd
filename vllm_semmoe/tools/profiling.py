"""Profiling: prompts through a real vLLM engine with capture on, written as one routing trace."""

from __future__ import annotations

import os
import sys

from ..core.capture_store import compact_capture
from .prompts import load_prompts
from .engine import run_prompts


def say(message: str) -> None:
    print(f"[semmoe] {message}", file=sys.stderr, flush=True)


def profile(model: str, dataset: str, num_prompts: int, out: str, *, skip: int = 0, max_tokens: int = 16,
            max_model_len: int = 512, tables: str | None = None, **llm_kwargs) -> dict:
    """Run prompts through vLLM with capture on and write the routing trace to ``out``."""
    prompts = load_prompts(dataset, num_prompts, skip=skip)
    say(f"profiling {len(prompts)} prompts from {dataset} on {model}")
    semmoe = {"capture": os.path.abspath(out)}
    if tables:
        semmoe["tables"] = tables
    _, summary = run_prompts(model, prompts, max_tokens=max_tokens, semmoe=semmoe,
                             max_model_len=max_model_len, **llm_kwargs)
    trace = compact_capture(out)  # the engine has stopped: one .npz instead of its parts
    say(f"wrote {out}: {trace.num_requests} requests, {trace.num_tokens} tokens "
         f"({int(trace.is_decode.sum())} decode), {trace.num_layers} MoE layers x {trace.num_experts} experts")
    return summary
