"""The routing capture wired into an engine: the recorder fed by every MoE layer's router, the
step it records, where its files go, and writing them out.

The recorder itself (:class:`~.capture.RoutingRecorder`) and the live counters are in
:mod:`.capture`; the on-disk layout in :mod:`vllm_semmoe.core.capture_store`; the summary's
``replayed`` figures are the offline evaluator's on the written capture
(:func:`vllm_semmoe.evaluation.evaluate.replay_capture`), computed when the summary is written.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import weakref
from typing import TYPE_CHECKING

from . import compat
from .state import EngineState, runner_state

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from .capture import RoutingRecorder

logger = logging.getLogger("vllm.semmoe")


def make_recorder(runners: list, vllm_config: VllmConfig, state: EngineState) -> RoutingRecorder:
    """A :class:`RoutingRecorder` fed by every MoE layer's capture hook."""
    from .capture import RoutingRecorder

    config = state.config
    model_config = vllm_config.model_config
    hf = model_config.hf_text_config
    tables = state.tables
    recorder = RoutingRecorder(
        num_layers=len(runners),
        num_experts=int(runners[0].routed_experts.moe_config.num_logical_experts),
        top_k=int(hf.num_experts_per_tok),
        placement=tables.placement if tables is not None else None,
        token_device=state.token_device,
        vocab=_vocab(model_config),
        vocab_size=int(model_config.get_vocab_size()),
    )
    dp_rank = state.dp_rank
    recorder.on_failure = functools.partial(report_engine_failure, state, dp_rank)
    for index, runner in enumerate(runners):
        runner.router.set_capture_fn(functools.partial(_capture_hook, recorder, dp_rank, index))
        # the router (and its hook) must run on every step, also in a compiled model
        compat.use_opaque_moe_op(runner)
    parallel = vllm_config.parallel_config
    if config.capture is not None and tables is not None and (
            parallel.data_parallel_size > 1 or parallel.tensor_parallel_size > 1):
        from .capture import LiveCounters

        recorder.live_counters = LiveCounters(
            live_counters_path(config.capture, parallel, compat.tp_rank()), parallel.data_parallel_rank,
            parallel.data_parallel_size, tables.placement.num_physical_experts, tables.ep_size, traffic=state.counters,
            tp_rank=compat.tp_rank(), failures=state.failures)
    if config.capture is not None and compat.tp_rank() == 0:  # TP ranks see the same tokens: one writes
        recorder.open_store(config.capture, dp_rank=parallel.data_parallel_rank,
                            dp_size=parallel.data_parallel_size)
    return recorder


def report_engine_failure(state: EngineState, dp_rank: int, kind: str, reason: str) -> None:
    """Report a failure of the engine's capture machinery (:func:`.metrics.report_failure`), kept in
    ``state.failures``."""
    from .metrics import report_failure

    report_failure(kind, dp_rank, reason, state.failures)


def _capture_hook(recorder, dp_rank: int, layer: int, topk_ids) -> None:
    """Feed ``recorder`` this engine's rows of a MoE layer's expert ids (under data
    parallelism the layer sees the tokens of every DP rank, rank-major)."""
    offset = compat.dp_rows_offset(dp_rank, int(topk_ids.shape[0]))
    recorder.on_layer(layer, topk_ids[offset:] if offset else topk_ids)


def _vocab(model_config) -> list[str]:
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer,
                                                  trust_remote_code=model_config.trust_remote_code)
        return tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    except Exception as exc:  # the trace is still valid without token strings
        logger.warning("semmoe: no vocabulary for the capture (%s)", exc)
        return []


def begin_step(runner, state: EngineState, input_ids, positions) -> None:
    """Open the step: the recorder's rows (requests, tokens, positions, and the positions the step
    skips, for the capture's coverage) and the TP-shuffle step context."""
    import torch

    req_ids, num_prompt, bounds = compat.step_batch(runner)
    n = int(bounds[-1])
    live = compat.live_request_ids(runner)
    if input_ids is None or n == 0:
        state.recorder.begin_forward(req_ids, num_prompt, bounds, None, None, live=live)
        state.begin_step(None)
        return
    tokens = input_ids[:n].detach().to("cpu", torch.int64).numpy().copy()
    pos = positions[:n].detach().to("cpu", torch.int64).numpy().copy()
    state.recorder.begin_forward(req_ids, num_prompt, bounds, tokens, pos,
                                 token_ids=functools.partial(compat.request_token_ids, runner), live=live)
    state.begin_step(tokens)


def dp_capture_path(path: str, parallel_config) -> str:
    """The capture path of this engine: ``X.npz``, or ``X.dp<rank>.npz`` under data parallelism."""
    if parallel_config.data_parallel_size <= 1:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.dp{parallel_config.data_parallel_rank}{ext}"


def live_counters_path(path: str, parallel_config, tp_rank: int) -> str:
    """The live counters file of this engine rank: ``X[.dp<r>].npz.live.json``, with ``.tp<t>``
    before ``.live.json`` when TP > 1 (:class:`.capture.LiveCounters`)."""
    base = dp_capture_path(path, parallel_config)
    if parallel_config.tensor_parallel_size > 1:
        base += f".tp{tp_rank}"
    return base + ".live.json"


def flush_capture(runner_or_worker) -> dict:
    """Return the engine's summary (steps, TP-shuffle and MoE counters, the capture's replay) and
    write it beside the capture (``X.npz.json``, rank 0 of its TP group). The capture itself needs no flush: engines
    append every step to it as the step ends.

    Accepts a model runner or a vLLM worker, so ``LLM.collective_rpc(flush_capture)`` works.
    """
    runner = getattr(runner_or_worker, "model_runner", runner_or_worker)
    state = runner_state(runner)
    return flush_state(state) if state is not None else {}


def flush_state(state: EngineState) -> dict:
    """Write ``state``'s capture summary and return it: steps, coverage (tokens of the engine's
    requests with and without routing), TP-shuffle and MoE exchange counters, the offline
    evaluator's figures on the steps captured so far (``replayed``, :func:`replay_summary`), and
    the plugin's failures in this engine (``failures``, when any)."""
    recorder, config = state.recorder, state.config
    if recorder is None or recorder.num_steps == 0:
        return {}
    dp_size, dp_rank = state.layout.dp, state.dp_rank
    summary = {"steps": recorder.num_steps, "dp_rank": dp_rank, "coverage": recorder.coverage()}
    if state.failures:
        summary["failures"] = dict(state.failures)
    if state.counters["layers_run"] and state.shuffles:
        summary["tp_shuffle"] = dict(state.counters)
    if state.dispatch is not None or state.tp_meter is not None:
        summary["moe_traffic"] = {"dispatch": state.dispatch, **state.counters}
    path = None
    if recorder.writes_capture:
        from types import SimpleNamespace

        path = dp_capture_path(config.capture, SimpleNamespace(data_parallel_size=dp_size,
                                                               data_parallel_rank=dp_rank)) + ".json"
        written = _write_summary(path, summary)  # first without the replay: an engine stopped during it keeps these
    replayed = replay_summary(state)
    if replayed:
        summary["replayed"] = replayed
        if path is not None:
            written = _write_summary(path, summary)
    if path is not None and written:
        summary["path"] = config.capture
    state.flushed_steps, state.flushed_summary = recorder.num_steps, summary
    return summary


def _write_summary(path: str, summary: dict) -> bool:
    """Write ``summary`` to ``path`` atomically; ``False`` (logged) when it cannot be written."""
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(summary, f, indent=2)
        os.replace(path + ".tmp", path)
        return True
    except OSError as exc:  # after a capture error, often the same cause
        logger.error("semmoe: could not write the capture summary %s (%s)", path, exc)
        return False


def replay_summary(state: EngineState) -> dict:
    """The capture summary's ``replayed`` figures: the offline evaluator replayed on the steps this
    engine wrote to its capture (:func:`vllm_semmoe.evaluation.evaluate.replay_capture`), against
    the engine's tables; kept from the last flush when no step came since. ``{}`` without tables
    or a capture written here (one TP rank writes it), or when the capture cannot be read (logged)."""
    recorder = state.recorder
    if state.tables is None or not recorder.writes_capture:
        return {}
    if state.flushed_steps == recorder.num_steps and "replayed" in state.flushed_summary:
        return state.flushed_summary["replayed"]
    from ..core.trace import TraceError
    from ..evaluation.evaluate import replay_capture

    try:
        return replay_capture(state.config.capture, state.tables, dp_rank=state.dp_rank, dp_size=state.layout.dp)
    except (OSError, TraceError) as exc:
        logger.error("semmoe: could not replay the routing capture for its summary (%s)", exc)
        return {}


def flush_at_exit(state: EngineState) -> None:
    """Write ``state``'s capture at interpreter exit too (the state is held weakly)."""
    atexit.register(_flush_at_exit, weakref.ref(state))


def _flush_at_exit(state_ref) -> None:
    state = state_ref()
    if state is not None:
        try:
            flush_state(state)
        except Exception:
            logger.exception("semmoe: could not write the routing capture at exit")
