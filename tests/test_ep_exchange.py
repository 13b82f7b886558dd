"""The one EP send set and exchange: brute force, property-based, and over real gloo ranks."""

import os
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_semmoe.kernels.ep_exchange import EpExchange, send_plan


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(0, 30), st.data())
def test_send_plan_is_each_token_once_to_every_other_rank_holding_one_of_its_experts(world, k, n, data):
    rank = data.draw(st.integers(0, world - 1))
    dest = np.array(data.draw(st.lists(st.lists(st.integers(0, world - 1), min_size=k, max_size=k),
                                       min_size=n, max_size=n)), dtype=np.int64).reshape(n, k)
    order, counts = send_plan(torch.from_numpy(dest), rank, world)
    want = [(d, t) for d in range(world) if d != rank for t in range(n) if (dest[t] == d).any()]
    assert order.tolist() == [t for _, t in want]
    assert counts.tolist() == [sum(1 for d2, _ in want if d2 == d) for d in range(world)]
    assert counts[rank] == 0


def _worker(rank, world, path, out):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(rank)
        n, K, H = 7 + rank, 2, 5
        dest = torch.randint(0, world, (n, K), generator=g)
        x = torch.randn(n, H, generator=g)
        order, counts = send_plan(dest, rank, world)
        xchg = EpExchange()
        recv = xchg.exchange_counts(counts)
        x_recv = xchg.dispatch(x.index_select(0, order), counts, recv)
        back = xchg.combine(x_recv * 2, counts, recv)  # "experts": double what arrived
        result = torch.zeros(n, H).index_add_(0, order, back)
        # every row came back doubled once per remote destination it was sent to
        remote = torch.tensor([len(set(d.tolist()) - {rank}) for d in dest], dtype=torch.float32)
        ok = torch.allclose(result, x * 2 * remote[:, None])
        ok &= xchg.counters.dispatch_bytes == int(counts.sum()) * H * 4
        ok &= xchg.counters.combine_bytes == sum(recv) * H * 4
        out[rank] = int(ok)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [3])
def test_dispatch_and_combine_round_trip_over_gloo(world):
    with tempfile.TemporaryDirectory() as tmp:
        out = mp.get_context("spawn").Array("i", world)
        mp.start_processes(_worker, args=(world, os.path.join(tmp, "rdzv"), out), nprocs=world,
                           start_method="spawn", join=True)
        assert list(out) == [1] * world
