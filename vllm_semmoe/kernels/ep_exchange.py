"""The expert-parallel exchange: dispatch tokens to the ranks holding their experts, combine
the partial sums back, and count the bytes of every tensor handed to the collective.

One definition of the send set, used by every EP path of the project (the TP shuffle in the
vLLM adapter, ``bench-ep``): a token is sent **once** to every *other* rank that holds at least
one of its chosen experts (per-destination deduplication, as DeepEP and vLLM's all2all
managers do); experts on the token's own rank are computed there without communication.
Rows are ordered by destination rank, then by token, so one uneven ``all_to_all_single``
moves them; combine is the same exchange reversed, one partial sum per received row.

Pure ``torch`` / ``torch.distributed``; nothing here imports vLLM. The send set is computed
with tensor ops on the tensors' own device, so on a GPU the only host round trip is the one
the uneven all-to-all itself needs (its split sizes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def send_plan(dest: torch.Tensor, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which rows go where.

    Args:
        dest: ``[n, K]`` integer rank holding each token's chosen experts.
        rank: this rank; ``world``: the EP size.
    Returns:
        ``order [S]`` int64 row indices to send, grouped by destination rank (ascending), rows
        ascending within a destination; ``send_counts [world]`` int64 rows per destination
        (0 for ``rank`` itself).
    """
    n = dest.shape[0]
    present = torch.zeros((n, world), dtype=torch.bool, device=dest.device)
    if n:
        present.scatter_(1, dest.long(), True)
    present[:, rank] = False
    dst, rows = torch.nonzero(present.t(), as_tuple=True)  # row-major over [world, n]: by dst, then row
    counts = torch.bincount(dst, minlength=world)
    return rows.to(torch.int64), counts.to(torch.int64)


@dataclass
class ExchangeCounters:
    """Bytes handed to the collectives, from the tensors' own sizes (this rank's view)."""

    dispatch_bytes: int = 0  # hidden rows sent to other ranks
    combine_bytes: int = 0  # partial sums sent back
    metadata_bytes: int = 0  # split sizes, expert ids, gate weights
    rows_sent: int = 0
    per_dst_dispatch: list = field(default_factory=list)  # [world] bytes of the last dispatch

    def as_dict(self) -> dict:
        return {"dispatch_bytes": self.dispatch_bytes, "combine_bytes": self.combine_bytes,
                "metadata_bytes": self.metadata_bytes, "rows_sent": self.rows_sent}


class EpExchange:
    """Uneven all-to-all over one process group, with byte accounting.

    Usage per MoE layer: ``recv = ex.exchange_counts(send_counts)``; ``x_recv =
    ex.dispatch(x.index_select(0, order), send_counts, recv)``; (metadata with
    ``ex.dispatch(..., metadata=True)``); compute; ``back = ex.combine(partial, send_counts,
    recv)``; ``out.index_add_(0, order, back)``.
    """

    def __init__(self, group=None):
        self.group = group
        self.counters = ExchangeCounters()

    def exchange_counts(self, send_counts: torch.Tensor) -> list[int]:
        """All-to-all of the ``[world]`` split sizes; returns the rows this rank will receive."""
        recv = torch.empty_like(send_counts)
        dist.all_to_all_single(recv, send_counts.contiguous(), group=self.group)
        self.counters.metadata_bytes += (send_counts.numel() - 1) * send_counts.element_size()
        return recv.tolist()

    def dispatch(self, rows: torch.Tensor, send_counts, recv_counts, *, metadata: bool = False) -> torch.Tensor:
        """Send ``rows`` (ordered by destination, ``send_counts`` per rank) and receive
        ``sum(recv_counts)`` rows. ``metadata`` rows count as metadata, not payload."""
        sends = _as_list(send_counts)
        out = _all_to_all(rows, sends, _as_list(recv_counts), self.group)
        nbytes = rows.numel() * rows.element_size()
        if metadata:
            self.counters.metadata_bytes += nbytes
        else:
            self.counters.dispatch_bytes += nbytes
            self.counters.rows_sent += rows.shape[0]
            row = rows[0].numel() * rows.element_size() if rows.shape[0] else 0
            self.counters.per_dst_dispatch = [c * row for c in sends]
        return out

    def combine(self, partial: torch.Tensor, send_counts, recv_counts) -> torch.Tensor:
        """Return one partial sum per received row to its home rank (the dispatch reversed)."""
        out = _all_to_all(partial, _as_list(recv_counts), _as_list(send_counts), self.group)
        self.counters.combine_bytes += partial.numel() * partial.element_size()
        return out


def _as_list(counts) -> list[int]:
    return counts.tolist() if isinstance(counts, torch.Tensor) else [int(c) for c in counts]


def _all_to_all(tensor: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    out = torch.empty((sum(recv_counts), *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    dist.all_to_all_single(out, tensor.contiguous(), recv_counts, send_counts, group=group)
    return out
