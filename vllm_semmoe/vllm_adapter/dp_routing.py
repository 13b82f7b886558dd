"""Attention-DP inside vLLM: choose each request's data-parallel rank the Sem-MoE way.

Runs in the API server process, in vLLM's DP load balancer
(``DPLBAsyncMPClient.get_core_engine_for_request``). The decision itself is the pure
:func:`vllm_semmoe.scheduling.dp_choose`; this module only gathers its inputs (the prompt's
T2D votes, which ranks the balance guard allows) and keeps per-rank counters.
"""

from __future__ import annotations

import logging

import numpy as np

from .. import scheduling
from ..tables import SemMoETables

logger = logging.getLogger("vllm.semmoe")


class DpRouter:
    """Sem-MoE rank choice for one API-server process.

    Args:
        tables: tables whose EP size is ``num_ranks * ranks_per_dp`` (DP rank ``r`` owns EP
            devices ``r * ranks_per_dp ..``).
        slack: balance guard: a rank whose queue score exceeds the least-loaded rank's by more
            than this is never chosen (score = vLLM's own: in-flight and queued requests).
        price_step: step of the token-balance prices (:func:`scheduling.dp_choose`).
    """

    def __init__(self, tables: SemMoETables, num_ranks: int, *, slack: float, price_step: float):
        if tables.ep_size % num_ranks:
            raise ValueError(f"tables for EP {tables.ep_size} cannot be split over {num_ranks} DP ranks")
        self.tables = tables
        self.num_ranks = num_ranks
        self.ranks_per_dp = tables.ep_size // num_ranks
        self.slack, self.price_step = slack, price_step
        self.t2d = tables.t2d_score.astype(np.float32)
        self.state = scheduling.dp_state(num_ranks)
        self.requests = np.zeros(num_ranks, np.int64)
        self.prompt_tokens = np.zeros(num_ranks, np.int64)
        self.metrics = _prometheus_counters()

    def votes(self, prompt_token_ids) -> np.ndarray:
        """``[num_ranks]`` predicted local activations of the prompt on each DP rank."""
        tokens = np.asarray(prompt_token_ids, np.int64)
        rows = self.tables.token_rows(tokens)
        per_device = scheduling.request_votes(rows, np.array([0, len(tokens)]), self.t2d,
                                              self.tables.oov_score)[0]
        return per_device.reshape(self.num_ranks, self.ranks_per_dp).sum(axis=1)

    def choose(self, prompt_token_ids, queue_scores) -> int:
        """Rank for a request, given each rank's current queue score (lower = less loaded)."""
        scores = np.asarray(queue_scores, np.float64)
        eligible = scores <= scores.min() + self.slack
        rank = int(scheduling.dp_choose(self.votes(prompt_token_ids), float(len(prompt_token_ids)),
                                        self.state, self.price_step, eligible))
        self.record(rank, len(prompt_token_ids))
        return rank

    def record(self, rank: int, prompt_tokens: int) -> None:
        self.requests[rank] += 1
        self.prompt_tokens[rank] += prompt_tokens
        if self.metrics:
            self.metrics[0].labels(dp_rank=str(rank)).inc()
            self.metrics[1].labels(dp_rank=str(rank)).inc(prompt_tokens)
        if self.requests.sum() % 100 == 0:
            logger.info("semmoe DP routing: requests per rank %s, prompt tokens per rank %s",
                        self.requests.tolist(), self.prompt_tokens.tolist())


def _prometheus_counters():
    """``vllm:semmoe_requests`` and ``vllm:semmoe_prompt_tokens`` per DP rank on /metrics."""
    from .metrics import prometheus_counters

    return prometheus_counters("DP routing", (
        ("vllm:semmoe_requests", "Requests routed by Sem-MoE, per DP rank", ("dp_rank",)),
        ("vllm:semmoe_prompt_tokens", "Prompt tokens routed by Sem-MoE, per DP rank", ("dp_rank",)),
    ))
