"""The ``semmoe`` entry point of the ``vllm.general_plugins`` group.

vLLM calls :func:`register` in every process it starts (API server, engine core, workers), so
it is idempotent and changes no model unless ``additional_config={"semmoe": {...}}`` is set.
It first checks that this vLLM has every internal the plugin uses (:mod:`.compat`); on a
mismatch it fails loudly, naming what is missing (exclude the plugin with ``VLLM_PLUGINS`` to
run without it; ``semmoe doctor`` prints the full check).

Hooks (all pass through untouched when ``semmoe`` is not configured):

- ``EngineArgs.create_engine_config``: validate the settings, tables, parallel layout and
  compilation settings at engine start (:func:`check_engine_config`);
- ``BaseModelLoader.create_model``: install the placement before weights load and create the
  engine's :class:`~.state.SemMoEState` (recorder, TP-shuffle layers) (:func:`build_state`);
- ``GPUModelRunner._model_forward`` (the CPU runner inherits it): open the step context of
  real forward steps (warm-up and profiling runs do not come through here); publish the MoE
  exchange counters after each;
- ``Worker.execute_dummy_batch``: under DP + EP, count the MoE traffic of the dummy batches an
  idle rank runs in lock-step with the serving ones;
- ``GPUModelRunner.shutdown``: write the capture;
- ``DPLBAsyncMPClient.get_core_engine_for_request``: in ``dp`` mode, pick each request's DP
  rank by Sem-MoE (an explicit ``data_parallel_rank`` / ``X-data-parallel-rank`` still wins).

What runs inside the compiled model does so through the custom ops of :mod:`.ops`; the DP + EP
dispatch is vLLM's own prepare/finalize interface (:mod:`.ep_dispatch`).
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import warnings
import weakref

from . import compat
from .state import SemMoEState, register_state, state_of

# a child of vLLM's logger, so messages show with vLLM's format and level
logger = logging.getLogger("vllm.semmoe")

#: every vLLM internal the plugin touches (see :mod:`.compat`)
REQUIRED_INTERNALS = compat.INTERNALS
check_vllm = compat.check_vllm

_REGISTERED = False


def register() -> None:
    """Install the plugin's hooks once per process."""
    global _REGISTERED
    if _REGISTERED:
        return
    compat.check_vllm()
    from . import cpu_fixes, ops
    from .config import install_one_line_refusals

    install_one_line_refusals()

    cpu_fixes.apply_cpu_fixes()
    _fix_triton_rebind_scan()
    ops.register_ops()
    _patch_engine_args()
    _patch_model_loader()
    _patch_model_runner()
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
            check_engine_config(config, vllm_config)
        return vllm_config

    EngineArgs.create_engine_config = create_engine_config


def check_engine_config(config, vllm_config) -> None:
    """Refuse, before any worker starts, what the plugin cannot serve; keep its ops outside
    piecewise CUDA graphs."""
    check_layout(config, vllm_config)
    check_compilation(config, vllm_config)
    if config.tables is not None:
        validate_against_model(config, vllm_config)


def check_layout(config, vllm_config) -> None:
    """Raise :class:`SemMoEConfigError` for a parallel layout ``config.mode`` does not support.

    Supported: any TP/DP/EP combination for ``placement-only`` and ``dp``; ``tp`` with DP 1
    (the shuffle exchanges rows within the TP group, which is the EP group only when DP is 1).
    Pipeline and context parallelism are not supported in any mode (each pipeline stage holds
    only some MoE layers: placement tables, capture and shuffle are per whole model).
    """
    from .config import SemMoEConfigError

    layout = compat.parallel_layout(vllm_config)
    if layout["pp"] > 1:
        raise SemMoEConfigError(
            f"semmoe: pipeline parallelism (pipeline_parallel_size={layout['pp']}) is not supported: "
            "tables, capture and the TP shuffle cover all MoE layers of one model replica. "
            "Serve with tensor/data/expert parallelism only, or remove the semmoe settings.")
    for key, flag in (("pcp", "prefill_context_parallel_size"), ("dcp", "decode_context_parallel_size")):
        if layout[key] > 1:
            raise SemMoEConfigError(f"semmoe: context parallelism ({flag}={layout[key]}) is not supported; "
                                    "remove it or the semmoe settings.")
    if config.mode == "tp" and layout["tp"] > 1 and layout["ep"] and layout["dp"] > 1:
        raise SemMoEConfigError(
            f"semmoe: mode 'tp' with data parallelism (TP {layout['tp']} x DP {layout['dp']} + EP) is not "
            "supported: the token shuffle exchanges rows within a TP group, but the EP group spans "
            "DP x TP. Use --data-parallel-size 1 with mode 'tp', or mode 'dp' for data-parallel serving.")
    config.check_parallel(vllm_config.parallel_config)
    if config.mode == "dp" and config.resolved_dispatch(vllm_config.parallel_config) == "vllm":
        logger.warning(
            "semmoe: mode 'dp' with vLLM's own MoE dispatch: on a backend that all-gathers tokens "
            "(allgather_reducescatter, the CPU build's) a higher local activation rate moves no fewer "
            "bytes; serve with TP 1 and the sparse dispatch (the default in mode dp), or an all-to-all "
            "backend (--all2all-backend deepep_low_latency, pplx, flashinfer_all2allv, ...)")


def check_compilation(config, vllm_config) -> None:
    """Compiled models run the plugin's per-step work inside opaque ops (:mod:`.ops`); piecewise
    CUDA graphs must split at them, full CUDA graphs cannot run them: refused."""
    from .config import SemMoEConfigError
    from .ops import CAPTURE_SPLITTING_OPS, SPLITTING_OPS

    if not (config.records or config.mode == "tp"
            or config.resolved_dispatch(vllm_config.parallel_config) == "sparse"):
        return  # placement only: nothing runs per step
    settings = compat.compilation(vllm_config)
    graphs = settings["cudagraphs"]
    if settings["enforce_eager"] or graphs in ("NONE", "None"):
        return
    if "FULL" in graphs:
        raise SemMoEConfigError(
            f"semmoe: routing capture, mode {config.mode!r} and the sparse dispatch run Python on every step, which full CUDA "
            f"graphs (cudagraph_mode={graphs}) cannot replay. Serve with "
            "--compilation-config '{\"cudagraph_mode\": \"PIECEWISE\"}' (the plugin's ops then run "
            "between graph pieces, like attention) or --enforce-eager.")
    compat.keep_ops_outside_graphs(vllm_config, list(SPLITTING_OPS + CAPTURE_SPLITTING_OPS))
    logger.info("semmoe: %s kept outside the piecewise CUDA graphs", ", ".join(SPLITTING_OPS + CAPTURE_SPLITTING_OPS))


def validate_against_model(config, vllm_config) -> None:
    """Check tables against what the HF config tells before any worker starts.

    The expert count, EP size and mode are checked here, and the MoE layer count when the
    model family's layout is known (:func:`~.config.moe_layer_count`); it is checked again once
    the model is built.
    """
    from .config import SemMoEConfigError, expert_parallel_size, moe_layer_count

    hf = vllm_config.model_config.hf_text_config
    num_experts = next((getattr(hf, k) for k in ("num_experts", "n_routed_experts", "num_local_experts")
                        if getattr(hf, k, None)), None)
    if num_experts is None:
        raise SemMoEConfigError(f"semmoe: {vllm_config.model_config.model} is not a MoE model")
    config.load_tables(num_layers=moe_layer_count(hf), num_experts=int(num_experts),
                       ep_size=expert_parallel_size(vllm_config.parallel_config))


# ---- model build: placement, engine state -----------------------------------------------------
def _patch_model_loader() -> None:
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    original = BaseModelLoader.create_model

    @functools.wraps(original)
    def create_model(self, vllm_config, model_config, prefix: str = ""):
        model = original(self, vllm_config=vllm_config, model_config=model_config, prefix=prefix)
        config = _semmoe_config(vllm_config)
        if config is not None:
            build_state(model, config, vllm_config)
        return model

    BaseModelLoader.create_model = create_model


def build_state(model, config, vllm_config) -> SemMoEState:
    """Create the engine's state for a freshly built ``model`` (weights not loaded yet): install
    the placement, the routing recorder and the TP shuffle, and register the state under the
    model and its MoE layers."""
    from .config import expert_parallel_size
    from .replacement import install_placement, install_self_check, moe_runners

    runners = moe_runners(model)
    layout = compat.parallel_layout(vllm_config)
    ep_size = expert_parallel_size(vllm_config.parallel_config)
    state = SemMoEState(config=config, parallel=(layout["tp"], layout["dp"], layout["dp_rank"], ep_size))
    register_state(model, state)
    for runner in runners:
        register_state(runner, state)
    if config.tables is not None:
        state.tables = config.load_tables(
            num_layers=len(runners),
            num_experts=int(runners[0].routed_experts.global_num_experts) if runners else -1,
            ep_size=ep_size)
        installed = install_placement(model, runners, state.tables.placement)
        install_self_check(model, runners, installed)
        logger.info("semmoe: %s placement (EP %d) installed on %d MoE layers",
                    state.tables.placement.method, state.tables.ep_size, len(runners))
    if config.records:
        state.recorder = make_recorder(runners, vllm_config, config, state)
    if config.mode == "tp" and layout["tp"] > 1 and layout["ep"]:
        from . import ops
        from .tp_shuffle import TpShuffleLayer

        for index, runner in enumerate(runners):
            state.tp_layers[runner.layer_name] = TpShuffleLayer(index, state.tables)
        fuse_decoder_layers(model, state)
        for runner in runners:
            if runner.layer_name not in state.fused:
                ops.install_moe_op(runner, runner.layer_name)
        warm_up_scheduler(state.tables, ep_size)
    install_dispatch(runners, state, config.resolved_dispatch(vllm_config.parallel_config))
    if layout["tp"] > 1 and state.recorder is not None:  # count the TP group's collectives too
        from .ep_dispatch import meter_collectives

        tp = compat.tp_group()
        meter_collectives(tp.device_communicator, tp.rank_in_group, tp.world_size, _weak_counters(state))
        state.tp_metered = True
    if config.records:  # flush at interpreter exit too (holds the state weakly)
        atexit.register(_flush_at_exit, weakref.ref(state))
    return state


def install_dispatch(runners: list, state: SemMoEState, dispatch: str | None) -> None:
    """DP + EP: give the MoE layers the sparse dispatch, or meter vLLM's own (when recording)."""
    from .ep_dispatch import install_dispatch_meter, install_sparse_dispatch

    if dispatch is None or (dispatch == "vllm" and state.recorder is None):
        return
    install = install_sparse_dispatch if dispatch == "sparse" else install_dispatch_meter
    for runner in runners:
        install(runner, state.moe_counters)
    state.dispatch = dispatch
    from .metrics import EngineMetrics

    if EngineMetrics.available():
        state.metrics = EngineMetrics(state.parallel[2])
    logger.info("semmoe: %s MoE dispatch on %d MoE layers", "sparse EP" if dispatch == "sparse" else
                "vLLM's all-gather (metered)", len(runners))


def _weak_counters(state: SemMoEState):
    """``state.moe_counters`` without keeping ``state`` alive (the communicator outlives engines)."""
    from .state import new_moe_counters

    ref = weakref.ref(state)

    def counters_of() -> dict:
        alive = ref()
        return alive.moe_counters() if alive is not None else new_moe_counters()

    return counters_of


def warm_up_scheduler(tables, ep_size: int) -> None:
    """Compile the Numba TP scheduler now (types of the real calls), not in the first step."""
    import numpy as np

    from .. import scheduling
    from .state import StepContext, new_moe_counters
    from .tp_shuffle import TpShuffleLayer

    layer = TpShuffleLayer(0, tables)
    step = StepContext(np.array([-1, 0], np.int64), tables, None, new_moe_counters())
    step.experts[0] = np.zeros((2, tables.top_k), np.int64)
    step.major[0] = np.zeros(2, np.int64)
    if layer.shuffle:
        for index in range(min(2, tables.num_layers)):  # without and with history
            TpShuffleLayer(index, tables).schedule(step, 2, ep_size)
    scheduling.shuffle_permutation(scheduling.contiguous_slices(2, ep_size), ep_size, 1)


def fuse_decoder_layers(model, state: SemMoEState) -> int:
    """Give decoder layers whose structure :func:`.tp_shuffle.fusable_runner` recognises (e.g.
    Qwen3-MoE's) the fused SRS/SAG forward; returns how many. Other MoE layers keep the
    MoE-boundary shuffle, which runs vLLM's whole MoE layer."""
    from . import ops
    from .tp_shuffle import fusable_runner

    fused = 0
    for module in model.modules():
        runner = fusable_runner(module, state.tp_layers)
        if runner is None:
            continue
        state.fused[runner.layer_name] = weakref.ref(module)
        ops.install_decoder_op(module, runner.layer_name)
        fused += 1
    logger.info("semmoe: shuffled reduce-scatter/all-gather fused into %d decoder layers", fused)
    return fused


def make_recorder(runners: list, vllm_config, config, state: SemMoEState):
    """A :class:`RoutingRecorder` fed by every MoE layer's capture hook."""
    from .capture import RoutingRecorder

    model_config = vllm_config.model_config
    hf = model_config.hf_text_config
    tables = state.tables
    recorder = RoutingRecorder(
        num_layers=len(runners),
        num_experts=int(runners[0].routed_experts.global_num_experts),
        top_k=int(getattr(hf, "num_experts_per_tok")),
        placement=tables.placement if tables is not None else None,
        vocab=_vocab(model_config),
        vocab_size=int(model_config.get_vocab_size()),
    )
    dp_rank = state.parallel[2]
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
            parallel.data_parallel_size, recorder.num_experts, tables.ep_size, traffic=state.counters,
            tp_rank=compat.tp_rank())
    if tables is not None:
        from .capture import ReplayMeter

        recorder.meter = ReplayMeter(tables, vocab_size=recorder.vocab_size, dp_rank=parallel.data_parallel_rank,
                                   dp_size=parallel.data_parallel_size)
    if config.capture is not None and compat.tp_rank() == 0:  # TP ranks see the same tokens: one writes
        recorder.open_store(config.capture, dp_rank=parallel.data_parallel_rank,
                            dp_size=parallel.data_parallel_size)
    return recorder


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


# ---- model runner: real steps, capture --------------------------------------------------------
def _patch_model_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    model_forward = GPUModelRunner._model_forward

    @functools.wraps(model_forward)
    def patched_model_forward(self, input_ids=None, positions=None, *args, **kwargs):
        # Only real engine steps come through here (warm-up and profiling runs call the model
        # directly), so the recorder and the TP shuffle see nothing else.
        state = _runner_state(self)
        if state is None:
            return model_forward(self, input_ids, positions, *args, **kwargs)
        state.in_step = True  # the MoE counters count real steps only
        try:
            if state.recorder is None:
                output = model_forward(self, input_ids, positions, *args, **kwargs)
            else:
                begin_step(self, state, input_ids, positions)
                try:
                    output = model_forward(self, input_ids, positions, *args, **kwargs)
                except BaseException:
                    state.recorder.abort_forward()
                    raise
                finally:
                    state.end_step()
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
        state = _runner_state(getattr(self, "model_runner", None))
        if state is None or state.dispatch is None:
            return execute_dummy_batch(self, *args, **kwargs)
        state.in_step = True
        try:
            return execute_dummy_batch(self, *args, **kwargs)
        finally:
            state.in_step = False
            publish_counters(state, write_live=True)

    worker_class.execute_dummy_batch = patched_execute_dummy_batch

    shutdown = GPUModelRunner.shutdown

    @functools.wraps(shutdown)
    def patched_shutdown(self, *args, **kwargs):
        # Engines in worker processes end here on SIGTERM (atexit does not run there).
        state = _runner_state(self)
        if state is not None and state.recorder is not None:
            try:
                flush_state(state)
            except Exception:  # never block vLLM's shutdown
                logger.exception("semmoe: could not write the routing capture")
        return shutdown(self, *args, **kwargs)

    GPUModelRunner.shutdown = patched_shutdown


def publish_counters(state: SemMoEState, write_live: bool = False) -> None:
    """After a step: the MoE counters to ``/metrics``, and (``write_live``: after a dummy batch;
    the recorder writes it after real steps) to the live counters file."""
    if state.metrics is not None:
        state.metrics.update(state.counters)
    if write_live and state.dispatch is not None and state.recorder is not None \
            and state.recorder.live_counters is not None:
        state.recorder.live_counters.write()


def _runner_state(runner) -> SemMoEState | None:
    try:
        return state_of(runner.get_model())
    except (ValueError, AttributeError):  # no model (yet, or any more)
        return None


def begin_step(runner, state: SemMoEState, input_ids, positions) -> None:
    """Open the step: the recorder's rows (requests, tokens, positions) and the TP-shuffle
    step context."""
    import torch

    req_ids, num_prompt, bounds = compat.step_batch(runner)
    n = int(bounds[-1])
    if input_ids is None or n == 0:
        state.recorder.begin_forward(req_ids, num_prompt, bounds, None, None)
        state.begin_step(None)
        return
    tokens = input_ids[:n].detach().to("cpu", torch.int64).numpy().copy()
    pos = positions[:n].detach().to("cpu", torch.int64).numpy().copy()
    state.recorder.begin_forward(req_ids, num_prompt, bounds, tokens, pos)
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
    """Return the live metrics (steps, live LAR, TP-shuffle counters) and write them beside the
    capture (``X.npz.json``, rank 0 of its TP group). The capture itself needs no flush: engines
    append every step to it as the step ends.

    Accepts a model runner or a vLLM worker, so ``LLM.collective_rpc(flush_capture)`` works.
    """
    runner = getattr(runner_or_worker, "model_runner", runner_or_worker)
    state = _runner_state(runner)
    return flush_state(state) if state is not None else {}


def flush_state(state: SemMoEState) -> dict:
    """Write ``state``'s capture and return its summary (steps, live LAR, TP-shuffle counters)."""
    recorder, config = state.recorder, state.config
    if recorder is None or recorder.num_steps == 0:
        return {}
    recorder.drain()
    tp_size, dp_size, dp_rank, _ = state.parallel
    summary = {"steps": recorder.num_steps, "dp_rank": dp_rank}
    if state.counters["layers_run"] and state.shuffles:
        summary["tp_shuffle"] = dict(state.counters)
    if state.dispatch is not None or state.tp_metered:
        summary["moe_traffic"] = {"dispatch": state.dispatch, **state.counters}
    if recorder.meter is not None:
        summary["replayed"] = recorder.meter.result()
    if recorder.store is not None:
        from types import SimpleNamespace

        path = dp_capture_path(config.capture, SimpleNamespace(data_parallel_size=dp_size,
                                                               data_parallel_rank=dp_rank)) + ".json"
        with open(path + ".tmp", "w") as f:
            json.dump(summary, f, indent=2)
        os.replace(path + ".tmp", path)
        summary["path"] = config.capture
    state.flushed_steps, state.flushed_summary = recorder.num_steps, summary
    return summary


def _flush_at_exit(state_ref) -> None:
    state = state_ref()
    if state is not None:
        try:
            flush_state(state)
        except Exception:
            logger.exception("semmoe: could not write the routing capture at exit")


# ---- API server: DP rank choice -----------------------------------------------------------------
def _patch_dp_router() -> None:
    client_class = compat.dp_client_class()
    original = client_class.get_core_engine_for_request

    @functools.wraps(original)
    def get_core_engine_for_request(self, request):
        state = state_of(self)
        if state is None:
            state = SemMoEState(config=_semmoe_config(self.vllm_config), parallel=(0, 0, 0, 0))
            state.dp_router = make_dp_router(self.vllm_config, compat.dp_num_ranks(self))
            register_state(self, state)
        router = state.dp_router
        if (router is not None and request.data_parallel_rank is None and request.prompt_token_ids
                and not compat.dp_request_placed(self, request)):
            request.data_parallel_rank = router.choose(request.prompt_token_ids, compat.dp_queue_scores(self))
        return original(self, request)

    client_class.get_core_engine_for_request = get_core_engine_for_request


def make_dp_router(vllm_config, num_ranks: int):
    """A :class:`DpRouter` when ``semmoe`` is configured in ``dp`` mode, else ``None``."""
    config = _semmoe_config(vllm_config)
    if config is None or config.mode != "dp":
        return None
    from ..tables import load_tables
    from .dp_routing import DpRouter

    router = DpRouter(load_tables(config.tables), num_ranks, balance=config.dp_balance, slack=config.dp_slack,
                      decode_weight=config.dp_decode_weight, price_step=config.dp_price_step)
    logger.info("semmoe: Sem-MoE DP routing over %d ranks (balance %.3g, price step %.3g, decode weight %.0f, "
                "guard slack %.1f)", num_ranks, config.dp_balance, config.dp_price_step, config.dp_decode_weight,
                config.dp_slack)
    return router
