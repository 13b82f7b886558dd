"""Expert-parallel dispatch of vLLM's MoE layers, and the engine's count of the bytes it moves.

Under data parallelism with expert parallelism, vLLM's modular MoE kernel moves tokens in its
*prepare/finalize* stage (``FusedMoEPrepareAndFinalize``, the interface DeepEP, pplx and
flashinfer all2allv plug into). On a backend without all-to-all kernels
(``allgather_reducescatter``: the CPU build's, and CUDA vLLM's when no other is chosen) that
stage is ``MoEPrepareAndFinalizeNaiveDPEPModular``: ``prepare`` all-gathers every DP rank's
routed tokens (hidden states, top-k weights and ids) to every rank, the experts of this rank
run on all of them, ``finalize`` reduce-scatters the partial sums back. Every token goes
everywhere, wherever its experts are: a higher local activation rate saves nothing.

The sparse stage (:class:`~.patches.prepare_finalize.SparsePrepareAndFinalize`, a subclass of
that vLLM class) moves tokens with the project's EP exchange
(:mod:`vllm_semmoe.kernels.ep_exchange`): ``prepare`` sends each token once to every other rank
holding one of its experts (uneven all-to-all) and hands the experts this rank's own tokens
followed by the received ones; ``finalize`` returns the received rows' partial sums to their
home rank and adds them to the local ones. The layer's result is the same sum of the same expert
outputs. The metered stage (:class:`~.patches.prepare_finalize.MeteredPrepareAndFinalize`)
counts what vLLM's own stage moves, changing nothing, so stock vLLM is measured by the same
counters. A layer that moves its tokens any other way (an all-to-all backend's stage such as
DeepEP's, vLLM's MoE runner all-gathering the tokens itself for a kernel without a
prepare/finalize stage, a monolithic kernel) is left as it is and is *unmetered*: its bytes are
not counted, which the engine reports (a warning at start,
``vllm:semmoe_unmetered_moe_layers_total``, the live counters, ``bench-serve``'s JSON and
``semmoe serve``'s exit status; :func:`unmetered_reason`), so that no figure reads as 0 bytes.

Counted per rank, from the tensors handed to the collectives ("bytes this rank sends to
other ranks"), in the engine's :class:`~.state.EngineState` counters:

- ``dispatch_bytes``: hidden-state rows (all-gather: this rank's rows once per other rank;
  sparse: each row once per other rank holding one of its experts);
- ``combine_bytes``: partial sums (reduce-scatter: the rows of the other ranks' tokens;
  sparse: one per received row);
- ``metadata_bytes``: top-k weights and ids (and activation scales), split sizes;
- ``allreduce_bytes``, ``reduce_scatter_bytes``, ``allgather_bytes``: the tensor-parallel
  group's collectives (:class:`CollectiveMeter`; vLLM's all-reduces, the TP shuffle's
  reduce-scatter and all-gathers), as the bytes a rank sends under ring algorithms: all-reduce
  ``2 (E-1)/E`` of the tensor, reduce-scatter ``(E-1)/E`` of its input (uneven: all but its own
  rows), all-gather ``E-1`` times its input (uneven: the other ranks' rows).

:func:`routed_exchange` is the same exchange around ``RoutedExperts.forward_modular`` (the
TP shuffle's, where no DP dispatch stage exists).
"""

from __future__ import annotations

import logging
import time

import torch

from ..kernels.ep_exchange import EpExchange, send_plan

logger = logging.getLogger("vllm.semmoe")

#: the byte counters, per engine (``<op>_bytes``: the ``op`` label of the exported metric)
BYTE_KEYS = ("dispatch_bytes", "combine_bytes", "metadata_bytes", "allreduce_bytes", "reduce_scatter_bytes",
             "allgather_bytes")
#: the exchange's own counters (:class:`~vllm_semmoe.kernels.ep_exchange.ExchangeCounters`)
EXCHANGE_KEYS = ("dispatch_bytes", "combine_bytes", "metadata_bytes")


def routed_exchange(forward_modular, x_my: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, group,
                    counters: dict, shared_experts=None, shared_experts_input=None) -> torch.Tensor:
    """Routed-expert output rows of this rank's tokens ``x_my`` ``[m, H]`` (physical ``ids``
    ``[m, K]``, gate ``weights`` ``[m, K]``), over the EP ``group``.

    Local activations are computed here; each token is sent once to every other rank holding
    one of its experts (:func:`vllm_semmoe.kernels.ep_exchange.send_plan`, uneven all-to-all),
    computed there, and the partial sums are sent back and added. ``forward_modular`` is
    vLLM's ``RoutedExperts.forward_modular`` of this layer (this rank's experts; rows whose
    experts are elsewhere contribute zero). Every rank of ``group`` must call this once per
    MoE layer (the all-to-alls pair up), also with ``m == 0``.
    """
    rank, world = group.rank_in_group, group.world_size
    experts = forward_modular.__self__
    n_local = int(experts.global_num_experts) // world
    device = x_my.device
    dest = ids.long() // n_local  # [m, K] rank holding each chosen expert
    order, send_counts = send_plan(dest, rank, world)
    xchg = EpExchange(comm_for(group, device))
    start = time.perf_counter()
    sends = send_counts.tolist()  # the split sizes: the one host round trip the all-to-all needs
    counters["host_sync_s"] += time.perf_counter() - start
    recvs = xchg.exchange_counts(send_counts)
    recv_x = xchg.dispatch(x_my.index_select(0, order), sends, recvs)
    recv_ids = xchg.dispatch(ids.index_select(0, order).to(torch.int64), sends, recvs, metadata=True)
    recv_w = xchg.dispatch(weights.index_select(0, order).float(), sends, recvs, metadata=True)

    # this rank's experts for its own tokens and for the rows it received
    local_out = forward_modular(x_my, weights, ids, shared_experts, shared_experts_input)
    remote_out = forward_modular(recv_x, recv_w.to(weights.dtype), recv_ids.to(ids.dtype)) \
        if recv_x.shape[0] else recv_x
    back = xchg.combine(remote_out, sends, recvs)  # combine: partial sums home
    out_my = local_out.index_add(0, order, back) if order.numel() else local_out

    local = int((dest == rank).sum())
    counters["dispatch_bytes"] += xchg.counters.dispatch_bytes
    counters["combine_bytes"] += xchg.counters.combine_bytes
    counters["metadata_bytes"] += xchg.counters.metadata_bytes
    counters["local_activations"] += local
    counters["remote_activations"] += dest.numel() - local
    counters["tokens"] += x_my.shape[0]
    counters["layers_run"] += 1
    return out_my


def comm_for(group, device: torch.device):
    """NCCL (the device group) for accelerator tensors, gloo (the CPU group) for CPU tensors."""
    return group.cpu_group if device.type == "cpu" else group.device_group


def unmetered_reason(layer: str, stage: str | None, *, runner_all_gathers: bool = False, monolithic: bool = False,
                     sparse: bool = False) -> str:
    """Why MoE layer ``layer``'s token exchange is not metered: its prepare/finalize stage is
    ``stage`` (a class name; ``None``: it has none), not vLLM's all-gather stage the meter and
    the sparse dispatch replace."""
    if monolithic:
        how = "runs a monolithic kernel (routing and token exchange inside one kernel)"
    elif stage is None:
        how = "has no prepare/finalize stage" + (
            "; vLLM's MoE runner all-gathers every token to every rank itself" if runner_all_gathers else "")
    else:
        how = f"moves tokens with {stage}, not vLLM's all-gather stage"
    return (f"MoE layer {layer} {how}: semmoe does not meter it, so the MoE bytes of this engine are not counted "
            f"(reported as unmetered){'; the sparse dispatch is not installed there either' if sparse else ''}")


def report_unmetered(reason: str, *, dp_rank: int, failures: dict[str, str]) -> None:
    """Report a MoE layer of the engine of DP rank ``dp_rank`` unmetered: a warning (once per
    engine), the engine's ``failures``, ``/metrics``, ``semmoe serve``'s exit status
    (:func:`.metrics.report_failure`)."""
    from .metrics import report_failure

    if "unmetered" not in failures:
        logger.warning("semmoe: %s", reason)
    report_failure("unmetered", dp_rank, reason, failures)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


#: the tensor-parallel collectives :class:`CollectiveMeter` counts, in its ledger's order
TP_COLLECTIVE_KEYS = ("allreduce_bytes", "reduce_scatter_bytes", "allgather_bytes")


class CollectiveMeter:
    """Counts the bytes of one group's device communicator's (this process) all-reduce,
    reduce-scatter(v) and all-gather(v) calls, changing nothing they do. Nested calls (one
    collective implemented with another) count once.

    A call made in Python adds to ``counters_of()`` as it runs. A call that is part of a
    compiled graph runs no Python when the graph runs: on CPU vLLM traces the communicator
    into its graph (Dynamo), on CUDA its collectives' op is replayed by CUDA graphs. Such a call
    adds its bytes to :attr:`ledger` with a tensor op the graph keeps and replays, computed
    from the traced tensor's symbolic size, so every run of the graph counts what it sends;
    :meth:`mark` and :meth:`settle` move what the ledger gained over a real step into the
    counters (graphs also run in warm-up and profiling, which count nothing).

    Attributes:
        ledger: ``[3]`` int64 on the communicator's device: bytes × ``world`` per
            :data:`TP_COLLECTIVE_KEYS`, as counted inside graphs since the start.
        marked: ``[3]`` the ledger's values at the last :meth:`mark`.
    """

    def __init__(self, communicator, rank: int, world: int, counters_of) -> None:
        self.rank, self.world, self.counters_of = rank, world, counters_of
        self.ledger = torch.zeros(len(TP_COLLECTIVE_KEYS), dtype=torch.int64,
                                  device=getattr(communicator, "device", None) or "cpu")
        self.marked = [0] * len(TP_COLLECTIVE_KEYS)
        self._depth = [0]
        for name, volume in (("all_reduce", self._all_reduce), ("reduce_scatter", self._reduce_scatter),
                             ("reduce_scatterv", self._reduce_scatterv), ("all_gather", self._all_gather),
                             ("all_gatherv", self._all_gatherv)):
            setattr(communicator, name, self._counted(getattr(communicator, name), volume))

    def _counted(self, original, volume):
        depth, ledger, world = self._depth, self.ledger, self.world

        def call(input_, *args, **kwargs):
            if depth[0] == 0:
                key, scaled = volume(input_, *args, **kwargs)  # bytes × world
                if torch.compiler.is_compiling() or (getattr(input_, "is_cuda", False)
                                                     and torch.cuda.is_current_stream_capturing()):
                    ledger[TP_COLLECTIVE_KEYS.index(key)].add_(scaled)
                else:
                    self.counters_of()[key] += int(scaled) // world
            depth[0] += 1
            try:
                return original(input_, *args, **kwargs)
            finally:
                depth[0] -= 1

        return call

    def mark(self) -> None:
        """Note the ledger's values (at the start of a real step; one device-to-host copy)."""
        self.marked = self.ledger.tolist()

    def settle(self, counters: dict) -> None:
        """Add what the ledger gained since :meth:`mark` to ``counters`` (at the step's end)."""
        now = self.ledger.tolist()
        for key, before, after in zip(TP_COLLECTIVE_KEYS, self.marked, now):
            counters[key] += (after - before) // self.world
        self.marked = now

    # volumes, as bytes × world (exact integers, symbolic inside a traced graph)
    def _all_reduce(self, x, *args, **kwargs):
        return "allreduce_bytes", 2 * (self.world - 1) * _nbytes_any(x)

    def _reduce_scatter(self, x, *args, **kwargs):
        return "reduce_scatter_bytes", (self.world - 1) * _nbytes_any(x)

    def _reduce_scatterv(self, x, dim=-1, sizes=None, *args, **kwargs):
        if not sizes:
            return self._reduce_scatter(x)
        return "reduce_scatter_bytes", self._other_ranks_rows(x, dim, sizes)

    def _all_gather(self, x, *args, **kwargs):
        return "allgather_bytes", self.world * (self.world - 1) * _nbytes_any(x)

    def _all_gatherv(self, x, dim=0, sizes=None, *args, **kwargs):
        if not sizes:
            return self._all_gather(x)
        return "allgather_bytes", self._other_ranks_rows(x, dim, sizes)

    def _other_ranks_rows(self, x, dim: int, sizes) -> int:
        """A v-collective's volume × ``world``: the rows along ``dim`` of every rank but this one
        (``sizes[r]`` rows on rank ``r``)."""
        return self.world * _row_bytes_any(x, dim) * (sum(sizes) - sizes[self.rank])


def _nbytes_any(t) -> int:
    """Bytes of a tensor or a list of tensors."""
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return _nbytes(t)


def _row_bytes_any(t, dim: int) -> int:
    """Bytes of one slice along ``dim`` of a tensor (summed over a list of tensors)."""
    if isinstance(t, (list, tuple)):
        return sum(_row_bytes_any(x, dim) for x in t)
    shape = list(t.shape)
    shape.pop(dim)
    size = 1
    for extent in shape:
        size *= extent
    return size * t.element_size()
