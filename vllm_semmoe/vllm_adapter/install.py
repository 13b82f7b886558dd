"""Sem-MoE installed into a freshly built model (weights not loaded yet): the engine's
:class:`~.state.EngineState`, the placement, the routing recorder, the TP shuffle (fused into the
decoder layers where recognised) and the DP + EP dispatch.

Called once per engine by the ``BaseModelLoader.create_model`` patch (:mod:`.patches.model_loader`).
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import TYPE_CHECKING

from ..core.modes import TP_SHUFFLE
from . import compat
from .recording import flush_at_exit, make_recorder
from .state import EngineState, register_state

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from ..core.schedulers import TpScheduler
    from ..core.tables import SemMoETables
    from .config import SemMoEConfig

logger = logging.getLogger("vllm.semmoe")


def replica_slots(tables: SemMoETables | None) -> int:
    """Redundant physical expert slots in all (``E * R``) the model's MoE layers must be built
    with for ``tables`` (0: none, or no tables)."""
    if tables is None:
        return 0
    return tables.placement.num_physical_experts - tables.placement.num_experts


def build_state(model, config: SemMoEConfig, vllm_config: VllmConfig,
                tables: SemMoETables | None = None) -> EngineState:
    """Create the engine's state for a freshly built ``model`` (weights not loaded yet): install
    the placement, the routing recorder and the TP shuffle, and register the state under the
    model and its MoE layers. ``tables``: ``config``'s tables when already read (the hook reads
    them before the model is built, for its replica slots)."""
    from .config import expert_parallel_size, layout_of, replica_token_device
    from .replacement import install_placement, install_self_check, moe_runners

    runners = moe_runners(model)
    parallel = vllm_config.parallel_config
    layout = layout_of(parallel)
    ep_size = expert_parallel_size(parallel)
    state = EngineState(config=config, layout=layout, dp_rank=int(getattr(parallel, "data_parallel_rank", 0) or 0),
                        ep_size=ep_size)
    register_state(model, state)
    for runner in runners:
        register_state(runner, state)
    if config.tables is not None:
        state.tables = config.load_tables(
            num_layers=len(runners),
            num_experts=int(runners[0].routed_experts.moe_config.num_logical_experts) if runners else -1,
            ep_size=ep_size, tables=tables)
        state.token_device = replica_token_device(state.tables, config.mode, vllm_config.parallel_config,
                                                  compat.ep_group().rank_in_group if ep_size > 1 else 0)
        installed = install_placement(model, runners, state.tables.placement, state.token_device)
        install_self_check(model, runners, installed)
        logger.info("semmoe: %s placement (EP %d%s) installed on %d MoE layers",
                    state.tables.placement.method, state.tables.ep_size,
                    f", {state.tables.placement.redundant} replica slot(s) per rank, this rank's copies preferred"
                    if state.token_device is not None else "", len(runners))
    if config.records:
        state.recorder = make_recorder(runners, vllm_config, state)
    if TP_SHUFFLE in config.mode.installs and layout.tp > 1 and layout.ep:
        from ..core.schedulers import TpScheduler, scheduling_tables
        from . import ops
        from .tp_shuffle import TpShuffleLayer, install_shuffled_experts

        scheduler = TpScheduler(scheduling_tables(state.tables))  # one for the engine's MoE layers
        for index, runner in enumerate(runners):
            state.tp_layers[runner.layer_name] = TpShuffleLayer(index, state.tables, scheduler)
        fuse_decoder_layers(model, state)
        for runner in runners:
            if runner.layer_name not in state.fused:
                ops.install_moe_op(runner, runner.layer_name)
                install_shuffled_experts(runner, state.tp_layers[runner.layer_name], state)
        warm_up_scheduler(scheduler, ep_size)
    install_dispatch(model, runners, state, config.resolved_dispatch(vllm_config.parallel_config))
    if layout.tp > 1 and state.recorder is not None:  # count the TP group's collectives too
        from .ep_dispatch import CollectiveMeter

        tp = compat.tp_group()
        state.tp_meter = CollectiveMeter(tp.device_communicator, tp.rank_in_group, tp.world_size,
                                         _weak_counters(state))
    if config.records:  # flush at interpreter exit too (holds the state weakly)
        flush_at_exit(state)
    return state


def install_dispatch(model, runners: list, state: EngineState, dispatch: str | None) -> None:
    """DP + EP: give the MoE layers the sparse dispatch, or meter vLLM's own (when recording)."""
    from .ep_dispatch import report_unmetered
    from .patches.prepare_finalize import install_stages

    if dispatch is None or (dispatch == "vllm" and state.recorder is None):
        return
    on_unmetered = functools.partial(report_unmetered, dp_rank=state.dp_rank, failures=state.failures)
    install_stages(model, runners, dispatch == "sparse", state.moe_counters, on_unmetered)
    state.dispatch = dispatch
    from .metrics import EngineMetrics

    if EngineMetrics.available():
        state.metrics = EngineMetrics(state.dp_rank)
    logger.info("semmoe: %s MoE dispatch on %d MoE layers", "sparse EP" if dispatch == "sparse" else
                "vLLM's all-gather (metered)", len(runners))


def _weak_counters(state: EngineState):
    """``state.moe_counters`` without keeping ``state`` alive (the communicator outlives engines)."""
    from .state import new_moe_counters

    ref = weakref.ref(state)

    def counters_of() -> dict:
        alive = ref()
        return alive.moe_counters() if alive is not None else new_moe_counters()

    return counters_of


def warm_up_scheduler(scheduler: TpScheduler, ep_size: int) -> None:
    """Compile the Numba TP scheduler now (types of the real calls), not in the first step: a
    two-token decision at the first layer (no history) and the second (with history)."""
    import numpy as np

    rows = scheduler.rows(np.array([-1, 0], np.int64))
    if not scheduler.schedules:  # contiguous slices
        scheduler.decide(0, rows, None, ep_size)
        return
    routed = {0: scheduler.history(0, np.zeros((2, scheduler.tables.top_k), np.int64))}
    for layer in range(min(2, scheduler.tables.num_layers)):
        scheduler.decide(layer, rows, scheduler.previous(layer, routed, 2), ep_size)


def fuse_decoder_layers(model, state: EngineState) -> int:
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
