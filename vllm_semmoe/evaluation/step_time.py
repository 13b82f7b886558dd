"""Modelled MoE-layer step time of a placement and its data scheduling on a routing stream.

The mechanism under :mod:`vllm_semmoe.evaluation.time_objective` (which placement to serve) and
:mod:`vllm_semmoe.evaluation.cost_grid` (every method on every hardware set): the stream is cut into the
steps a deployment under load runs (:func:`schedule`), every step's per-rank traffic and expert work is
counted (:func:`stream_traffic`, :func:`vllm_semmoe.evaluation.cost_model.step_traffic`) and turned into
microseconds on a hardware set and model width (:func:`step_time_us`).

Pure NumPy on top of the schedulers; nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..core import schedulers
from ..core.schedulers import dp_steps, tp_steps
from .cost_model import DSV2_LITE, HARDWARE, MoEShape, StepTraffic, layer_times, step_traffic, summarize
from ..core.modes import ServingMode, serving_mode
from ..core.policy.eplb import rank_rows, served_by_vllm_eplb, vllm_serving_device
from ..core.tables import placement_device_counts


@dataclass(frozen=True)
class Target:
    """What a step time is modelled for: a hardware set (:data:`vllm_semmoe.evaluation.cost_model.HARDWARE`),
    the tokens of one step over all ranks, and the model's widths."""

    hardware: str
    batch_tokens: int
    shape: MoEShape = DSV2_LITE

    def __post_init__(self):
        if self.hardware not in HARDWARE:
            raise ValueError(f"unknown hardware {self.hardware!r}; choose from {', '.join(HARDWARE)}")
        if self.batch_tokens < 1:
            raise ValueError(f"batch_tokens must be >= 1, got {self.batch_tokens}")

    def __str__(self) -> str:
        return f"{self.hardware}, {self.batch_tokens}-token steps, hidden {self.shape.hidden}"


def collectives_for(mode) -> str | None:
    """The collectives a mode's MoE layer runs besides the exchange (TP: the shuffled
    reduce-scatter and all-gather; DP: none)."""
    return "tp_shuffle" if serving_mode(mode) == ServingMode.TP else None


def node_groups(hardware) -> tuple:
    """Node counts whose per-node rows the hierarchical sets among ``hardware`` read."""
    return tuple(sorted({HARDWARE[h].nodes for h in hardware if HARDWARE[h].unit == "node" and HARDWARE[h].nodes > 1}))


def schedule(rest, placement, tables, mode: str, batch_tokens: int, config=None, max_batches=None,
             sample: str = "head"):
    """``(rows [P], offsets [S + 1], device [P, L], source trace)``: the evaluation tokens of
    every step (indices into ``source``), and the rank of each per layer, as a deployment under
    load runs them: TP, as ``bench-ep`` replays them
    (:func:`vllm_semmoe.tools.bench_ep.plan.plan_bench_ep`), consecutive steps of
    ``batch_tokens`` tokens, Sem-MoE's scheduler with ``tables``, else the reduce-scatter's
    contiguous slices; DP, requests on ranks by Sem-MoE's router (with ``tables``) or
    round-robin, ranks in lock step with ``ceil(batch_tokens / E)`` tokens each per step, every
    rank full at every step (``dp_steps(steady=True)``: the live router keeps every rank loaded
    by weighing in-flight work; ``bench-ep`` replays the drained stream, every token once)."""
    mode = serving_mode(mode)
    config = replace(config or schedulers.EvalConfig(), mode=mode, batch_tokens=batch_tokens)
    E = placement.ep_size
    if mode == ServingMode.DP:
        rank, _ = schedulers.dp_ranks(rest, tables, E, config)
        (rows, offsets), device = dp_steps(rest, rank, E, batch_tokens, max_batches, sample, steady=True)
        return rows, offsets, device.astype(np.int64), rest
    rows, offsets, sub = tp_steps(rest, batch_tokens, max_batches, sample)
    device, _ = schedulers.tp_devices(sub, tables, E, config)
    return rows, offsets, device[rows], sub


def oracle_devices(source, rows: np.ndarray, placement, mode: str) -> np.ndarray:
    """``[P, L]`` the rank holding most of each scheduled token's experts (TP: per token and
    layer) or of its request's (DP: one rank per request for all layers)."""
    if serving_mode(mode) == ServingMode.TP:
        return placement_device_counts(source.experts[rows], placement).argmax(axis=2).astype(np.int64)
    counts = placement_device_counts(source.experts, placement).sum(axis=1, dtype=np.int64)  # [T, E]
    per_request = np.add.reduceat(counts, source.offsets[:-1], axis=0)  # [R, E]
    request = np.repeat(np.arange(source.num_requests), np.diff(source.offsets))
    return np.repeat(per_request.argmax(axis=1)[request[rows]][:, None], source.num_layers, axis=1)


def serving_devices(placement, experts: np.ndarray, device: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """``[P, L, K]`` the rank whose copy serves each activation: vLLM's EPLB hash for the
    ``eplb`` method's replicas, else the copy on the token's own rank where there is one."""
    if served_by_vllm_eplb(placement):
        return vllm_serving_device(placement.physical_to_logical(), placement.ep_size, experts,
                                   rank_rows(device, offsets[:-1]))
    return placement.serving_device(experts, device)


def stream_traffic(rest, placement, tables, mode: str, batch_tokens: int, groups: tuple = (), *,
                   max_batches=None, sample: str = "head", oracle: bool = False) -> dict:
    """Counted traffic of ``rest`` scheduled in ``batch_tokens`` steps: ``{"traffic":
    StepTraffic, "steps": S, "oracle": StepTraffic | None, "serving": [P, L, K], "offsets":
    [S + 1], "experts": [P, L, K]}`` (the oracle: each token or request on the rank holding most
    of its experts, :func:`oracle_devices`)."""
    idx, offsets, device, source = schedule(rest, placement, tables, mode, batch_tokens,
                                            max_batches=max_batches, sample=sample)
    experts = source.experts[idx].astype(np.int64)
    E = placement.ep_size
    serving = serving_devices(placement, experts, device, offsets)
    traffic = step_traffic(serving, device, offsets, E, experts=experts, node_groups=groups)
    best = None
    if oracle:
        oracle_dev = oracle_devices(source, idx, placement, mode)
        best = step_traffic(placement.serving_device(experts, oracle_dev), oracle_dev, offsets, E,
                            experts=experts, node_groups=groups)
    return {"traffic": traffic, "steps": len(offsets) - 1, "oracle": best, "serving": serving, "offsets": offsets,
            "experts": experts}


def decides(mode, tables) -> bool:
    """Whether serving ``tables`` in ``mode`` runs a decision inside every MoE layer of every step:
    TP mode with Sem-MoE's tables (the shuffle). DP's rank choice runs per request in the API
    server, off the step; without tables the reduce-scatter's slices need none."""
    return tables is not None and serving_mode(mode) == ServingMode.TP


def step_cost(traffic: StepTraffic, target: Target, collectives: str | None, decision: bool = False) -> dict:
    """:func:`vllm_semmoe.evaluation.cost_model.summarize` of ``traffic`` on ``target``: µs per MoE layer
    per step (``total_us`` and its parts; ``decision``: add the measured TP decision, :func:`decides`)."""
    return summarize(layer_times(traffic, target.shape, HARDWARE[target.hardware], collectives, decision), traffic)


def step_time_us(traffic: StepTraffic, target: Target, mode, tables=None) -> float:
    """Modelled ``total_us`` of ``traffic`` in ``mode`` on ``target``, scheduled with ``tables``."""
    return step_cost(traffic, target, collectives_for(mode), decides(mode, tables))["total_us"]


__all__ = ["Target", "collectives_for", "decides", "node_groups", "oracle_devices", "schedule", "serving_devices",
           "step_cost", "step_time_us", "stream_traffic"]
