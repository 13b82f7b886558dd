"""vLLM's DP load-balancing client (API server): in ``dp`` mode each request's DP rank is chosen
by Sem-MoE, and the router hears each request's generated tokens and finish.

An explicit ``data_parallel_rank`` / ``X-data-parallel-rank`` still wins; a request vLLM has
already placed keeps its rank. The API server's :class:`~..state.ApiServerState` (tables and
router) is made when vLLM builds the client, at the server's start, and the router's decision is
compiled then: no request waits for that work (about a quarter of a second, which would hold up
every request arriving with the first). Bad tables stop the server at start.
"""

from __future__ import annotations

import functools
import logging

from ...core.modes import ServingMode
from .. import compat
from ..config import SemMoEConfig
from ..state import ApiServerState, api_server_state
from .base import Patch

logger = logging.getLogger("vllm.semmoe")


def make_api_server_state(vllm_config, ranks: list[int]) -> ApiServerState | None:
    """The API server's state (its tables and :class:`~..dp_routing.DpRouter` over the DP ranks
    ``ranks`` its balancer sees: all of them, or with hybrid load balancing its node's) when
    ``semmoe`` is configured in ``dp`` mode, else ``None``."""
    config = SemMoEConfig.from_additional_config(getattr(vllm_config, "additional_config", None))
    if config is None or config.mode != ServingMode.DP:
        return None
    from ..dp_routing import DpRouter

    tables = config.read_tables()
    router = DpRouter(tables, vllm_config.parallel_config.data_parallel_size, ranks=ranks,
                      balance=config.dp_balance, slack=config.dp_slack,
                      decode_weight=config.dp_decode_weight, price_step=config.dp_price_step)
    router.warm_up()
    logger.info("semmoe: Sem-MoE DP routing over %d ranks %s (balance %.3g, price step %.3g, decode weight %.0f, "
                "guard slack %.1f)", len(ranks), ranks, config.dp_balance, config.dp_price_step, config.dp_decode_weight,
                config.dp_slack)
    return ApiServerState(config=config, tables=tables, dp_router=router)


def _state(client) -> ApiServerState | None:
    """``client``'s API-server state, made on the first call."""
    return api_server_state(client, lambda: make_api_server_state(client.vllm_config, compat.dp_managed_ranks(client)))


def _init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _state(self)

    return __init__


def _get_core_engine_for_request(original):
    @functools.wraps(original)
    def get_core_engine_for_request(self, request):
        state = _state(self)
        if (state is not None and request.data_parallel_rank is None and request.prompt_token_ids
                and not compat.dp_request_placed(self, request)):
            request.data_parallel_rank = state.dp_router.choose(request.prompt_token_ids, compat.dp_queue_scores(self),
                                                                request.request_id)
        return original(self, request)

    return get_core_engine_for_request


def _process_engine_outputs(original):  # a staticmethod: (self, outputs)
    @functools.wraps(original)
    async def process_engine_outputs(self, outputs):
        await original(self, outputs)
        state = api_server_state(self)
        if state is not None:
            state.dp_router.observe(outputs.outputs, outputs.finished_requests)

    return process_engine_outputs


INIT = Patch(
    "vllm.v1.engine.core_client.DPLBAsyncMPClient.__init__",
    "in dp mode, build the DP router and compile its decision when the API server starts",
    _init)
GET_CORE_ENGINE = Patch(
    "vllm.v1.engine.core_client.DPLBAsyncMPClient.get_core_engine_for_request",
    "in dp mode, choose each request's DP rank by Sem-MoE before vLLM's balancer places it",
    _get_core_engine_for_request)
PROCESS_ENGINE_OUTPUTS = Patch(
    "vllm.v1.engine.core_client.DPLBAsyncMPClient.process_engine_outputs",
    "tell the DP router each request's generated tokens and finish (its in-flight work)",
    _process_engine_outputs)

PATCHES = (INIT, GET_CORE_ENGINE, PROCESS_ENGINE_OUTPUTS)
