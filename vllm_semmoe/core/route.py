"""Sem-MoE's data-parallel rank choice for a router outside vLLM (no vLLM needed).

Where vLLM's own DP load balancer does not see every rank (external load balancing: one API
server per rank, a router in front), the router can still send each request to the rank that
holds most of its experts: :func:`rank_dp_ranks` scores every DP rank for a prompt's token ids
with the tables of ``semmoe solve --mode dp`` and returns the ranks best first; the router
pins the request there with vLLM's ``X-data-parallel-rank`` header (or sends it to that rank's
API server). ``semmoe route`` is the same on the command line.

The score is the value the engine's router maximises (:meth:`.schedulers.DpScheduler.values`,
the scheduler :class:`.vllm_adapter.dp_routing.DpRouter` chooses with): the prompt's T2D votes on
the rank (predicted local expert activations, :func:`dp_rank_votes`) less a price on the rank's
in-flight work above the least-loaded rank's. With no load given (or equal loads) the ranking
is by votes alone, and its first rank is what the engine's router picks for the same request
before it has routed anything.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from . import scheduling
from .schedulers import DpScheduler
from .tables import SemMoETables


@dataclass(frozen=True)
class RankScore:
    """One DP rank's standing for a request."""

    rank: int
    score: float  # what the rule maximises: votes less the load price
    votes: float  # predicted local expert activations of the prompt on this rank (top-k units)
    load: float  # the in-flight work the score was given for this rank (tokens)

    def as_dict(self) -> dict:
        return asdict(self)


def dp_ranks_of(tables: SemMoETables, num_ranks: int | None = None) -> tuple[int, int]:
    """``(DP ranks, EP devices per DP rank)``: the tables' EP devices split evenly over
    ``num_ranks`` DP ranks (default: one device per rank, TP 1); DP rank ``r`` owns devices
    ``r * per_rank ..``."""
    scheduler = DpScheduler(tables, num_ranks)
    return scheduler.num_ranks, scheduler.ranks_per_dp


def dp_rank_votes(tables: SemMoETables, token_ids, num_ranks: int | None = None) -> np.ndarray:
    """``[num_ranks]`` float64 T2D votes of a prompt on each DP rank: its predicted local expert
    activations there (:meth:`.schedulers.DpScheduler.votes`).

    Args:
        token_ids: the prompt's token ids, as the engine tokenizes it.
        num_ranks: DP ranks (default: the tables' EP size, TP 1).
    """
    return DpScheduler(tables, num_ranks).votes(token_ids)


def rank_dp_ranks(tables: SemMoETables, token_ids, *, num_ranks: int | None = None, loads=None,
                  mean_work: float | None = None, balance: float = scheduling.DEFAULT_DP_BALANCE,
                  decode_weight: float = scheduling.DEFAULT_DECODE_WEIGHT, price=None) -> list[RankScore]:
    """Every DP rank for one request, best first, with its score (ties: the lower rank first).

    Args:
        tables: ``semmoe solve --mode dp`` tables (:func:`.tables.load_tables`).
        token_ids: the prompt's token ids.
        num_ranks: DP ranks (default: the tables' EP size, TP 1).
        loads: ``[num_ranks]`` in-flight work per rank, in tokens (prompt plus tokens generated
            so far of the requests running or waiting there; what the engine's router counts);
            default: none anywhere.
        mean_work: the mean work of a request (prompt tokens plus ``decode_weight``), which
            scales the load price; default: this request's own work (what the engine's router
            uses before it has routed any request).
        balance, decode_weight: the engine's ``dp_balance`` and ``dp_decode_weight`` settings.
        price: ``[num_ranks]`` per-rank prices of :func:`.scheduling.dp_choose_balanced`, for a
            caller that keeps them; default: zeros (read only here).
    Returns:
        ``num_ranks`` :class:`RankScore`, highest score first; the first is the rank the
        engine's rule chooses for these inputs.
    """
    scheduler = DpScheduler(tables, num_ranks, balance=balance, decode_weight=decode_weight)
    votes = scheduler.votes(token_ids)
    num_ranks = scheduler.num_ranks
    load = np.zeros(num_ranks) if loads is None else np.asarray(loads, np.float64).reshape(-1)
    if load.shape != (num_ranks,) or not np.all(np.isfinite(load)) or np.any(load < 0):
        raise ValueError(f"loads must be {num_ranks} non-negative numbers (one per DP rank), got {loads!r}")
    price = np.zeros(num_ranks) if price is None else np.asarray(price, np.float64).reshape(-1)
    if price.shape != (num_ranks,):
        raise ValueError(f"price must be {num_ranks} numbers (one per DP rank), got {price.shape[0]}")
    work = scheduler.work(len(np.asarray(token_ids).reshape(-1)))
    mean_work = work if mean_work is None else float(mean_work)
    if not mean_work > 0:
        raise ValueError(f"mean_work must be positive, got {mean_work}")
    score = scheduler.values(votes, load, mean_work, work, price)
    order = np.argsort(-score, kind="stable")
    return [RankScore(int(r), float(score[r]), float(votes[r]), float(load[r])) for r in order]
