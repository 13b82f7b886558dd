"""The ``semmoe`` entry point of the ``vllm.general_plugins`` group.

vLLM calls :func:`register` in every process it starts (API server, engine core, workers), so
it is idempotent and changes no model unless ``additional_config={"semmoe": {...}}`` is set.
It first checks that this vLLM has every internal the plugin hooks; on a mismatch it fails
loudly, naming what is missing (exclude the plugin with ``VLLM_PLUGINS`` to run without it).

Hooks (all pass through untouched when ``semmoe`` is not configured):

- ``EngineArgs.create_engine_config``: validate the settings and tables at engine start;
- ``BaseModelLoader.create_model``: install the placement before weights load;
- ``GPUModelRunner._model_forward`` (the CPU runner inherits it): feed the routing recorder
  from real forward steps only;
- ``DPLBAsyncMPClient.get_core_engine_for_request``: in ``dp`` mode, pick each request's DP
  rank by Sem-MoE (an explicit ``data_parallel_rank`` / ``X-data-parallel-rank`` still wins).
"""

from __future__ import annotations

import atexit
import functools
import importlib
import json
import logging
import os
import warnings

# a child of vLLM's logger, so messages show with vLLM's format and level
logger = logging.getLogger("vllm.semmoe")

SUPPORTED_VLLM = ("0.32.",)
#: (module, attribute path) of every vLLM internal the plugin touches
REQUIRED_INTERNALS = (
    ("vllm.engine.arg_utils", "EngineArgs.create_engine_config"),
    ("vllm.model_executor.model_loader.base_loader", "BaseModelLoader.create_model"),
    ("vllm.model_executor.layers.fused_moe.runner.moe_runner", "MoERunner.forward"),
    ("vllm.model_executor.layers.fused_moe.router.base_router", "BaseRouter.set_capture_fn"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._model_forward"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.get_model"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.shutdown"),
    ("vllm.v1.engine.core_client", "DPLBAsyncMPClient.get_core_engine_for_request"),
)

_REGISTERED = False


def register() -> None:
    """Install the plugin's hooks once per process."""
    global _REGISTERED
    if _REGISTERED:
        return
    check_vllm()
    from . import cpu_fixes
    from .config import install_one_line_refusals

    install_one_line_refusals()

    cpu_fixes.apply_cpu_fixes()
    _fix_triton_rebind_scan()
    _patch_engine_args()
    _patch_model_loader()
    _patch_model_runner()
    _patch_dp_router()
    _REGISTERED = True


def check_vllm() -> None:
    """Raise ``RuntimeError`` naming the vLLM version or internals this plugin cannot work with."""
    import vllm

    missing = []
    for module_name, path in REQUIRED_INTERNALS:
        try:
            obj = importlib.import_module(module_name)
            for part in path.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError):
            missing.append(f"{module_name}.{path}")
    if missing or not vllm.__version__.startswith(SUPPORTED_VLLM):
        raise RuntimeError(
            f"vllm-semmoe supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)}; this is vLLM "
            f"{vllm.__version__}" + (f", which lacks {', '.join(missing)}" if missing else "")
            + ". Install a supported vLLM, or exclude the plugin with VLLM_PLUGINS (e.g. VLLM_PLUGINS=\"\")."
        )


def _fix_triton_rebind_scan() -> None:
    """vLLM 0.32's Triton kernel re-binding scans every loaded module and calls ``vars(value)``
    on its attributes; llvmlite's ctypes wrappers (loaded with Numba, which this plugin uses)
    answer ``__dict__`` with a non-dict and crash worker start-up. Give that scan a ``vars``
    that treats such objects as having no attributes.
    """
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:
        return
    if not hasattr(dispatcher, "_rebind_kernels"):
        return

    def safe_vars(obj):
        with warnings.catch_warnings():  # deprecated module attributes warn when touched
            warnings.simplefilter("ignore")
            namespace = getattr(obj, "__dict__", None)
        return namespace if isinstance(namespace, dict) else {}

    dispatcher.vars = safe_vars


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
        if config is not None and config.tables is not None:
            validate_against_model(config, vllm_config)
        return vllm_config

    EngineArgs.create_engine_config = create_engine_config


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
    config.check_parallel(vllm_config.parallel_config)
    config.load_tables(num_layers=moe_layer_count(hf), num_experts=int(num_experts),
                       ep_size=expert_parallel_size(vllm_config.parallel_config))


# ---- model build: placement -------------------------------------------------------------------
def _patch_model_loader() -> None:
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    original = BaseModelLoader.create_model

    @functools.wraps(original)
    def create_model(self, vllm_config, model_config, prefix: str = ""):
        model = original(self, vllm_config=vllm_config, model_config=model_config, prefix=prefix)
        config = _semmoe_config(vllm_config)
        if config is not None and config.tables is not None:
            from .config import expert_parallel_size
            from .replacement import install_placement, moe_runners

            runners = moe_runners(model)
            tables = config.load_tables(
                num_layers=len(runners),
                num_experts=int(runners[0].routed_experts.global_num_experts) if runners else -1,
                ep_size=expert_parallel_size(vllm_config.parallel_config),
            )
            install_placement(runners, tables.placement)
            model._semmoe_tables = tables
            parallel = vllm_config.parallel_config
            if config.mode == "tp" and parallel.tensor_parallel_size > 1 and parallel.enable_expert_parallel:
                from .tp_shuffle import TpShuffleLayer

                for index, runner in enumerate(runners):
                    runner._semmoe_tp = TpShuffleLayer(index, tables)
                fuse_decoder_layers(model)
            logger.info("semmoe: %s placement (EP %d) installed on %d MoE layers",
                        tables.placement.method, tables.ep_size, len(runners))
        return model

    BaseModelLoader.create_model = create_model


# ---- model runner: capture ---------------------------------------------------------------------
def _patch_model_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    model_forward = GPUModelRunner._model_forward

    @functools.wraps(model_forward)
    def patched_model_forward(self, input_ids=None, positions=None, *args, **kwargs):
        # Only real engine steps come through here (warm-up and profiling runs call the model
        # directly), so the recorder is attached on the first one and sees nothing else.
        recorder = self.__dict__.get("_semmoe_recorder", _UNSET)
        if recorder is _UNSET:
            config = _semmoe_config(self.vllm_config)
            recorder = attach_recorder(self, config) if config is not None and config.records else None
            self._semmoe_recorder = recorder
        if recorder is None:
            return model_forward(self, input_ids, positions, *args, **kwargs)
        recorder.begin_forward(self, input_ids, positions)
        from . import tp_shuffle  # lazy: imports Triton/Numba, only needed in engines that record

        if recorder._current is not None and recorder.shuffle_tables is not None:
            tp_shuffle.STEP = tp_shuffle.StepContext(recorder._current["token"], recorder.shuffle_tables, recorder)
        try:
            output = model_forward(self, input_ids, positions, *args, **kwargs)
        finally:
            tp_shuffle.STEP = None
        recorder.end_forward()
        return output

    GPUModelRunner._model_forward = patched_model_forward

    shutdown = GPUModelRunner.shutdown

    @functools.wraps(shutdown)
    def patched_shutdown(self, *args, **kwargs):
        # Engines in worker processes end here on SIGTERM (atexit does not run there).
        if self.__dict__.get("_semmoe_recorder") is not None:
            try:
                flush_capture(self)
            except Exception:  # never block vLLM's shutdown
                logger.exception("semmoe: could not write the routing capture")
        return shutdown(self, *args, **kwargs)

    GPUModelRunner.shutdown = patched_shutdown

    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    moe_forward = MoERunner.forward

    @functools.wraps(moe_forward)
    def patched_moe_forward(self, hidden_states, router_logits, *args, **kwargs):
        from . import tp_shuffle

        layer = self.__dict__.get("_semmoe_tp")
        step = tp_shuffle.STEP
        if layer is None or step is None or hidden_states.shape[0] != len(step.rows):
            # not configured, a warm-up run, or a padded batch: vLLM's own path on every rank
            return moe_forward(self, hidden_states, router_logits, *args, **kwargs)
        return tp_shuffle.shuffled_moe_forward(self, layer, hidden_states, tp_shuffle.STEP)

    MoERunner.forward = patched_moe_forward


_UNSET = object()


def fuse_decoder_layers(model) -> int:
    """Give Qwen3-MoE-style decoder layers (input/post-attention norms, row-parallel ``o_proj``,
    ``mlp.experts`` = a shuffled MoE layer) the fused SRS/SAG forward; returns how many.
    Other layers keep the MoE-boundary shuffle."""
    from . import tp_shuffle

    fused = 0
    for module in model.modules():
        mlp, attn = getattr(module, "mlp", None), getattr(module, "self_attn", None)
        layer = getattr(getattr(mlp, "experts", None), "_semmoe_tp", None)
        if layer is None or getattr(mlp, "shared_expert", None) is not None or getattr(mlp, "is_sequence_parallel", False) \
                or not hasattr(attn, "o_proj") or not hasattr(module, "post_attention_layernorm"):
            continue
        original = module.forward

        def forward(positions, hidden_states, residual, *, _module=module, _layer=layer, _original=original):
            step = tp_shuffle.STEP
            if step is None or hidden_states.shape[0] != len(step.rows):
                return _original(positions, hidden_states, residual)
            return tp_shuffle.fused_decoder_forward(_module, _layer, positions, hidden_states, residual, step)

        module.forward = forward
        fused += 1
    logger.info("semmoe: shuffled reduce-scatter/all-gather fused into %d decoder layers", fused)
    return fused


# ---- API server: DP rank choice -----------------------------------------------------------------
def _patch_dp_router() -> None:
    from vllm.v1.engine.core_client import DPLBAsyncMPClient

    original = DPLBAsyncMPClient.get_core_engine_for_request

    @functools.wraps(original)
    def get_core_engine_for_request(self, request):
        router = self.__dict__.get("_semmoe_router", _UNSET)
        if router is _UNSET:
            router = self._semmoe_router = make_dp_router(self.vllm_config, len(self.core_engines))
        if (router is not None and request.data_parallel_rank is None and request.prompt_token_ids
                and request.request_id not in self.reqs_in_flight):
            scores = [max(self.client_count * self.engine_inflight[engine], waiting + running)
                      for engine, (waiting, running, *_) in zip(self.core_engines, self.lb_engines)]
            request.data_parallel_rank = router.choose(request.prompt_token_ids, scores)
        return original(self, request)

    DPLBAsyncMPClient.get_core_engine_for_request = get_core_engine_for_request


def make_dp_router(vllm_config, num_ranks: int):
    """A :class:`DpRouter` when ``semmoe`` is configured in ``dp`` mode, else ``None``."""
    config = _semmoe_config(vllm_config)
    if config is None or config.mode != "dp":
        return None
    from ..tables import load_tables
    from .dp_routing import DpRouter

    router = DpRouter(load_tables(config.tables), num_ranks, slack=config.dp_slack,
                      price_step=config.dp_price_step)
    logger.info("semmoe: Sem-MoE DP routing over %d ranks (guard slack %.1f)", num_ranks, config.dp_slack)
    return router


def attach_recorder(runner, config):
    """Give ``runner`` a :class:`RoutingRecorder` fed by every MoE layer's capture hook."""
    from .capture import RoutingRecorder
    from .replacement import moe_runners

    model = runner.get_model()
    layers = moe_runners(model)
    tables = getattr(model, "_semmoe_tables", None)
    hf = runner.model_config.hf_text_config
    recorder = RoutingRecorder(
        num_layers=len(layers),
        num_experts=int(layers[0].routed_experts.global_num_experts),
        top_k=int(getattr(hf, "num_experts_per_tok")),
        placement=tables.placement if tables is not None else None,
        vocab=_vocab(runner.model_config),
        vocab_size=int(runner.model_config.get_vocab_size()),
    )
    for index, layer in enumerate(layers):
        layer.router.set_capture_fn(functools.partial(recorder.on_layer, index))
    parallel = runner.vllm_config.parallel_config
    if parallel.data_parallel_size > 1 and tables is not None and config.capture is not None:
        from .capture import DpLiveCounters

        recorder.dp_counters = DpLiveCounters(
            dp_capture_path(config.capture, parallel) + ".live.json", parallel.data_parallel_rank,
            parallel.data_parallel_size, recorder.num_experts, tables.ep_size)
    if tables is not None:
        from .capture import LiveMeter

        recorder.meter = LiveMeter(tables, vocab_size=recorder.vocab_size, dp_rank=parallel.data_parallel_rank,
                                   dp_size=parallel.data_parallel_size)
    if config.capture is not None and _tp_rank() == 0:  # TP ranks see the same tokens: one writes
        recorder.open_store(config.capture, dp_rank=parallel.data_parallel_rank,
                            dp_size=parallel.data_parallel_size)
    runner._semmoe_config = config
    recorder.config_mode = config.mode
    # tables for the TP shuffle, when this engine runs it (set at model build)
    recorder.shuffle_tables = tables if any(getattr(l, "_semmoe_tp", None) for l in layers) else None
    atexit.register(flush_capture, runner)
    return recorder


def _vocab(model_config) -> list[str]:
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer,
                                                  trust_remote_code=model_config.trust_remote_code)
        return tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    except Exception as exc:  # the trace is still valid without token strings
        logger.warning("semmoe: no vocabulary for the capture (%s)", exc)
        return []


def dp_capture_path(path: str, parallel_config) -> str:
    """The capture path of this engine: ``X.npz``, or ``X.dp<rank>.npz`` under data parallelism."""
    if parallel_config.data_parallel_size <= 1:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.dp{parallel_config.data_parallel_rank}{ext}"


def _tp_rank() -> int:
    from vllm.distributed import parallel_state

    return parallel_state.get_tensor_model_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0


def flush_capture(runner_or_worker) -> dict:
    """Return the live metrics (steps, live LAR, TP-shuffle counters) and write them beside the
    capture (``X.npz.json``, rank 0 of its TP group). The capture itself needs no flush: engines
    append every step to it as the step ends.

    Accepts a model runner or a vLLM worker, so ``LLM.collective_rpc(flush_capture)`` works.
    """
    runner = getattr(runner_or_worker, "model_runner", runner_or_worker)
    recorder = getattr(runner, "_semmoe_recorder", None)
    config = getattr(runner, "_semmoe_config", None)
    if recorder is None or recorder.num_steps == 0:
        return {}
    recorder.drain()
    dp = runner.vllm_config.parallel_config
    summary = {"steps": recorder.num_steps, "dp_rank": dp.data_parallel_rank}
    if getattr(recorder, "config_mode", None) == "tp":
        from .tp_shuffle import TpShuffleLayer

        if TpShuffleLayer.counters["layers_run"]:
            summary["tp_shuffle"] = dict(TpShuffleLayer.counters)
    if recorder.meter is not None:
        summary["live"] = recorder.meter.result()
    if recorder.store is not None:
        path = dp_capture_path(config.capture, dp) + ".json"
        with open(path + ".tmp", "w") as f:
            json.dump(summary, f, indent=2)
        os.replace(path + ".tmp", path)
        summary["path"] = config.capture
    return summary
