"""Runs of vLLM with the plugin *not loaded*: the baseline exactness is shown against.

:func:`plugin_free_runs` starts one fresh Python process with ``VLLM_PLUGINS=""`` (when it is
set, vLLM loads only the general plugins it names, so the ``semmoe`` entry point stays out), runs one
in-process vLLM engine per requested run, one after another, and returns each run's greedy
token ids and the *logical* routing of every token it computed, as a
:class:`~vllm_semmoe.core.trace.RoutingTrace` with the prompts in order. The process imports nothing
of this package, and checks that no ``vllm_semmoe`` module was loaded in it.

The routing is read by the process's own hooks, not the plugin's: every vLLM router calls its
``capture_fn`` with the logical top-k expert ids of its tokens before any expert-map mapping
(``BaseRouter.set_capture_fn``), and a forward pre-hook on the model notes each step's requests
(the runner's input batch and query offsets), token ids and positions. vLLM's own
``enable_return_routed_experts`` needs its GPU model runner (V2) and does not run on CPU.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core.trace import RoutingTrace
from .processes import log_tail, run_logged

#: run in a fresh interpreter; imports vLLM, torch and numpy only
SCRIPT = r'''
import functools, gc, json, os, sys

STEPS = []


def install(worker):
    """Note every forward step's rows and every MoE layer's logical top-k ids."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    runner = worker.model_runner
    model = runner.get_model()
    layers = [m for m in model.modules() if isinstance(m, MoERunner)]
    if not layers:
        raise RuntimeError("the model has no MoE layer (no vLLM MoERunner)")

    def before_forward(module, args, kwargs):
        batch = runner.input_batch
        bounds = [int(b) for b in runner.query_start_loc.np[: batch.num_reqs + 1]]
        n = bounds[-1]
        STEPS.append({"req_ids": list(batch.req_ids[: batch.num_reqs]), "bounds": bounds, "n": n,
                      "tokens": kwargs["input_ids"][:n].tolist(), "positions": kwargs["positions"][:n].tolist(),
                      "experts": [None] * len(layers)})

    def on_layer(index, topk_ids):
        step = STEPS[-1]
        if step["experts"][index] is not None:
            raise RuntimeError(f"MoE layer {index} routed twice in one step")
        step["experts"][index] = topk_ids[: step["n"]].detach().to("cpu").tolist()

    model.register_forward_pre_hook(before_forward, with_kwargs=True)
    for index, layer in enumerate(layers):
        layer.router.set_capture_fn(functools.partial(on_layer, index))
    return len(layers)


def routing_of(outputs):
    """Per request (prompt order): the token ids computed and their [T][L][K] expert ids, the
    rows of the last step that computed each position."""
    rows = {}
    for step in STEPS:
        missing = [l for l, e in enumerate(step["experts"]) if e is None]
        if missing and step["n"]:
            raise RuntimeError(f"MoE layers {missing} produced no routing in a step of {step['n']} tokens")
        for r, rid in enumerate(step["req_ids"]):
            for i in range(step["bounds"][r], step["bounds"][r + 1]):
                rows[(rid, step["positions"][i])] = (step["tokens"][i], [e[i] for e in step["experts"]])
    internal = {}
    for rid, _ in rows:  # the engine's ids are the caller's with a random suffix
        internal.setdefault(rid.rsplit("-", 1)[0] if "-" in rid else rid, rid)
    requests = []
    for out in outputs:
        rid = internal.get(out.request_id)
        want = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)[:-1]
        if rid is None:
            raise RuntimeError(f"request {out.request_id}: no step computed it")
        gaps = [p for p in range(len(want)) if (rid, p) not in rows]
        if gaps:
            raise RuntimeError(f"request {out.request_id}: positions {gaps[:10]} were never computed")
        got = [rows[(rid, p)][0] for p in range(len(want))]
        if got != want:
            raise RuntimeError(f"request {out.request_id}: the steps' token ids differ from its prompt and output")
        requests.append({"prompt_len": len(out.prompt_token_ids), "tokens": got,
                         "experts": [rows[(rid, p)][1] for p in range(len(want))]})
    return requests


def set_env(values):
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def main():
    cfg = json.loads(sys.argv[1])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine and worker in this process
    import vllm.envs
    from vllm import LLM, SamplingParams

    results = {}
    for name, run in cfg["runs"].items():
        saved = {key: os.environ.get(key) for key in run.get("env", {})}
        set_env(run.get("env", {}))
        vllm.envs.disable_envs_cache()  # the previous engine cached the environment
        STEPS.clear()
        llm = LLM(model=run["model"], dtype=run["dtype"], max_model_len=run["max_model_len"], enforce_eager=True,
                  enable_prefix_caching=False, distributed_executor_backend="uni", seed=0)
        try:
            num_layers = llm.collective_rpc(install)[0]
            if "prompt_token_ids" in run:
                prompts = [{"prompt_token_ids": ids} for ids in run["prompt_token_ids"]]
            else:  # left-truncated so that prompt and generation fit the context
                tokenizer = llm.get_tokenizer()
                budget = run["max_model_len"] - run["max_tokens"]
                prompts = [{"prompt_token_ids": tokenizer.encode(p)[-budget:]} for p in run["prompts"]]
            params = SamplingParams(temperature=0.0, max_tokens=run["max_tokens"], ignore_eos=False)
            if run.get("one_at_a_time"):  # every step's batch is one request
                outputs = [o for p in prompts for o in llm.generate([p], params, use_tqdm=False)]
            else:
                outputs = llm.generate(prompts, params, use_tqdm=False)
            config = llm.llm_engine.model_config
            results[name] = {"outputs": [list(o.outputs[0].token_ids) for o in outputs],
                             "requests": routing_of(outputs), "num_layers": num_layers,
                             "num_experts": config.get_num_experts(), "vocab_size": config.get_vocab_size(),
                             "use_mla": bool(config.use_mla)}
        finally:
            del llm
            gc.collect()
            set_env(saved)
    ours = sorted(m for m in sys.modules if m.split(".")[0] == "vllm_semmoe")
    if ours:
        raise RuntimeError(f"the plugin-free process loaded {ours[:5]}: is VLLM_PLUGINS set to exclude semmoe?")
    with open(cfg["out"], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
'''


@dataclass
class PluginFreeRun:
    """One engine run without the plugin."""

    #: greedy output token ids per prompt
    outputs: list[list[int]]
    #: every computed token's logical routing, requests in prompt order (request ids 0, 1, ...)
    trace: RoutingTrace
    #: whether vLLM ran the model's attention as MLA
    use_mla: bool


def plugin_free_env(**extra: str) -> dict[str, str]:
    """The environment of a process that runs vLLM without this plugin: this one's, with the
    defaults of :func:`~vllm_semmoe.tools.engine.cpu_defaults` where unset (so it shares
    vLLM's caches with the engines this process runs), ``VLLM_PLUGINS=""`` and ``extra``."""
    from ..tools.engine import default_cache_root

    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CACHE_ROOT", default_cache_root())
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(default_cache_root(), "inductor"))
    env.update({"VLLM_PLUGINS": "", "PYTHONUNBUFFERED": "1", **extra})
    return env


def plugin_free_runs(runs: dict[str, dict], workdir: str | os.PathLike, *,
                     timeout: float = 900) -> dict[str, PluginFreeRun]:
    """Run ``runs`` in one process with the plugin not loaded; name -> :class:`PluginFreeRun`.

    Each run: ``model``, ``dtype``, ``max_model_len``, ``max_tokens``, and ``prompts`` (texts,
    tokenised and left-truncated as :func:`vllm_semmoe.tools.engine.fit_prompts` does) or
    ``prompt_token_ids``; optional ``one_at_a_time`` (one request per ``generate`` call, so every
    step's batch is that request alone) and ``env`` (variables set while that engine runs, e.g.
    ``VLLM_MLA_DISABLE``). Engines run eager, prefix caching off, greedy, as
    :func:`~vllm_semmoe.tools.engine.make_llm` runs them. Raises ``RuntimeError`` with the
    process's log tail when it fails or runs past ``timeout`` seconds.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    out, log = workdir / "plugin_free.json", workdir / "plugin_free.log"
    out.unlink(missing_ok=True)
    cfg = {"runs": {name: {**run, "model": str(run["model"])} for name, run in runs.items()}, "out": str(out)}
    with tempfile.TemporaryDirectory() as cwd:  # nothing of the checkout on the process's sys.path
        rc = run_logged([sys.executable, "-c", SCRIPT, json.dumps(cfg)], plugin_free_env(), log, timeout,
                        cwd=cwd)
    if rc != 0 or not out.exists():
        what = f"ran past {timeout:.0f} s" if rc is None else f"failed (exit {rc})"
        raise RuntimeError(f"the plugin-free vLLM run {what}; log {log}:\n{log_tail(log)}")
    return {name: _as_run(result) for name, result in json.loads(out.read_text()).items()}


def _as_run(result: dict) -> PluginFreeRun:
    requests = result["requests"]
    lengths = [len(r["tokens"]) for r in requests]
    tokens = np.concatenate([np.asarray(r["tokens"], np.int64) for r in requests])
    experts = np.sort(np.concatenate([np.asarray(r["experts"], np.int64) for r in requests]), axis=2)
    dtype = np.uint8 if result["num_experts"] <= 256 else np.int16
    is_decode = np.concatenate([np.arange(n) >= r["prompt_len"] for n, r in zip(lengths, requests)])
    trace = RoutingTrace.from_arrays(tokens, experts.astype(dtype), np.concatenate([[0], np.cumsum(lengths)]),
                                     vocab_size=result["vocab_size"], num_experts=result["num_experts"],
                                     is_decode=is_decode)
    return PluginFreeRun(outputs=result["outputs"], trace=trace, use_mla=result["use_mla"])
