"""vLLM's model runner and worker (model runner v1): the step context of real forward steps, the
dummy batches of an idle DP rank, and the capture written at shutdown.

Installed only on versions whose runner gives the plugin a per-step source
(:func:`.compat.has_step_source`); elsewhere the features that need one are refused at start.
"""

from __future__ import annotations

import functools
import logging

from ..recording import begin_step, flush_state
from ..state import EngineState, runner_state
from .base import Patch

logger = logging.getLogger("vllm.semmoe")

def publish_counters(state: EngineState, write_live: bool = False) -> None:
    """After a step: the MoE counters to ``/metrics``, and (``write_live``: after a dummy batch;
    the recorder writes it after real steps) to the live counters file."""
    if state.metrics is not None:
        state.metrics.update(state.counters)
    if write_live and state.dispatch is not None and state.recorder is not None \
            and state.recorder.live_counters is not None:
        state.recorder.live_counters.write()


def _model_forward(model_forward):
    @functools.wraps(model_forward)
    def patched_model_forward(self, input_ids=None, positions=None, *args, **kwargs):
        # Only real engine steps come through here (warm-up and profiling runs call the model
        # directly), so the recorder and the TP shuffle see nothing else.
        state = runner_state(self)
        if state is None:
            return model_forward(self, input_ids, positions, *args, **kwargs)
        state.in_step = True  # the MoE counters count real steps only
        try:
            if state.recorder is None:
                output = model_forward(self, input_ids, positions, *args, **kwargs)
            else:
                begin_step(self, state, input_ids, positions)
                if state.tp_meter is not None:
                    state.tp_meter.mark()
                try:
                    output = model_forward(self, input_ids, positions, *args, **kwargs)
                except BaseException:
                    state.recorder.abort_forward()
                    raise
                finally:
                    state.end_step()
                if state.tp_meter is not None:  # what the compiled graph's collectives counted
                    state.tp_meter.settle(state.counters)
                state.recorder.end_forward()
        finally:
            state.in_step = False
        publish_counters(state)
        return output

    return patched_model_forward


def _execute_dummy_batch(execute_dummy_batch):
    @functools.wraps(execute_dummy_batch)
    def patched_execute_dummy_batch(self, *args, **kwargs):
        # An idle DP rank runs a dummy batch in lock-step with the ranks that serve; its MoE
        # layers take part in their dispatch and combine, so the counters count it too.
        state = runner_state(getattr(self, "model_runner", None))
        if state is None or state.dispatch is None:
            return execute_dummy_batch(self, *args, **kwargs)
        state.in_step = True
        if state.tp_meter is not None:
            state.tp_meter.mark()
        try:
            return execute_dummy_batch(self, *args, **kwargs)
        finally:
            if state.tp_meter is not None:  # its TP collectives, as in a real step
                state.tp_meter.settle(state.counters)
            state.in_step = False
            publish_counters(state, write_live=True)

    return patched_execute_dummy_batch


def _shutdown(shutdown):
    @functools.wraps(shutdown)
    def patched_shutdown(self, *args, **kwargs):
        # Engines in worker processes end here on SIGTERM (atexit does not run there).
        state = runner_state(self)
        if state is not None and state.recorder is not None:
            try:
                flush_state(state)
            except Exception:  # never block vLLM's shutdown
                logger.exception("semmoe: could not write the routing capture")
        return shutdown(self, *args, **kwargs)

    return patched_shutdown


MODEL_FORWARD = Patch(
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._model_forward",
    "open the step context around real forward steps only (warm-up and profiling runs bypass this call) and "
    "publish the MoE counters after each", _model_forward)
EXECUTE_DUMMY_BATCH = Patch(
    "vllm.v1.worker.gpu_worker.Worker.execute_dummy_batch",
    "under DP + EP, count the MoE traffic of the dummy batches an idle rank runs in lock-step with the "
    "serving ones", _execute_dummy_batch)
SHUTDOWN = Patch(
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.shutdown",
    "write the routing capture when the engine stops (worker processes end here on SIGTERM; vLLM has no "
    "plugin shutdown callback)", _shutdown)

PATCHES = (MODEL_FORWARD, EXECUTE_DUMMY_BATCH, SHUTDOWN)
