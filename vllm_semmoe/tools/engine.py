"""Running vLLM in-process for profiling and the demo (CPU-friendly defaults)."""

from __future__ import annotations

import os
import tempfile


def default_cache_root() -> str:
    """vLLM's cache directory when ``VLLM_CACHE_ROOT`` is unset (:func:`cpu_defaults`): kept
    across runs, so that vLLM inspects each model class once (seconds per architecture on CPU)."""
    return os.path.join(tempfile.gettempdir(), "vllm-semmoe-cache")


def cpu_defaults() -> None:
    """Environment defaults that vLLM's CPU build needs here (set only when unset)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cache = default_cache_root()
    os.environ.setdefault("VLLM_CACHE_ROOT", cache)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache, "inductor"))


def make_llm(model: str, semmoe: dict | None, *, max_model_len: int = 512, dtype: str = "bfloat16",
             in_process: bool = True, enforce_eager: bool = True, **kwargs):
    """An ``LLM`` with the plugin configured by ``semmoe`` (``None``: plugin inactive).

    ``in_process`` runs engine and worker in this process (fast start, and ``collective_rpc``
    with a local function reaches the worker); it is ignored under tensor/data/pipeline
    parallelism, which needs worker processes. Prefix caching is off so every prompt token is
    computed — and so captured. ``enforce_eager`` (default here: these are short offline jobs,
    and compiling costs about a minute on CPU) can be turned off: the plugin works compiled.
    """
    import gc

    from vllm import LLM

    cpu_defaults()
    # An engine that died in this process but is not collected yet (e.g. one whose start was
    # refused, kept in a cycle by its exception's traceback) tears down vLLM's process-wide
    # parallel groups when the collector finally reaches it: finalize it before this engine
    # sets them up, not in the middle of its first step.
    gc.collect()
    parallel = int(kwargs.get("tensor_parallel_size") or 1) * int(kwargs.get("data_parallel_size") or 1) \
        * int(kwargs.get("pipeline_parallel_size") or 1)
    settings = dict(dtype=dtype, max_model_len=max_model_len, enforce_eager=enforce_eager,
                    enable_prefix_caching=False)
    in_process = in_process and parallel == 1
    if in_process:
        settings["distributed_executor_backend"] = "uni"
    settings.update(kwargs)  # engine arguments given by the caller win (e.g. `semmoe profile --dtype`)
    # vLLM reads the switch while it builds the engine; the processes this one starts later
    # (e.g. the servers `semmoe bench-serve` starts after profiling) keep the user's setting
    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        return LLM(model=model, additional_config={"semmoe": semmoe} if semmoe else {}, **settings)
    finally:
        if saved is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved


def fit_prompts(llm, prompts: list[str], max_model_len: int, max_tokens: int) -> list[dict]:
    """Tokenise and left-truncate prompts so prompt + generation fits the context."""
    tokenizer = llm.get_tokenizer()
    budget = max_model_len - max_tokens
    return [{"prompt_token_ids": tokenizer.encode(p)[-budget:]} for p in prompts]


def generate(llm, prompts: list[dict], max_tokens: int):
    """Greedy generation; returns vLLM's outputs in prompt order."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=False)
    return llm.generate(prompts, params, use_tqdm=True)


def flush(llm) -> dict:
    """Write the capture and return the live metrics (first worker's answer)."""
    from ..vllm_adapter.recording import flush_capture

    results = llm.collective_rpc(flush_capture)
    return next((r for r in results if r), {})


def run_prompts(model: str, prompts: list[str], *, max_tokens: int, semmoe: dict | None = None,
                max_model_len: int = 512, **llm_kwargs) -> tuple[list[list[int]], dict]:
    """Generate greedily for ``prompts`` with the plugin set to ``semmoe``; return the output
    token ids per prompt and the plugin's summary (capture path, live LAR), then free the engine.
    """
    import gc

    llm = make_llm(model, semmoe, max_model_len=max_model_len, **llm_kwargs)
    try:
        fitted = fit_prompts(llm, prompts, max_model_len, max_tokens)
        outputs = generate(llm, fitted, max_tokens)
        from ..vllm_adapter.config import SemMoEConfig

        config = SemMoEConfig.from_additional_config({"semmoe": semmoe} if semmoe else None)
        summary = flush(llm) if config is not None and config.records else {}
        return [list(o.outputs[0].token_ids) for o in outputs], summary
    finally:
        del llm
        gc.collect()
