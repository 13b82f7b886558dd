"""The TP collectives' byte meter (:class:`~vllm_semmoe.vllm_adapter.ep_dispatch.CollectiveMeter`)
counts every call, eager or inside a compiled graph, and only what a real step sends.

vLLM's CPU build traces the TP communicator into its compiled graph, so a Python counter there
would run once, at tracing, and miss every later step (what bench-serve TP saw before the meter
counted inside graphs). Here a stand-in communicator doubles its input (what a 2-rank
all-reduce of equal inputs gives) and the function calling it is compiled the way vLLM's CPU
build compiles (Dynamo, one graph, dynamic batch size); the meter must count each call's bytes
at the size it ran with."""

from __future__ import annotations

import torch

from vllm_semmoe.vllm_adapter.ep_dispatch import TP_COLLECTIVE_KEYS, CollectiveMeter
from vllm_semmoe.vllm_adapter.state import new_moe_counters


class _Communicator:
    """Two ranks' collectives on one process: enough to be counted (no process group)."""

    device = torch.device("cpu")

    def all_reduce(self, x):
        return x * 2

    def reduce_scatter(self, x, dim=-1):
        return x.chunk(2, dim)[0] * 2

    def reduce_scatterv(self, x, dim=-1, sizes=None):
        return self.all_reduce(x).narrow(dim, 0, sizes[0] if sizes else x.shape[dim] // 2)  # nested: counts once

    def all_gather(self, x, dim=-1):
        return torch.cat([x, x], dim)

    def all_gatherv(self, x, dim=0, sizes=None):
        return torch.cat([x, x], dim)


def _metered():
    comm, counters = _Communicator(), new_moe_counters()
    meter = CollectiveMeter(comm, rank=0, world=2, counters_of=lambda: counters)
    return comm, counters, meter


def test_eager_calls_count_as_they_run():
    comm, counters, meter = _metered()
    x = torch.ones(5, 8, dtype=torch.bfloat16)  # 80 bytes
    assert torch.equal(comm.all_reduce(x), x * 2)  # the collective's result is unchanged
    comm.reduce_scatterv(x, dim=0, sizes=[3, 2])  # all but this rank's 3 rows; the nested all-reduce not
    comm.all_gather(x)
    comm.all_gatherv(x, dim=0, sizes=[5, 4])  # the other rank's 4 rows
    assert counters["allreduce_bytes"] == 80  # ring: 2 (E-1)/E of the tensor
    assert counters["reduce_scatter_bytes"] == 2 * 16
    assert counters["allgather_bytes"] == 80 + 4 * 16
    assert meter.ledger.tolist() == [0, 0, 0]


def test_calls_inside_a_compiled_graph_count_every_run_at_its_size():
    comm, counters, meter = _metered()

    def layer(x):  # what vLLM's traced model does: an all-reduce, then an all-gather
        y = comm.all_reduce(x) + 1
        return comm.all_gather(y)

    compiled = torch.compile(layer, backend="inductor", fullgraph=True, dynamic=True)
    x3 = torch.randn(3, 8)
    compiled(x3)  # traces and runs once: a warm-up, outside a real step
    assert counters["allreduce_bytes"] == 0  # Python ran only while tracing, counted nothing
    expected = dict.fromkeys(TP_COLLECTIVE_KEYS, 0)
    for rows in (3, 7, 1, 64):
        meter.mark()
        x = torch.randn(rows, 8)
        assert torch.allclose(compiled(x), layer(torch.clone(x)))  # eager reference: counts too
        meter.settle(counters)
        expected["allreduce_bytes"] += 2 * rows * 32  # the graph's call and the eager one
        expected["allgather_bytes"] += 2 * rows * 32
    assert {k: counters[k] for k in TP_COLLECTIVE_KEYS} == expected


def test_graph_runs_outside_a_real_step_are_not_counted():
    comm, counters, meter = _metered()
    compiled = torch.compile(lambda x: comm.all_reduce(x), fullgraph=True, dynamic=True)
    compiled(torch.ones(4, 4))
    meter.mark()
    compiled(torch.ones(6, 4))  # the real step
    meter.settle(counters)
    compiled(torch.ones(9, 4))  # a warm-up or profiling run between steps
    meter.mark()
    meter.settle(counters)  # an empty step
    assert counters["allreduce_bytes"] == 6 * 16
