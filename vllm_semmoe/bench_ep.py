"""Expert-parallel MoE-layer benchmark over ``torch.distributed``, replaying real routing.

``semmoe eval`` *counts* remote activations offline. This module *moves* them: it spawns one
process per EP rank, gives every rank its ``N/E`` experts of every MoE layer (a small real
down/up MLP each), places tokens on ranks exactly as :mod:`.evaluate` schedules them, and runs
each MoE layer as a standard EP layer would:

1. **dispatch** — every token is sent once to every *remote* rank that holds at least one of
   its top-k experts (per-destination deduplication, as in DeepEP / vLLM's all2all
   managers); experts on the token's own rank are computed there without communication. The
   per-destination row counts are exchanged first (``all_to_all_single`` of int64), then the
   routing metadata of the sent rows (expert ids and gate weights), then the hidden rows
   themselves (``all_to_all_single`` with uneven ``input_split_sizes``/``output_split_sizes``);
2. **experts** — each rank applies its local experts to its own tokens and to the rows it
   received, weighting every output by the token's gate weight;
3. **combine** — for every row it received, a rank returns one partial sum (the weighted sum
   of its experts' outputs for that token) through the reverse ``all_to_all_single``; the
   token's home rank adds the partial sums to its local result.

What is reported, per method (placement + its data scheduling):

- bytes of hidden-state rows actually handed to ``all_to_all_single`` for other ranks,
  dispatch and combine (``element_size × rows × hidden``), per layer and as ``[src, dst]``
  matrices, as sent and as received (they must agree: conservation); the count exchange and
  the routing metadata are counted apart (``metadata_bytes``), not in the headline;
- the same counts derived analytically from the routing (``analytic_match``), so that the
  measured volume is shown to be exactly what the routing implies;
- ``lar`` (local (token, expert) activations / all) and ``remote_pairs`` (the number of
  (token, layer, remote rank) pairs, i.e. rows dispatched), plus the per-activation remote
  share relative to vanilla (``activation_ratio_vs_vanilla``) beside the deduplicated byte
  ratio (``bytes_ratio_vs_vanilla``, the headline);
- wall time per layer: after a barrier, each rank times dispatch + experts + combine; a
  layer's time is the slowest rank's, averaged over batches and layers (``layer_ms``).

Data scheduling follows :mod:`.evaluate` (its ``_tp_devices`` / ``_dp_ranks`` are called):

- **TP** — batches of ``batch_tokens`` consecutive evaluation tokens; ``semmoe`` places each
  token per layer with Sem-MoE's TP scheduler and its tables, baselines use the
  reduce-scatter's contiguous equal slices (token ``i`` → rank ``i // ceil(B/E)``).
- **DP** — each request stays on one rank for all layers (``semmoe``: T2D votes +
  ``dp_assign``; baselines: round-robin by request). DP ranks run lock-stepped, each with a
  step budget of ``ceil(batch_tokens / E)`` tokens taken from its own queue of requests (in
  arrival order), so one benchmark batch is ``batch_tokens`` tokens over all ranks.

Hidden states are random but deterministic per (token, layer) (rows of a seeded pool), as
are the gate weights and every expert's weights (seeded by layer and logical expert id), so
that on the first batch of every method each rank checks its combined output against a
single-process reference computed from all experts (``check_max_rel_err``).

Nothing here imports vLLM. Heavy imports (policies, Numba) happen in the parent only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np

from .cost_model import step_counts

DEFAULT_METHODS = ("vanilla", "eplb", "semmoe")
POOL_ROWS = 4096  # distinct random hidden rows; token (t, layer) uses row (31 t + 7 layer) mod POOL_ROWS
CHECK_TOL = 0.05  # per-token relative L2 error allowed against the fp32 reference (bf16 wire/compute)
_PHASES = ("dispatch", "expert", "combine", "total")


class BenchEPError(RuntimeError):
    """The benchmark could not run or its self-checks failed; the message says which."""


# ---- planning (parent process) -------------------------------------------------------------
@dataclass
class BenchPlan:
    """What every rank replays: the tokens of every batch and the rank of each per layer.

    Attributes:
        mode, ranks: serving mode and EP size.
        experts: ``[M, L, K]`` routed expert ids of every token used by any method.
        token_gid: ``[M]`` index of each of those tokens in the evaluation trace (seeds its
            hidden state and gate weights).
        methods: method names, in run order.
        expert_device: method → ``[L, N]`` placement.
        step_rows: method → ``(rows [P], offsets [S+1])``: rows of ``experts`` in batch ``s``.
        step_device: method → ``[P, L]`` int16 rank of each batch row per layer.
        eval_tokens, profile_tokens: sizes of the split.
        solve_s: method → seconds to solve its placement.
    """

    mode: str
    ranks: int
    experts: np.ndarray
    token_gid: np.ndarray
    methods: list
    expert_device: dict = field(default_factory=dict)
    step_rows: dict = field(default_factory=dict)
    step_device: dict = field(default_factory=dict)
    eval_tokens: int = 0
    profile_tokens: int = 0
    solve_s: dict = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return self.experts.shape[1]

    @property
    def top_k(self) -> int:
        return self.experts.shape[2]

    def num_steps(self, method: str) -> int:
        return len(self.step_rows[method][1]) - 1


def _as_trace(trace):
    from .trace import RoutingTrace, load_trace

    return trace if isinstance(trace, RoutingTrace) else load_trace(trace)


def _first_layers(trace, layers):
    from .trace import RoutingTrace

    if layers is None or layers >= trace.num_layers:
        return trace
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    return RoutingTrace.from_arrays(
        trace.tokens, trace.experts[:, :layers], trace.offsets, vocab=trace.vocab,
        vocab_size=trace.vocab_size, num_experts=trace.num_experts, request_ids=trace.request_ids,
        is_decode=trace.is_decode,
    )


def plan_bench_ep(trace, ranks: int, mode: str, methods, *, layers: int | None = None,
                  batch_tokens: int = 512, max_batches: int | None = None, profile_frac: float = 0.2,
                  seed: int = 0, progress=None) -> BenchPlan:
    """Solve every method on the profile part of ``trace`` and schedule the rest.

    ``trace`` is a path or a :class:`~vllm_semmoe.trace.RoutingTrace`; ``layers`` keeps the
    first that many MoE layers (before solving). Deterministic for a seed.
    """
    from . import evaluate as ev
    from .policy import get_policy
    from .tables import build_tables, device_counts

    if mode not in ("tp", "dp"):
        raise ValueError(f"mode must be 'tp' or 'dp', got {mode!r}")
    methods = list(methods)
    if not methods:
        raise ValueError("no methods given")
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"max_batches must be >= 1, got {max_batches}")
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    full = _first_layers(_as_trace(trace), layers)
    if full.num_experts % ranks:
        raise ValueError(f"{full.num_experts} experts cannot be split evenly over {ranks} ranks")
    profile, rest = full.split(profile_frac, seed)
    E = ranks
    plan_rows, plan_dev, e2d, solve_s = {}, {}, {}, {}
    if mode == "tp":
        n_tok = rest.num_tokens if max_batches is None else min(rest.num_tokens, max_batches * batch_tokens)
        n_req = int(np.searchsorted(rest.offsets, n_tok, side="left"))  # requests covering n_tok tokens
        sub = rest.select_requests(np.arange(max(n_req, 1)))
        starts = np.arange(0, n_tok, batch_tokens)
        offsets = np.append(starts, n_tok).astype(np.int64)
    for i, name in enumerate(methods):
        if progress:
            progress(i, len(methods), f"solving {name}")
        start = time.perf_counter()
        placement = get_policy(name).solve(profile, ranks, mode=mode, seed=seed)
        solve_s[name] = time.perf_counter() - start
        tables = build_tables(profile, placement, mode=mode) if name == "semmoe" else None
        e2d[name] = placement.expert_device.astype(np.int16)
        if mode == "tp":
            counts = device_counts(sub.experts, placement.expert_device, E)
            device, _ = ev._tp_devices(sub, counts, tables, E, batch_tokens)
            plan_rows[name] = (np.arange(n_tok, dtype=np.int64), offsets)
            plan_dev[name] = device[:n_tok].astype(np.int16)
        else:
            rank, _ = ev._dp_ranks(rest, tables, E, ev.EvalConfig(mode="dp", batch_tokens=batch_tokens))
            plan_rows[name], plan_dev[name] = _dp_steps(rest, rank, E, batch_tokens, max_batches)
    if progress:
        progress(len(methods), len(methods), "solving")
    used = np.unique(np.concatenate([plan_rows[m][0] for m in methods]))
    source = rest if mode == "dp" else sub
    plan = BenchPlan(mode=mode, ranks=ranks, experts=np.ascontiguousarray(source.experts[used]).astype(np.int16),
                     token_gid=used, methods=methods, expert_device=e2d, solve_s=solve_s,
                     eval_tokens=rest.num_tokens, profile_tokens=profile.num_tokens)
    for m in methods:
        rows, off = plan_rows[m]
        plan.step_rows[m] = (np.searchsorted(used, rows).astype(np.int64), off)
        plan.step_device[m] = np.ascontiguousarray(plan_dev[m])
    return plan


def _dp_steps(trace, rank, ranks, batch_tokens, max_batches):
    """Lock-stepped DP batches: each rank takes ``ceil(batch_tokens/E)`` tokens of its queue."""
    from .scheduling import slice_capacity

    L = trace.num_layers
    cap = slice_capacity(batch_tokens, ranks)
    token_rank = np.repeat(rank, np.diff(trace.offsets))
    queues = [np.nonzero(token_rank == r)[0] for r in range(ranks)]  # arrival order
    steps = max(-(-len(q) // cap) for q in queues)
    if max_batches is not None:
        steps = min(steps, max_batches)
    rows, dev, offsets = [], [], [0]
    for s in range(steps):
        for r, q in enumerate(queues):
            part = q[s * cap:(s + 1) * cap]
            rows.append(part)
            dev.append(np.full((len(part), L), r, np.int16))
        offsets.append(offsets[-1] + sum(len(q[s * cap:(s + 1) * cap]) for q in queues))
    return (np.concatenate(rows).astype(np.int64), np.asarray(offsets, np.int64)), np.concatenate(dev)


def analytic_counts(plan: BenchPlan, method: str) -> dict:
    """What the routing implies, without running anything.

    Returns ``rows [L, E, E]`` (rows each source rank must dispatch to each other rank:
    tokens with at least one expert there; ``step_rows [S, L, E, E]`` per step),
    ``activations_per_rank [S, L, E]`` ((token, expert) pairs each rank computes), ``local`` /
    ``activations`` (local and all (token, layer, expert) activations), ``tokens``
    (token-batches, counted once per batch). Counted by :func:`.cost_model.step_counts`.
    """
    rows_idx, offsets = plan.step_rows[method]
    ex = plan.experts[rows_idx]  # [P, L, K]
    dev = plan.step_device[method]  # [P, L]
    rows, activations = step_counts(ex, dev, plan.expert_device[method], offsets, plan.ranks)
    L = plan.num_layers
    ed = plan.expert_device[method].astype(np.int64)[np.arange(L)[None, :, None], ex.astype(np.int64)]
    return {
        "rows": rows.sum(axis=0),
        "step_rows": rows,
        "activations_per_rank": activations,
        "local": int((ed == dev.astype(np.int64)[..., None]).sum()),
        "activations": int(ed.size),
        "tokens": int(len(rows_idx)),
    }


# ---- the benchmark ----------------------------------------------------------------------------
def _default_backend(ranks: int) -> str:
    import torch

    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= ranks else "gloo"


def run_bench_ep(trace_path, ranks: int, mode: str, methods=DEFAULT_METHODS, *, hidden: int = 2048,
                 expert_dim: int = 64, layers: int | None = None, batch_tokens: int = 512,
                 max_batches: int | None = None, profile_frac: float = 0.2, seed: int = 0,
                 backend: str | None = None, dtype: str = "bfloat16", timeout_s: float = 900.0,
                 progress=None) -> dict:
    """Run the EP MoE-layer benchmark for every method side by side; see the module docstring.

    Args:
        trace_path: routing trace ``.npz`` (or a :class:`~vllm_semmoe.trace.RoutingTrace`).
        ranks: EP size = number of processes spawned.
        mode: ``"tp"`` or ``"dp"`` data scheduling.
        methods: placement policies (``vanilla`` should be among them for the ratios).
        hidden: hidden size of the rows moved; expert_dim: inner size of each expert's MLP.
        layers: benchmark the first ``layers`` MoE layers (default all).
        batch_tokens: tokens per batch over all ranks; max_batches: stop after that many.
        backend: ``gloo`` / ``nccl`` (default: nccl with one GPU per rank, else gloo).
        dtype: dtype of hidden states on the wire and of the expert weights.
        timeout_s: collective timeout of the process group.
        progress: ``progress(done, total, message)`` or ``None``.
    Returns:
        ``{"mode", "ranks", "hidden", "expert_dim", "dtype", "batches", "layers", "backend",
        "batch_tokens", "profile_frac", "seed", "trace", "profile_tokens", "eval_tokens",
        "run_s", "wall_s", "methods": {m: row}}`` where each row holds

        - ``dispatch_bytes`` / ``combine_bytes`` / ``total_bytes``: hidden-state bytes handed
          to ``all_to_all_single`` for other ranks, over all batches and layers;
          ``bytes_per_token``: ``total_bytes`` per token (all layers);
          ``bytes_ratio_vs_vanilla``: ``bytes_per_token`` relative to vanilla (the headline);
        - ``lar``, ``remote_activations``, ``activation_ratio_vs_vanilla`` (remote share of
          (token, expert) activations relative to vanilla, what ``semmoe eval`` calls
          ``a2a_ratio``), ``remote_pairs`` (rows dispatched = (token, layer, remote rank));
        - ``layer_ms`` (mean over batches and layers of the slowest rank's
          dispatch + experts + combine), ``layer_ms_median``, ``time_ratio_vs_vanilla``,
          ``dispatch_ms`` / ``expert_ms`` / ``combine_ms`` (mean over ranks),
          ``layer_ms_per_layer``;
        - ``dispatch_matrix[src][dst]`` / ``combine_matrix`` bytes as counted by the sender,
          ``*_recv_matrix`` as counted by the receiver, ``bytes_per_layer``,
          ``metadata_bytes`` (count exchange + routing metadata, not in the headline);
        - ``tokens``, ``batches``, ``solve_s``, and the self-checks ``conservation_ok``,
          ``analytic_match``, ``check_max_rel_err`` (a failed check raises
          :class:`BenchEPError`).

    Ranks are started with ``torch.multiprocessing`` (spawn), so a calling script needs the
    usual ``if __name__ == "__main__":`` guard and cannot be fed through stdin.
    """
    import torch
    import torch.multiprocessing as tmp

    ranks = int(ranks)
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if dtype not in ("bfloat16", "float32", "float16"):
        raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype!r}")
    backend = backend or _default_backend(ranks)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
    if backend == "nccl" and (not torch.cuda.is_available() or torch.cuda.device_count() < ranks):
        raise BenchEPError(f"backend nccl needs one CUDA device per rank ({ranks}); "
                           f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} available")
    trace = _as_trace(trace_path)  # TraceError ("trace file not found: ...") before anything starts
    started = time.perf_counter()
    plan = plan_bench_ep(trace, ranks, mode, methods, layers=layers, batch_tokens=batch_tokens,
                         max_batches=max_batches, profile_frac=profile_frac, seed=seed, progress=progress)
    cfg = {
        "methods": plan.methods, "hidden": int(hidden), "expert_dim": int(expert_dim), "seed": int(seed),
        "backend": backend, "dtype": dtype, "timeout_s": float(timeout_s),
        "steps": {m: plan.num_steps(m) for m in plan.methods},
    }
    with tempfile.TemporaryDirectory(prefix="semmoe-bench-ep-") as workdir:
        arrays = {"experts": plan.experts, "token_gid": plan.token_gid}
        for i, m in enumerate(plan.methods):
            arrays[f"e2d_{i}"] = plan.expert_device[m]
            arrays[f"rows_{i}"], arrays[f"off_{i}"] = plan.step_rows[m]
            arrays[f"dev_{i}"] = plan.step_device[m]
        np.savez(os.path.join(workdir, "plan.npz"), **arrays)
        ctx = tmp.get_context("spawn")
        queue = ctx.SimpleQueue()
        run_start = time.perf_counter()
        context = tmp.start_processes(_worker, args=(ranks, workdir, cfg, queue), nprocs=ranks, join=False,
                                      start_method="spawn")
        try:
            while not context.join(timeout=0.5):
                _drain(queue, progress)
        except Exception as exc:
            raise BenchEPError(f"bench-ep: a rank failed: {exc}") from exc
        finally:
            for p in context.processes:  # join() already terminated the rest on failure
                if p.is_alive():
                    p.terminate()
                p.join(timeout=10)
        _drain(queue, progress)
        run_s = time.perf_counter() - run_start
        per_rank = []
        for r in range(ranks):
            with np.load(os.path.join(workdir, f"result_{r}.npz")) as data:
                per_rank.append({k: data[k] for k in data.files})
    result = _aggregate(plan, cfg, per_rank)
    result.update(
        batch_tokens=int(batch_tokens), profile_frac=float(profile_frac), seed=int(seed),
        trace=os.path.basename(os.fspath(trace_path)) if not hasattr(trace_path, "experts") else "<in-memory>",
        profile_tokens=plan.profile_tokens, eval_tokens=plan.eval_tokens,
        run_s=round(run_s, 2), wall_s=round(time.perf_counter() - started, 2),
    )
    return result


def _drain(queue, progress):
    while not queue.empty():
        done, total, message = queue.get()
        if progress:
            progress(done, total, message)


def _aggregate(plan: BenchPlan, cfg: dict, per_rank: list) -> dict:
    E, L = plan.ranks, plan.num_layers
    out = {"mode": plan.mode, "ranks": E, "hidden": cfg["hidden"], "expert_dim": cfg["expert_dim"],
           "dtype": cfg["dtype"], "batches": max(cfg["steps"].values()), "layers": L,
           "backend": cfg["backend"], "methods": {}}
    problems = []
    for i, m in enumerate(plan.methods):
        def stack(key):
            return np.stack([pr[f"{key}_{i}"] for pr in per_rank])  # [E(rank), ...]

        disp_sent = stack("disp_sent").transpose(1, 0, 2)  # [L, src, dst]
        disp_recv = stack("disp_recv").transpose(1, 2, 0)  # rank r's [L, src] -> [L, src, dst=r]
        comb_sent = stack("comb_sent").transpose(1, 0, 2)
        comb_recv = stack("comb_recv").transpose(1, 2, 0)
        times = stack("times")  # [rank, S, L, 4] seconds (nan where a step does not exist)
        stats = stack("stats").sum(axis=0)  # local, activations, remote_pairs, tokens, meta_bytes
        check = float(stack("check").max())
        local, acts, remote_pairs, tokens, meta_bytes = (int(v) for v in stats)
        conserved = bool(np.array_equal(disp_sent, disp_recv) and np.array_equal(comb_sent, comb_recv)
                         and np.array_equal(comb_sent, disp_sent.transpose(0, 2, 1)))
        analytic = analytic_counts(plan, m)
        row_bytes = cfg["hidden"] * _ELEMENT_SIZE[cfg["dtype"]]
        matches = bool(np.array_equal(disp_sent, analytic["rows"] * row_bytes)
                       and local == analytic["local"] and acts == analytic["activations"])
        if not conserved:
            problems.append(f"{m}: bytes sent and received differ")
        if not matches:
            problems.append(f"{m}: measured bytes differ from the routing's analytic count")
        if not check <= CHECK_TOL:
            problems.append(f"{m}: combined output differs from the reference (rel err {check:.3g})")
        layer_wall = np.nanmax(times[..., 3], axis=0)  # slowest rank, [S, L]
        dispatch, combine = int(disp_sent.sum()), int(comb_sent.sum())
        out["methods"][m] = {
            "dispatch_bytes": dispatch,
            "combine_bytes": combine,
            "total_bytes": dispatch + combine,
            "bytes_per_token": (dispatch + combine) / max(tokens, 1),
            "bytes_ratio_vs_vanilla": None,
            "layer_ms": float(np.nanmean(layer_wall) * 1e3),
            "layer_ms_median": float(np.nanmedian(layer_wall) * 1e3),
            "time_ratio_vs_vanilla": None,
            "lar": local / max(acts, 1),
            "remote_pairs": remote_pairs,
            "activation_ratio_vs_vanilla": None,
            "remote_activations": acts - local,
            "tokens": tokens,
            "batches": cfg["steps"][m],
            "metadata_bytes": meta_bytes,
            "dispatch_ms": float(np.nanmean(times[..., 0]) * 1e3),
            "expert_ms": float(np.nanmean(times[..., 1]) * 1e3),
            "combine_ms": float(np.nanmean(times[..., 2]) * 1e3),
            "layer_ms_per_layer": [float(v) for v in np.nanmean(layer_wall, axis=0) * 1e3],
            "bytes_per_layer": [int(v) for v in (disp_sent.sum(axis=(1, 2)) + comb_sent.sum(axis=(1, 2)))],
            "dispatch_matrix": disp_sent.sum(axis=0).tolist(),
            "combine_matrix": comb_sent.sum(axis=0).tolist(),
            "dispatch_recv_matrix": disp_recv.sum(axis=0).tolist(),
            "combine_recv_matrix": comb_recv.sum(axis=0).tolist(),
            "conservation_ok": conserved,
            "analytic_match": matches,
            "check_max_rel_err": check,
            "solve_s": round(plan.solve_s[m], 3),
        }
    base = out["methods"].get("vanilla")
    if base:
        for row in out["methods"].values():
            row["bytes_ratio_vs_vanilla"] = row["bytes_per_token"] / base["bytes_per_token"] if base["bytes_per_token"] else None
            row["time_ratio_vs_vanilla"] = row["layer_ms"] / base["layer_ms"] if base["layer_ms"] else None
            v_remote = 1.0 - base["lar"]
            row["activation_ratio_vs_vanilla"] = (1.0 - row["lar"]) / v_remote if v_remote else None
    if problems:
        raise BenchEPError("bench-ep self-check failed: " + "; ".join(problems))
    return out


_ELEMENT_SIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


# ---- one rank -------------------------------------------------------------------------------
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


def _worker(rank, world, workdir, cfg, queue):
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
        self.dtype = getattr(torch, cfg["dtype"])
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
                                                self.dtype, self.device)
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

    def layer(self, gid, ex, e2d_l, layer):
        """One EP MoE layer for this rank's tokens. Returns (output fp32 [n, H], counts, times)."""
        import torch
        import torch.distributed as dist

        from .ep_exchange import EpExchange, send_plan

        E, r, dev = self.world, self.rank, self.device
        n, K = ex.shape
        ed = e2d_l[ex]  # [n, K] rank holding each chosen expert
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
        my_experts = np.nonzero(e2d_l == r)[0]
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
        xa = xs.index_select(0, rows)
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
    for i, m in enumerate(methods):
        res[f"disp_sent_{i}"] = np.zeros((L, E), np.int64)
        res[f"disp_recv_{i}"] = np.zeros((L, E), np.int64)
        res[f"comb_sent_{i}"] = np.zeros((L, E), np.int64)
        res[f"comb_recv_{i}"] = np.zeros((L, E), np.int64)
        res[f"times_{i}"] = np.full((total_steps, L, 4), np.nan)
        res[f"stats_{i}"] = np.zeros(5, np.int64)  # local, activations, remote_pairs, tokens, meta_bytes
        res[f"check_{i}"] = np.zeros(1)

    def mine(i, s, layer):
        rows, off, dev = plan[f"rows_{i}"], plan[f"off_{i}"], plan[f"dev_{i}"]
        sel = np.arange(off[s], off[s + 1])
        sel = sel[dev[sel, layer] == rank]
        return token_gid[rows[sel]], experts[rows[sel], layer]

    # correctness check on the first batch (also warms up connections and allocators); not counted
    check_layers = sorted({0, L - 1})
    for i, m in enumerate(methods):
        if steps[m] == 0:
            continue
        for layer in check_layers:
            gid, ex = mine(i, 0, layer)
            out, _, _ = me.layer(gid, ex, plan[f"e2d_{i}"][layer].astype(np.int64), layer)
            if len(gid):
                ref = me.reference(gid, ex, layer)
                err = (torch.linalg.vector_norm(out - ref, dim=1) / torch.linalg.vector_norm(ref, dim=1).clamp_min(1e-12))
                res[f"check_{i}"][0] = max(res[f"check_{i}"][0], float(err.max()))
    e2d = [plan[f"e2d_{i}"].astype(np.int64) for i in range(len(methods))]
    held = {(layer, int(e)) for d in e2d for layer in range(L) for e in np.nonzero(d[layer] == rank)[0]}
    me.weights = {k: v for k, v in me.weights.items() if k in held}  # drop the reference's other experts
    start = time.perf_counter()
    for s in range(total_steps):
        for layer in range(L):  # methods interleaved layer by layer: machine-load drift hits all alike
            for i, m in enumerate(methods):
                if s >= steps[m]:
                    continue
                gid, ex = mine(i, s, layer)
                _, c, t = me.layer(gid, ex, e2d[i][layer], layer)
                for key in ("disp_sent", "disp_recv", "comb_sent", "comb_recv"):
                    res[f"{key}_{i}"][layer] += c[key]
                res[f"stats_{i}"] += (c["local"], c["activations"], c["remote_pairs"], 0, c["meta_bytes"])
                if layer == 0:
                    res[f"stats_{i}"][3] += len(gid)
                res[f"times_{i}"][s, layer] = t
        if rank == 0 and queue is not None:
            elapsed = time.perf_counter() - start
            queue.put((s + 1, total_steps, f"batches ({elapsed:.0f} s)"))
    np.savez(os.path.join(workdir, f"result_{rank}.npz"), **res)


# ---- output -------------------------------------------------------------------------------------
def format_bench_ep(result: dict) -> str:
    """The side-by-side table of :func:`run_bench_ep`'s result."""
    head = (f"bench-ep: mode {result['mode']}, {result['ranks']} ranks ({result['backend']}), "
            f"hidden {result['hidden']} {result.get('dtype', '')}, {result['layers']} layers, "
            f"{result['batches']} batches of {result.get('batch_tokens', '?')} tokens")
    cols = [("method", "<12"), ("dispatch_MB", ">12"), ("combine_MB", ">11"), ("total_MB", ">10"),
            ("KB/token", ">9"), ("bytes_x", ">8"), ("remote_pairs", ">13"), ("lar", ">7"),
            ("act_x", ">7"), ("layer_ms", ">9"), ("time_x", ">7"), ("disp/exp/comb ms", ">19")]
    lines = [head, "".join(f"{name:{fmt}}" for name, fmt in cols)]

    def ratio(v):
        return "-" if v is None else f"{v:.3f}"

    for m, row in result["methods"].items():
        phases = f"{row['dispatch_ms']:.1f}/{row['expert_ms']:.1f}/{row['combine_ms']:.1f}"
        cells = [m, f"{row['dispatch_bytes'] / 1e6:.1f}", f"{row['combine_bytes'] / 1e6:.1f}",
                 f"{row['total_bytes'] / 1e6:.1f}", f"{row['bytes_per_token'] / 1e3:.1f}",
                 ratio(row["bytes_ratio_vs_vanilla"]), f"{row['remote_pairs']}", f"{row['lar']:.4f}",
                 ratio(row["activation_ratio_vs_vanilla"]), f"{row['layer_ms']:.2f}",
                 ratio(row["time_ratio_vs_vanilla"]), phases]
        lines.append("".join(f"{c:{fmt}}" for c, (_, fmt) in zip(cells, cols)))
    lines.append("bytes_x: all-to-all bytes (dispatch+combine, deduplicated per destination rank) vs vanilla; "
                 "act_x: remote (token, expert) activations vs vanilla; time_x: layer_ms vs vanilla.")
    lines.append("checks: bytes sent == received, == analytic count from the routing; output == reference "
                 f"(max rel err {max(r['check_max_rel_err'] for r in result['methods'].values()):.2e}).")
    if "run_s" in result:
        lines.append(f"run {result['run_s']:.1f} s (ranks), {result['wall_s']:.1f} s with solving")
    return "\n".join(lines)


def _stderr_progress(done: int, total: int, message: str) -> None:
    step = max(1, total // 10)
    if done == total or done % step == 0 or message.startswith("solving"):
        print(f"[bench-ep] {message}: {done}/{total}", file=sys.stderr, flush=True)


def add_bench_ep_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``semmoe bench-ep``."""
    parser.add_argument("--trace", required=True, help="routing trace .npz (e.g. ../shared/data/routing/dsv2lite_puffin-dev.npz)")
    parser.add_argument("--ranks", type=int, default=8, help="EP size = processes spawned (default 8)")
    parser.add_argument("--mode", choices=("tp", "dp"), default="tp", help="serving mode replayed")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                        help="comma-separated placement methods (default vanilla,eplb,semmoe)")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size of the rows moved (default 2048)")
    parser.add_argument("--expert-dim", type=int, default=64, help="inner size of each expert's MLP (default 64)")
    parser.add_argument("--batch-tokens", type=int, default=512, help="tokens per batch over all ranks")
    parser.add_argument("--max-batches", type=int, default=None, help="stop after this many batches (default all)")
    parser.add_argument("--layers", type=int, default=None, help="benchmark the first N MoE layers (default all)")
    parser.add_argument("--profile-frac", type=float, default=0.2, help="profile share of the request split")
    parser.add_argument("--seed", type=int, default=0, help="split and solver seed")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                        help="default: nccl with a GPU per rank, else gloo")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                        help="dtype of the rows moved")
    parser.add_argument("--json", default=None, help="write the result here ('-' for stdout)")
    return parser


def cmd_bench_ep(args) -> int:
    """``semmoe bench-ep``: run, print the table, optionally write JSON."""
    from .trace import TraceError

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        result = run_bench_ep(args.trace, args.ranks, args.mode, methods, hidden=args.hidden,
                              expert_dim=args.expert_dim, layers=args.layers, batch_tokens=args.batch_tokens,
                              max_batches=args.max_batches, profile_frac=args.profile_frac, seed=args.seed,
                              backend=args.backend, dtype=args.dtype, progress=_stderr_progress)
    except (TraceError, ValueError, BenchEPError) as exc:
        raise SystemExit(f"semmoe bench-ep: {exc}") from None
    print(format_bench_ep(result))
    if args.json:
        if args.json == "-":
            json.dump(result, sys.stdout, indent=2)
            print()
        else:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
                f.write("\n")
            print(f"wrote {args.json}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    parser = add_bench_ep_arguments(argparse.ArgumentParser(prog="semmoe bench-ep", description=__doc__.split("\n\n")[0]))
    return cmd_bench_ep(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
