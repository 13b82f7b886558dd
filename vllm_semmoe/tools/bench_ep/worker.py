"""One EP rank (a spawned process): its experts, its tokens' inputs, and one EP MoE layer per
step — dispatch, experts, combine through :class:`~vllm_semmoe.kernels.ep_exchange.EpExchange` — with
per-phase timings and byte counts, and a single-process reference for the first batch."""

from __future__ import annotations

import math
import os
import time
from datetime import timedelta

import numpy as np

POOL_ROWS = 4096  # distinct random hidden rows; token (t, layer) uses row (31 t + 7 layer) mod POOL_ROWS


def _expert_weights(layer, expert, hidden, expert_dim, seed, dtype, device):
    """Deterministic down/up weights of logical expert ``(layer, expert)``."""
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + layer * 4099 + expert + 1)
    w1 = torch.randn(hidden, expert_dim, generator=g) / math.sqrt(hidden)
    w2 = torch.randn(expert_dim, hidden, generator=g) / math.sqrt(expert_dim)
    return w1.to(device=device, dtype=dtype), w2.to(device=device, dtype=dtype)


def _expert(x, w1, w2):
    import torch

    return torch.nn.functional.silu(x @ w1) @ w2


def rank_main(rank, world, workdir, cfg, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if cfg["backend"] == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # all ranks are on this host
    device = torch.device(f"cuda:{rank}") if cfg["backend"] == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(cfg["backend"], init_method=f"file://{os.path.join(workdir, 'rendezvous')}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=cfg["timeout_s"]), **kwargs)
    try:
        _run_rank(rank, world, workdir, cfg, queue, device)
        dist.barrier()
    finally:
        dist.destroy_process_group()


class _Rank:
    """Per-rank state: the pools, the expert weights it holds and the process group."""

    def __init__(self, rank, world, cfg, device):
        import torch

        self.rank, self.world, self.cfg, self.device = rank, world, cfg, device
        self.dtype = getattr(torch, cfg["dtype"])  # rows on the wire
        # experts compute in dtype on GPUs; on CPUs in float32: many have no fast bfloat16 GEMM
        # (30x slower than float32 on this project's x86 VMs), which would swamp the exchange
        self.compute_dtype = self.dtype if device.type == "cuda" else torch.float32
        self.hidden, self.expert_dim, self.seed = cfg["hidden"], cfg["expert_dim"], cfg["seed"]
        g = torch.Generator().manual_seed(self.seed * 7919 + 17)
        self.pool = torch.randn(POOL_ROWS, self.hidden, generator=g).to(device=device, dtype=self.dtype)
        self.gate_pool = None
        self.weights = {}  # (layer, expert) -> (w1, w2)
        self.cuda = device.type == "cuda"

    def gate(self, gid, layer, k):
        """``[n, k]`` float32 gate weights of tokens ``gid`` at ``layer`` (normalised, ≥ 0.5/1.5k)."""
        if self.gate_pool is None or self.gate_pool.shape[1] != k:
            rng = np.random.default_rng(self.seed * 7919 + 29)
            u = rng.uniform(0.5, 1.5, size=(POOL_ROWS, k))
            self.gate_pool = (u / u.sum(axis=1, keepdims=True)).astype(np.float32)
        return self.gate_pool[(gid * 17 + layer * 5) % POOL_ROWS]

    def inputs(self, gid, layer):
        import torch

        idx = torch.from_numpy((gid * 31 + layer * 7) % POOL_ROWS).to(self.device)
        return self.pool.index_select(0, idx)

    def expert(self, layer, expert):
        key = (layer, int(expert))
        if key not in self.weights:
            self.weights[key] = _expert_weights(layer, int(expert), self.hidden, self.expert_dim, self.seed,
                                                self.compute_dtype, self.device)
        return self.weights[key]

    def sync(self):
        import torch

        if self.cuda:
            torch.cuda.synchronize(self.device)

    def barrier(self):
        import torch.distributed as dist

        if self.cuda:
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def layer(self, gid, ex, ed, held_l, layer):
        """One EP MoE layer for this rank's tokens.

        ex: ``[n, K]`` their experts; ed: ``[n, K]`` the rank computing each activation;
        held_l: ``[N, E]`` bool, which rank holds a copy of which expert at this layer.
        Returns (output fp32 [n, H], counts, times)."""
        import torch

        from ...kernels.ep_exchange import EpExchange, send_plan

        E, r, dev = self.world, self.rank, self.device
        n, K = ex.shape
        g = self.gate(gid, layer, K)
        # ---- plan (routing bookkeeping, outside the timed region) ----
        send_idx_t, counts_t = send_plan(torch.from_numpy(ed).to(dev), r, E)
        send_idx = send_idx_t.cpu().numpy()
        send_counts = counts_t.tolist()
        dst_of_row = np.repeat(np.arange(E), send_counts)
        on_dst = ed[send_idx] == dst_of_row[:, None]
        meta = np.concatenate([np.where(on_dst, ex[send_idx], -1), np.where(on_dst, g[send_idx], 0.0)],
                              axis=1).astype(np.float32)
        local = ed == r
        my_experts = np.nonzero(held_l[:, r])[0]  # home experts and replicas
        weights = [self.expert(layer, e) for e in my_experts]
        x = self.inputs(gid, layer)
        meta_t = torch.from_numpy(meta).to(dev)
        local_ids = torch.from_numpy(np.where(local, ex, -1).astype(np.int64)).to(dev)
        local_w = torch.from_numpy(np.where(local, g, 0.0).astype(np.float32)).to(dev)
        my_experts_t = torch.from_numpy(my_experts.astype(np.int64)).to(dev)
        xchg = EpExchange(group=None)
        self.barrier()
        self.sync()
        t0 = time.perf_counter()
        # ---- dispatch ----
        recv_counts = xchg.exchange_counts(counts_t)
        meta_recv = xchg.dispatch(meta_t, send_counts, recv_counts, metadata=True)
        x_send = x.index_select(0, send_idx_t)
        x_recv = xchg.dispatch(x_send, send_counts, recv_counts)
        R = int(sum(recv_counts))
        self.sync()
        t1 = time.perf_counter()
        # ---- experts: own tokens' local experts + received rows ----
        xs = torch.cat([x, x_recv])
        ids = torch.cat([local_ids, meta_recv[:, :K].to(torch.int64)])
        gw = torch.cat([local_w, meta_recv[:, K:]])
        out = torch.zeros(n + R, self.hidden, dtype=torch.float32, device=dev)
        flat = ids.reshape(-1)  # every id >= 0 here is one of this rank's experts
        pos = torch.nonzero(flat >= 0).squeeze(1)
        order = pos[torch.argsort(flat[pos], stable=True)]  # (row, slot) pairs grouped by expert
        bounds = torch.searchsorted(flat[order], my_experts_t, right=True).tolist()
        rows = order // K
        xa = xs.index_select(0, rows).to(self.compute_dtype)
        ys, a = [], 0
        for b, (w1, w2) in zip(bounds, weights):
            if b > a:
                ys.append(_expert(xa[a:b], w1, w2))
            a = b
        if ys:
            y = torch.cat(ys).float() * gw.reshape(-1)[order].unsqueeze(1)
            out.index_add_(0, rows, y)
        self.sync()
        t2 = time.perf_counter()
        # ---- combine: one partial sum back per received row ----
        back = xchg.combine(out[n:].to(self.dtype), send_counts, recv_counts)
        result = out[:n]
        result.index_add_(0, send_idx_t, back.float())
        self.sync()
        t3 = time.perf_counter()
        elem = x_send.element_size()
        counts = {
            "disp_sent": np.asarray(send_counts, np.int64) * self.hidden * elem,
            "disp_recv": np.asarray(recv_counts, np.int64) * self.hidden * elem,
            "comb_sent": np.asarray(recv_counts, np.int64) * self.hidden * back.element_size(),
            "comb_recv": np.asarray(send_counts, np.int64) * self.hidden * back.element_size(),
            "local": int(local.sum()),
            "activations": int(ed.size),
            "remote_pairs": int(sum(send_counts)),
            "meta_bytes": xchg.counters.metadata_bytes,
        }
        # the exchange's own byte count (from the tensors it moved) agrees with the split sizes
        assert xchg.counters.dispatch_bytes == counts["disp_sent"].sum()
        assert xchg.counters.combine_bytes == counts["comb_sent"].sum()
        assert x_recv.numel() * elem == counts["disp_recv"].sum()
        return result, counts, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)

    def reference(self, gid, ex, layer):
        """Single-process fp32 reference: Σ_k g_k · expert_k(x), every expert computed here."""
        import torch

        x = self.inputs(gid, layer).float()
        g = torch.from_numpy(self.gate(gid, layer, ex.shape[1])).to(self.device)
        ref = torch.zeros(len(gid), self.hidden, dtype=torch.float32, device=self.device)
        for e in np.unique(ex):
            w1, w2 = self.expert(layer, e)  # the same deterministic weights the holder of e uses
            rows, slot = np.nonzero(ex == e)
            rows_t = torch.from_numpy(rows).to(self.device)
            y = _expert(x[rows_t], w1.float(), w2.float())
            ref.index_add_(0, rows_t, y * g[rows_t, torch.from_numpy(slot).to(self.device)].unsqueeze(1))
        return ref


def _run_rank(rank, world, workdir, cfg, queue, device):
    import torch

    with np.load(os.path.join(workdir, "plan.npz")) as data:
        plan = {k: data[k] for k in data.files}
    experts, token_gid = plan["experts"].astype(np.int64), plan["token_gid"].astype(np.int64)
    L, E = experts.shape[1], world
    me = _Rank(rank, world, cfg, device)
    methods = cfg["methods"]
    steps = cfg["steps"]
    total_steps = max(steps.values())
    res = {}
    for i in range(len(methods)):
        res[f"disp_sent_{i}"] = np.zeros((L, E), np.int64)
        res[f"disp_recv_{i}"] = np.zeros((L, E), np.int64)
        res[f"comb_sent_{i}"] = np.zeros((L, E), np.int64)
        res[f"comb_recv_{i}"] = np.zeros((L, E), np.int64)
        res[f"disp_recv_steps_{i}"] = np.zeros((total_steps, L, E), np.int64)  # per step, from each source
        res[f"times_{i}"] = np.full((total_steps, L, 4), np.nan)
        res[f"stats_{i}"] = np.zeros(5, np.int64)  # local, activations, remote_pairs, tokens, meta_bytes
        res[f"check_{i}"] = np.zeros(1)

    def mine(i, s, layer):
        rows, off, dev = plan[f"rows_{i}"], plan[f"off_{i}"], plan[f"dev_{i}"]
        sel = np.arange(off[s], off[s + 1])
        sel = sel[dev[sel, layer] == rank]
        return token_gid[rows[sel]], experts[rows[sel], layer], plan[f"serve_{i}"][sel, layer].astype(np.int64)

    # correctness check on the first batch (also warms up connections and allocators); not counted
    check_layers = sorted({0, L - 1})
    for i, m in enumerate(methods):
        if steps[m] == 0:
            continue
        for layer in check_layers:
            gid, ex, ed = mine(i, 0, layer)
            out, _, _ = me.layer(gid, ex, ed, plan[f"holds_{i}"][layer], layer)
            if len(gid):
                ref = me.reference(gid, ex, layer)
                err = (torch.linalg.vector_norm(out - ref, dim=1) / torch.linalg.vector_norm(ref, dim=1).clamp_min(1e-12))
                res[f"check_{i}"][0] = max(res[f"check_{i}"][0], float(err.max()))
    holds = [plan[f"holds_{i}"] for i in range(len(methods))]
    held = {(layer, int(e)) for h in holds for layer in range(L) for e in np.nonzero(h[layer, :, rank])[0]}
    me.weights = {k: v for k, v in me.weights.items() if k in held}  # drop the reference's other experts
    start = time.perf_counter()
    for s in range(total_steps):
        for layer in range(L):  # methods interleaved layer by layer: machine-load drift hits all alike
            for i, m in enumerate(methods):
                if s >= steps[m]:
                    continue
                gid, ex, ed = mine(i, s, layer)
                _, c, t = me.layer(gid, ex, ed, holds[i][layer], layer)
                for key in ("disp_sent", "disp_recv", "comb_sent", "comb_recv"):
                    res[f"{key}_{i}"][layer] += c[key]
                res[f"disp_recv_steps_{i}"][s, layer] = c["disp_recv"]
                res[f"stats_{i}"] += (c["local"], c["activations"], c["remote_pairs"], 0, c["meta_bytes"])
                if layer == 0:
                    res[f"stats_{i}"][3] += len(gid)
                res[f"times_{i}"][s, layer] = t
        if rank == 0 and queue is not None:
            elapsed = time.perf_counter() - start
            queue.put((s + 1, total_steps, f"batches ({elapsed:.0f} s)"))
    np.savez(os.path.join(workdir, f"result_{rank}.npz"), **res)
