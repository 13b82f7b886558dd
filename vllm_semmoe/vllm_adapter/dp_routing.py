"""Attention-DP inside vLLM: choose each request's data-parallel rank the Sem-MoE way.

Runs in the API server process, in vLLM's DP load balancer
(``DPLBAsyncMPClient.get_core_engine_for_request``). The decision is
:meth:`vllm_semmoe.core.schedulers.DpScheduler.choose`, the scheduler the offline evaluation runs
(``window_imbalance``): the prompt's T2D votes against per-rank prices learned from the work this
router sent each rank, and each rank's in-flight work. This module gathers its inputs and keeps
the per-rank counters.

In-flight work per rank: the prompt tokens plus the tokens generated so far of every request
this router sent there and vLLM has not finished. Generated tokens and finishes come from the
engines' outputs as this process receives them (``DPLBAsyncMPClient.process_engine_outputs``,
hooked by the plugin: the same stream vLLM's own balancer counts its in-flight requests from;
:meth:`DpRouter.observe`). Requests other API servers sent (vLLM's per-rank queue score, waiting
plus running, above this router's own in-flight count) count the mean in-flight work of this
router's requests (before it has any in flight: the mean work of those it routed).
"""

from __future__ import annotations

import logging
import math

import numpy as np

from ..core import scheduling
from ..core.schedulers import DpScheduler
from ..core.tables import SemMoETables

logger = logging.getLogger("vllm.semmoe")


class DpRouter:
    """Sem-MoE rank choice for one API-server process.

    Args:
        tables: tables whose EP size is ``num_ranks * ranks_per_dp`` (DP rank ``r`` owns EP
            devices ``r * ranks_per_dp ..``).
        num_ranks: the deployment's DP size.
        ranks: the DP ranks this API server balances (vLLM's hybrid load balancing: its node's;
            default all). Ranks chosen and per-rank arrays are positions in ``ranks``, vLLM's
            index of the engines this server talks to.
        balance, price_step: the balance knobs of :func:`.scheduling.dp_choose_balanced`.
        slack: hard guard: a rank whose queue score exceeds the least-loaded rank's by more
            than this (in requests) is never chosen.
        decode_weight: work of a request beyond its prompt (expected generated tokens).
    """

    def __init__(self, tables: SemMoETables, num_ranks: int, *, balance: float = scheduling.DEFAULT_DP_BALANCE,
                 slack: float = math.inf, decode_weight: float = scheduling.DEFAULT_DECODE_WEIGHT,
                 price_step: float = scheduling.DEFAULT_DP_PRICE_STEP, ranks=None):
        #: the decision (votes, work, the balanced choice and its per-rank prices)
        self.scheduler = DpScheduler(tables, num_ranks, balance=balance, price_step=price_step,
                                     decode_weight=decode_weight, ranks=ranks)
        self.tables = tables
        #: the DP ranks this router balances; arrays below are indexed by position in it
        self.ranks = self.scheduler.ranks
        self.num_ranks = len(self.ranks)
        self.ranks_per_dp = self.scheduler.ranks_per_dp
        self.slack = slack
        #: this router's unfinished requests: request id -> [rank, prompt plus generated tokens]
        self.in_flight: dict[str, list] = {}
        self.total_work = 0.0
        self.requests = np.zeros(num_ranks, np.int64)
        self.prompt_tokens = np.zeros(num_ranks, np.int64)
        self.metrics = _prometheus_counters()

    @property
    def price(self) -> np.ndarray:
        """``[num_ranks]`` per-rank prices (votes per unit of work), updated by every decision."""
        return self.scheduler.price

    def votes(self, prompt_token_ids) -> np.ndarray:
        """``[num_ranks]`` predicted local activations of the prompt on each DP rank
        (:meth:`~vllm_semmoe.core.schedulers.DpScheduler.votes`, what ``semmoe route`` scores too)."""
        return self.scheduler.votes(prompt_token_ids)

    @property
    def in_flight_requests(self) -> np.ndarray:
        """``[num_ranks]`` int64 how many of this router's requests are unfinished on each rank."""
        return np.bincount([r for r, _ in self.in_flight.values()], minlength=self.num_ranks).astype(np.int64)

    @property
    def in_flight_tokens(self) -> np.ndarray:
        """``[num_ranks]`` float64 summed prompt plus generated tokens of those requests."""
        ranks, tokens = zip(*self.in_flight.values()) if self.in_flight else ((), ())
        return np.bincount(ranks, weights=tokens, minlength=self.num_ranks).astype(np.float64)

    def in_flight_work(self, queue_scores) -> np.ndarray:
        """``[num_ranks]`` in-flight work: this router's unfinished requests' prompt plus
        generated tokens, and, where vLLM's queue score counts more unfinished requests than
        this router's own (other API servers'), their mean for each of the others (module
        docstring)."""
        tokens, requests = self.in_flight_tokens, self.in_flight_requests
        mean = tokens.sum() / requests.sum() if self.in_flight else self.mean_work()
        others = np.maximum(np.ceil(np.asarray(queue_scores, np.float64)) - requests, 0.0)
        return tokens + others * mean

    def work(self, prompt_tokens: int) -> float:
        """A request's work: its prompt plus the decode weight (:meth:`~vllm_semmoe.core.schedulers.DpScheduler.work`)."""
        return self.scheduler.work(prompt_tokens)

    def mean_work(self, pending: float | None = None) -> float:
        """Mean work of the requests routed so far, with ``pending`` (a request being routed)
        counted too, as the offline rule does (:func:`.scheduling.dp_assign`)."""
        total, count = self.total_work, int(self.requests.sum())
        if pending is not None:
            total, count = total + pending, count + 1
        return total / count if count else self.work(1)

    def choose(self, prompt_token_ids, queue_scores, request_id: str) -> int:
        """Rank for request ``request_id``, given each rank's queue score (vLLM's: unfinished
        requests); the request counts as in flight there until :meth:`observe` sees it finish."""
        scores = np.asarray(queue_scores, np.float64)
        votes = self.votes(prompt_token_ids)
        votes[scores > scores.min() + self.slack] = -np.inf
        work = self.work(len(prompt_token_ids))
        rank = self.scheduler.choose(votes, self.in_flight_work(scores), self.mean_work(pending=work), work)
        self.record(request_id, rank, len(prompt_token_ids), work)
        return rank

    def warm_up(self) -> None:
        """Compile what :meth:`choose` runs (the votes and the balanced choice) on a one-token
        prompt, changing nothing: the first real request then pays no compilation."""
        votes = self.votes([0])
        price = self.scheduler.price.copy()
        try:
            self.scheduler.choose(votes, np.zeros(self.num_ranks), self.work(1), self.work(1))
        finally:
            self.scheduler.price[:] = price

    def record(self, request_id: str, rank: int, prompt_tokens: int, work: float | None = None) -> None:
        """Count request ``request_id`` sent to ``rank`` (``work``: its :meth:`work`, computed if
        not given) and in flight there with its prompt."""
        work = self.work(prompt_tokens) if work is None else work
        self.in_flight[request_id] = [rank, prompt_tokens]  # a reused id: the new request replaces it
        self.total_work += work
        self.requests[rank] += 1
        self.prompt_tokens[rank] += prompt_tokens
        if self.metrics:
            self.metrics[0].labels(dp_rank=str(int(self.ranks[rank]))).inc()
            self.metrics[1].labels(dp_rank=str(int(self.ranks[rank]))).inc(prompt_tokens)
        if self.requests.sum() % 100 == 0:
            logger.info("semmoe DP routing: requests per rank %s, prompt tokens per rank %s",
                        self.requests.tolist(), self.prompt_tokens.tolist())

    def observe(self, outputs, finished) -> None:
        """One batch of engine outputs: ``outputs``, items with ``request_id`` and
        ``new_token_ids`` (vLLM's ``EngineCoreOutput``), add their new tokens to their request's
        in-flight work; ``finished`` (request ids, or ``None``) leave the in-flight set.
        Requests this router did not send are ignored."""
        generated = np.zeros(self.num_ranks, np.int64)
        for output in outputs or ():
            entry = self.in_flight.get(output.request_id)
            if entry is not None and output.new_token_ids:
                entry[1] += len(output.new_token_ids)
                generated[entry[0]] += len(output.new_token_ids)
        left = np.zeros(self.num_ranks, np.int64)
        for request_id in finished or ():
            entry = self.in_flight.pop(request_id, None)
            if entry is not None:
                left[entry[0]] += 1
        if self.metrics:  # one increment per rank and batch, not per request
            for rank in np.nonzero(generated)[0]:
                self.metrics[2].labels(dp_rank=str(int(self.ranks[rank]))).inc(int(generated[rank]))
            for rank in np.nonzero(left)[0]:
                self.metrics[3].labels(dp_rank=str(int(self.ranks[rank]))).inc(int(left[rank]))


def _prometheus_counters():
    """``vllm:semmoe_requests``, ``vllm:semmoe_prompt_tokens``, ``vllm:semmoe_generated_tokens``
    (those the router counted into its requests' in-flight work) and
    ``vllm:semmoe_finished_requests`` (requests minus finished: in flight) per DP rank on /metrics."""
    from .metrics import prometheus_counters

    return prometheus_counters("DP routing", (
        ("vllm:semmoe_requests", "Requests routed by Sem-MoE, per DP rank", ("dp_rank",)),
        ("vllm:semmoe_prompt_tokens", "Prompt tokens routed by Sem-MoE, per DP rank", ("dp_rank",)),
        ("vllm:semmoe_generated_tokens", "Generated tokens of the requests Sem-MoE routed, per DP rank",
         ("dp_rank",)),
        ("vllm:semmoe_finished_requests", "Requests Sem-MoE routed that finished, per DP rank", ("dp_rank",)),
    ))
