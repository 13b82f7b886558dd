"""The driver: plan in the parent, spawn one process per rank, collect and aggregate."""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from ...core.capture_store import as_trace
from .plan import DEFAULT_METHODS, plan_bench_ep
from .report import BenchEPError, aggregate
from .worker import rank_main


def _default_backend(ranks: int) -> str:
    import torch

    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= ranks else "gloo"


def run_bench_ep(trace_path, ranks: int, mode: str, methods=DEFAULT_METHODS, *, hidden: int = 2048,
                 expert_dim: int = 64, layers: int | None = None, batch_tokens: int = 512,
                 max_batches: int | None = None, profile_frac: float = 0.2, seed: int = 0,
                 redundant: int = 0, backend: str | None = None, dtype: str = "bfloat16", timeout_s: float = 900.0,
                 progress=None, sample: str = "head") -> dict:
    """Run the EP MoE-layer benchmark for every method side by side; see the module docstring.

    Args:
        trace_path: routing trace ``.npz`` (or a :class:`~vllm_semmoe.core.trace.RoutingTrace`).
        ranks: EP size = number of processes spawned.
        mode: ``"tp"`` or ``"dp"`` data scheduling.
        methods: placement policies (``vanilla`` should be among them for the ratios).
        hidden: hidden size of the rows moved; expert_dim: inner size of each expert's MLP.
        layers: benchmark the first ``layers`` MoE layers (default all).
        batch_tokens: tokens per batch over all ranks; max_batches: replay that many steps,
            the first ones (``sample="head"``) or spread evenly over the stream (``"spread"``).
        redundant: replica slots per rank ``R`` for the methods that replicate (``semmoe``):
            each rank then holds ``N/E + R`` experts per layer, and an activation whose expert
            has a copy on the token's rank is computed there, without communication.
        backend: ``gloo`` / ``nccl`` (default: nccl with one GPU per rank, else gloo).
        dtype: dtype of hidden states on the wire and, on GPUs, of the expert weights and
            GEMMs (on CPUs those run in float32: many CPUs have no fast bfloat16 GEMM).
        timeout_s: collective timeout of the process group.
        progress: ``progress(done, total, message)`` or ``None``.
    Returns:
        ``{"mode", "ranks", "hidden", "expert_dim", "dtype", "batches", "layers", "backend",
        "batch_tokens", "profile_frac", "seed", "sample", "trace", "profile_tokens", "eval_tokens",
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
        - ``redundant`` (R the method was solved with), ``experts_per_rank`` (``N/E + R``
          expert slots each rank holds per layer: its expert memory);
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
    trace = as_trace(trace_path)  # TraceError ("trace file not found: ...") before anything starts
    started = time.perf_counter()
    plan = plan_bench_ep(trace, ranks, mode, methods, layers=layers, batch_tokens=batch_tokens,
                         max_batches=max_batches, profile_frac=profile_frac, seed=seed, redundant=redundant,
                         progress=progress, sample=sample)
    cfg = {
        "methods": plan.methods, "hidden": int(hidden), "expert_dim": int(expert_dim), "seed": int(seed),
        "backend": backend, "dtype": dtype, "timeout_s": float(timeout_s),
        "steps": {m: plan.num_steps(m) for m in plan.methods},
    }
    with tempfile.TemporaryDirectory(prefix="semmoe-bench-ep-") as workdir:
        arrays = {"experts": plan.experts, "token_gid": plan.token_gid}
        for i, m in enumerate(plan.methods):
            arrays[f"holds_{i}"] = plan.placements[m].holds()
            arrays[f"rows_{i}"], arrays[f"off_{i}"] = plan.step_rows[m]
            arrays[f"dev_{i}"] = plan.step_device[m]
            arrays[f"serve_{i}"] = plan.step_serving[m]
        np.savez(os.path.join(workdir, "plan.npz"), **arrays)
        ctx = tmp.get_context("spawn")
        queue = ctx.SimpleQueue()
        run_start = time.perf_counter()
        context = tmp.start_processes(rank_main, args=(ranks, workdir, cfg, queue), nprocs=ranks, join=False,
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
    result = aggregate(plan, cfg, per_rank)
    result.update(
        batch_tokens=int(batch_tokens), profile_frac=float(profile_frac), seed=int(seed), sample=sample,
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
