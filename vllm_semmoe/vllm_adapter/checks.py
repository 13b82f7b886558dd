"""Engine-start checks: refuse, before any worker starts, what the plugin cannot serve.

Run by the ``EngineArgs.create_engine_config`` patch (:mod:`.patches.engine_args`) when ``semmoe`` is
configured: the parallel layout the mode needs, compilation settings (the plugin's per-step ops
must stay outside CUDA graphs), and the tables against the model's HF config. Each refusal is
one :class:`~.config.SemMoEConfigError` naming the setting and what to do instead.
"""

from __future__ import annotations

import logging

from . import compat

logger = logging.getLogger("vllm.semmoe")


def check_engine_config(config, vllm_config) -> None:
    """Refuse, before any worker starts, what the plugin cannot serve; keep its ops outside
    piecewise CUDA graphs."""
    check_layout(config, vllm_config)
    check_load_balancing(config, vllm_config)
    check_compilation(config, vllm_config)
    if config.tables is not None:
        validate_against_model(config, vllm_config)


def check_layout(config, vllm_config) -> None:
    """Raise :class:`SemMoEConfigError` for a parallel layout ``config.mode`` (or
    ``config.dispatch``) does not support, and warn of one it gains little on; the rules are the
    mode's (:meth:`vllm_semmoe.core.modes.Mode.check_layout`, :meth:`~vllm_semmoe.core.modes.Mode.layout_warning`)."""
    from .config import layout_of, refusals

    layout = layout_of(vllm_config.parallel_config)
    with refusals():
        config.mode.check_layout(layout, config.dispatch)
    warning = config.mode.layout_warning(layout, config.mode.dispatch(layout, config.dispatch))
    if warning:
        logger.warning(warning)


def check_load_balancing(config, vllm_config) -> None:
    """``dp`` mode routes requests inside vLLM's DP load balancer. Say at start where that
    balancer sees only part of the deployment: with hybrid load balancing each node's API server
    routes among its own ranks; with external load balancing no vLLM balancer chooses a rank, so
    the outside router must (``semmoe route``)."""
    from ..core.modes import ServingMode

    parallel = vllm_config.parallel_config
    if config.mode != ServingMode.DP or parallel.data_parallel_size <= 1:
        return
    balancing = compat.dp_load_balancing(parallel)
    if balancing == "hybrid":
        logger.info("semmoe: hybrid DP load balancing: each node's API server routes its requests among "
                    "its own %d DP rank(s) by Sem-MoE's rule", parallel.data_parallel_size_local)
    elif balancing == "external":
        logger.warning(
            "semmoe: external DP load balancing: no vLLM balancer chooses the DP rank, so the plugin "
            "routes nothing; Sem-MoE's rank choice is the outside router's: `semmoe route --tables T "
            "--prompt ...` (or vllm_semmoe.core.route.rank_dp_ranks) ranks the DP ranks, and the router "
            "sends each request to the best rank's server (tables, placement and capture still apply)")


def check_compilation(config, vllm_config) -> None:
    """Compiled models run the plugin's per-step work inside opaque ops (:mod:`.ops`); piecewise
    CUDA graphs must split at them, full CUDA graphs cannot run them: refused."""
    from .config import SemMoEConfigError
    from .ops import CAPTURE_SPLITTING_OPS, SPLITTING_OPS

    if not (config.records or config.resolved_dispatch(vllm_config.parallel_config) == "sparse"):
        return  # placement only: nothing runs per step (every data-scheduling mode records)
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
    from .config import SemMoEConfigError, expert_parallel_size, moe_layer_count, replica_token_device

    hf = vllm_config.model_config.hf_text_config
    num_experts = next((getattr(hf, k) for k in ("num_experts", "n_routed_experts", "num_local_experts")
                        if getattr(hf, k, None)), None)
    if num_experts is None:
        raise SemMoEConfigError(f"semmoe: {vllm_config.model_config.model} is not a MoE model")
    tables = config.load_tables(num_layers=moe_layer_count(hf), num_experts=int(num_experts),
                                ep_size=expert_parallel_size(vllm_config.parallel_config))
    replica_token_device(tables, config.mode, vllm_config.parallel_config, 0)  # refuses a layout replicas cannot use
