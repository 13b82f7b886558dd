"""Attention-DP inside vLLM: choose each request's data-parallel rank the Sem-MoE way.

Runs in the API server process, in vLLM's DP load balancer
(``DPLBAsyncMPClient.get_core_engine_for_request``). The decision is
:func:`vllm_semmoe.scheduling.dp_choose_balanced`, the rule the offline evaluation measures
(``window_imbalance``): the prompt's T2D votes against per-rank prices learned from the work this
router sent each rank, and each rank's in-flight work. This module gathers its inputs, keeps
the prices and per-rank counters.

In-flight work per rank: vLLM's own count of the rank's unfinished requests (its load
balancer's queue score: waiting plus running, or in-flight requests times API servers) taken
as that many of the requests this router sent there most recently, each weighing its prompt
tokens plus the decode weight (:func:`vllm_semmoe.scheduling.request_work`: generated tokens
are not visible here, the decode weight stands for them); requests beyond the ones it sent
(other API servers') count the mean work.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math

import numpy as np

from .. import scheduling
from ..tables import SemMoETables

logger = logging.getLogger("vllm.semmoe")


class DpRouter:
    """Sem-MoE rank choice for one API-server process.

    Args:
        tables: tables whose EP size is ``num_ranks * ranks_per_dp`` (DP rank ``r`` owns EP
            devices ``r * ranks_per_dp ..``).
        balance, price_step: the balance knobs of :func:`.scheduling.dp_choose_balanced`.
        slack: hard guard: a rank whose queue score exceeds the least-loaded rank's by more
            than this (in requests) is never chosen.
        decode_weight: work of a request beyond its prompt (expected generated tokens).
    """

    def __init__(self, tables: SemMoETables, num_ranks: int, *, balance: float = scheduling.DEFAULT_DP_BALANCE,
                 slack: float = math.inf, decode_weight: float = scheduling.DEFAULT_DECODE_WEIGHT,
                 price_step: float = scheduling.DEFAULT_DP_PRICE_STEP):
        if tables.ep_size % num_ranks:
            raise ValueError(f"tables for EP {tables.ep_size} cannot be split over {num_ranks} DP ranks")
        self.tables = tables
        self.num_ranks = num_ranks
        self.ranks_per_dp = tables.ep_size // num_ranks
        self.balance, self.slack, self.decode_weight = balance, slack, decode_weight
        self.price_step = price_step
        #: per-rank prices (votes per unit of work), updated by every decision
        self.price = np.zeros(num_ranks)
        self.t2d = tables.t2d_score.astype(np.float32)
        #: work of the requests sent to each rank, newest last (enough to cover its in-flight ones)
        self.sent: list[collections.deque] = [collections.deque(maxlen=4096) for _ in range(num_ranks)]
        self.total_work = 0.0
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

    def in_flight_work(self, queue_scores) -> np.ndarray:
        """``[num_ranks]`` estimated in-flight work from vLLM's per-rank queue scores (module
        docstring)."""
        mean = self.mean_work()
        load = np.zeros(self.num_ranks)
        for r, score in enumerate(queue_scores):
            n = max(0, int(math.ceil(score)))
            mine = list(itertools.islice(reversed(self.sent[r]), n))  # the last n sent, not the whole deque
            load[r] = sum(mine) + (n - len(mine)) * mean
        return load

    def work(self, prompt_tokens: int) -> float:
        """A request's work: its prompt plus the decode weight (:func:`.scheduling.request_work`)."""
        return float(scheduling.request_work([prompt_tokens], self.decode_weight)[0])

    def mean_work(self, pending: float | None = None) -> float:
        """Mean work of the requests routed so far, with ``pending`` (a request being routed)
        counted too, as the offline rule does (:func:`.scheduling.dp_assign`)."""
        total, count = self.total_work, int(self.requests.sum())
        if pending is not None:
            total, count = total + pending, count + 1
        return total / count if count else self.work(1)

    def choose(self, prompt_token_ids, queue_scores) -> int:
        """Rank for a request, given each rank's queue score (vLLM's: unfinished requests)."""
        scores = np.asarray(queue_scores, np.float64)
        votes = self.votes(prompt_token_ids)
        votes[scores > scores.min() + self.slack] = -np.inf
        work = self.work(len(prompt_token_ids))
        rank = int(scheduling.dp_choose_balanced(votes, self.in_flight_work(scores), self.mean_work(pending=work),
                                                 work, self.balance, self.price, self.price_step))
        self.record(rank, len(prompt_token_ids), work)
        return rank

    def record(self, rank: int, prompt_tokens: int, work: float | None = None) -> None:
        """Count a request sent to ``rank`` (``work``: its :meth:`work`, computed if not given)."""
        work = self.work(prompt_tokens) if work is None else work
        self.sent[rank].append(work)
        self.total_work += work
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
