"""The ``semmoe`` entry point of the ``vllm.general_plugins`` group.

vLLM calls :func:`register` in every process it starts (API server, engine core, workers), so
it is idempotent and changes no model unless ``additional_config={"semmoe": {...}}`` is set.
It first checks that this vLLM has every internal the plugin uses on its version
(:mod:`.compat`); on a mismatch it fails loudly, naming what is missing (exclude the plugin with
``VLLM_PLUGINS`` to run without it; ``semmoe doctor`` prints the full check). A feature a vLLM
version cannot serve (:data:`.compat.REFUSED_FEATURES`) is refused at engine start, named with
the reason; its hooks are not installed there.

Hooks (all pass through untouched when ``semmoe`` is not configured):

- ``EngineArgs.create_engine_config``: validate the settings, tables, parallel layout and
  compilation settings at engine start (:mod:`.checks`);
- ``BaseModelLoader.create_model``: build the MoE layers with the tables' replica slots, install
  the placement before weights load and create the engine's :class:`~.state.EngineState`
  (recorder, TP-shuffle layers, dispatch) (:mod:`.install`);
- ``GPUModelRunner._model_forward`` (model runner v1: vLLM 0.32-0.33; the CPU runner inherits
  it): open the step context of real forward steps (warm-up and profiling runs do not come
  through here); publish the MoE exchange counters after each;
- ``Worker.execute_dummy_batch``: under DP + EP, count the MoE traffic of the dummy batches an
  idle rank runs in lock-step with the serving ones;
- ``GPUModelRunner.shutdown``: write the capture (:mod:`.recording`);
- ``DPLBAsyncMPClient.get_core_engine_for_request``: in ``dp`` mode, pick each request's DP
  rank by Sem-MoE (an explicit ``data_parallel_rank`` / ``X-data-parallel-rank`` still wins),
  with the API server's :class:`~.state.ApiServerState` (tables and router) made at the first request;
  ``DPLBAsyncMPClient.process_engine_outputs``: tell the router each request's generated tokens
  and finish (its in-flight work).

What runs inside the compiled model does so through the custom ops of :mod:`.ops`; the DP + EP
dispatch is vLLM's own prepare/finalize interface (:mod:`.ep_dispatch`). This module holds the
hooks only; ``flush_capture`` (for ``LLM.collective_rpc``) is importable from here too.
"""

from __future__ import annotations

import functools
import logging
import warnings

from ..core.modes import ServingMode
from . import compat
from .checks import check_engine_config
from .install import build_state, replica_slots
from .recording import begin_step, flush_capture, flush_state
from .state import ApiServerState, EngineState, api_server_state, runner_state

# a child of vLLM's logger, so messages show with vLLM's format and level
logger = logging.getLogger("vllm.semmoe")

#: every vLLM internal the plugin touches (see :mod:`.compat`)
REQUIRED_INTERNALS = compat.INTERNALS
check_vllm = compat.check_vllm

__all__ = ["register", "check_vllm", "flush_capture", "REQUIRED_INTERNALS"]

_REGISTERED = False


def register() -> None:
    """Install the plugin's hooks once per process."""
    global _REGISTERED
    if _REGISTERED:
        return
    compat.check_vllm()
    from . import cpu_fixes, ops

    cpu_fixes.apply_cpu_fixes()
    _fix_triton_rebind_scan()
    ops.register_ops()
    _patch_engine_args()
    _patch_model_loader()
    version = compat.vllm_version()
    if compat.has_step_source(version):  # else the features that need it are refused at start
        _patch_model_runner()
    if "dp" not in compat.refused_features(version):
        _patch_dp_router()
    _REGISTERED = True


def _fix_triton_rebind_scan() -> None:
    """vLLM's Triton kernel re-binding scans every loaded module and calls ``vars(value)`` on
    its attributes; llvmlite's ctypes wrappers (loaded with Numba, which this plugin uses)
    answer ``__dict__`` with a non-dict and crash worker start-up. Give that scan a ``vars``
    that treats such objects as having no attributes.
    """

    def safe_vars(obj):
        with warnings.catch_warnings():  # deprecated module attributes warn when touched
            warnings.simplefilter("ignore")
            namespace = getattr(obj, "__dict__", None)
        return namespace if isinstance(namespace, dict) else {}

    compat.tolerate_foreign_vars(safe_vars)


def _semmoe_config(vllm_config):
    from .config import SemMoEConfig

    return SemMoEConfig.from_additional_config(getattr(vllm_config, "additional_config", None))


# ---- engine start: validate -------------------------------------------------------------------
def _patch_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        vllm_config = original(self, *args, **kwargs)
        config = _semmoe_config(vllm_config)
        if config is not None:
            compat.check_features(config, vllm_config.parallel_config)
            check_engine_config(config, vllm_config)
        return vllm_config

    EngineArgs.create_engine_config = create_engine_config


# ---- model build: placement, engine state -----------------------------------------------------
def _patch_model_loader() -> None:
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    original = BaseModelLoader.create_model

    @functools.wraps(original)
    def create_model(self, vllm_config, model_config, prefix: str = ""):
        config = _semmoe_config(vllm_config)
        if config is not None:  # engines built without EngineArgs are refused here
            compat.check_features(config, vllm_config.parallel_config)
        tables = config.read_tables() if config is not None else None  # read once, before the build
        with compat.redundant_expert_slots(vllm_config, replica_slots(tables)):
            model = original(self, vllm_config=vllm_config, model_config=model_config, prefix=prefix)
        if config is not None:
            build_state(model, config, vllm_config, tables)
        return model

    BaseModelLoader.create_model = create_model


# ---- model runner: real steps, capture --------------------------------------------------------
def _patch_model_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    model_forward = GPUModelRunner._model_forward

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

    GPUModelRunner._model_forward = patched_model_forward

    worker_class = compat.worker_class()
    execute_dummy_batch = worker_class.execute_dummy_batch

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

    worker_class.execute_dummy_batch = patched_execute_dummy_batch

    shutdown = GPUModelRunner.shutdown

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

    GPUModelRunner.shutdown = patched_shutdown


def publish_counters(state: EngineState, write_live: bool = False) -> None:
    """After a step: the MoE counters to ``/metrics``, and (``write_live``: after a dummy batch;
    the recorder writes it after real steps) to the live counters file."""
    if state.metrics is not None:
        state.metrics.update(state.counters)
    if write_live and state.dispatch is not None and state.recorder is not None \
            and state.recorder.live_counters is not None:
        state.recorder.live_counters.write()


# ---- API server: DP rank choice -----------------------------------------------------------------
def _patch_dp_router() -> None:
    client_class = compat.dp_client_class()
    original = client_class.get_core_engine_for_request

    @functools.wraps(original)
    def get_core_engine_for_request(self, request):
        state = api_server_state(self, lambda: make_api_server_state(self.vllm_config, compat.dp_num_ranks(self)))
        if (state is not None and request.data_parallel_rank is None and request.prompt_token_ids
                and not compat.dp_request_placed(self, request)):
            request.data_parallel_rank = state.dp_router.choose(request.prompt_token_ids, compat.dp_queue_scores(self),
                                                                request.request_id)
        return original(self, request)

    client_class.get_core_engine_for_request = get_core_engine_for_request
    original_outputs = client_class.process_engine_outputs  # a staticmethod: (self, outputs)

    @functools.wraps(original_outputs)
    async def process_engine_outputs(self, outputs):
        await original_outputs(self, outputs)
        state = api_server_state(self)
        if state is not None:
            state.dp_router.observe(outputs.outputs, outputs.finished_requests)

    client_class.process_engine_outputs = staticmethod(process_engine_outputs)


def make_api_server_state(vllm_config, num_ranks: int) -> ApiServerState | None:
    """The API server's state (its tables and :class:`~.dp_routing.DpRouter` over ``num_ranks``
    DP ranks) when ``semmoe`` is configured in ``dp`` mode, else ``None``."""
    config = _semmoe_config(vllm_config)
    if config is None or config.mode != ServingMode.DP:
        return None
    from .dp_routing import DpRouter

    tables = config.read_tables()
    router = DpRouter(tables, num_ranks, balance=config.dp_balance, slack=config.dp_slack,
                      decode_weight=config.dp_decode_weight, price_step=config.dp_price_step)
    logger.info("semmoe: Sem-MoE DP routing over %d ranks (balance %.3g, price step %.3g, decode weight %.0f, "
                "guard slack %.1f)", num_ranks, config.dp_balance, config.dp_price_step, config.dp_decode_weight,
                config.dp_slack)
    return ApiServerState(config=config, tables=tables, dp_router=router)
