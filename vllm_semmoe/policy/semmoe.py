"""Sem-MoE model scheduling: co-cluster data (tokens or requests) and experts.

The paper's 0-1 program assigns data units to devices (``R``) and experts to devices (``C``) to
minimise token-load imbalance plus expected remote activations. Like the paper we alternate:

1. data step: given the placement, move every unit to the device holding most of its
   activation mass, under a token-load cap ``(1 + eps)·S/E`` (Lagrangian prices on devices);
2. expert step: given the units' devices, place experts, exactly N/E per device, to maximise
   the activations that become local. This is a transportation problem; HiGHS solves it
   exactly (it replaces the paper's greedy placement plus random pair swaps).

Both steps never lower the objective, so it converges; several seeded restarts keep the best.
The data unit depends on the serving mode:

- ``tp`` (Attention-TP): tokens are re-scheduled at every layer, so each layer is co-clustered
  on its own with token ids as units, warm-started from the previous layer's clusters;
- ``dp`` (Attention-DP): a request stays on one rank for all layers, so units are profiled
  requests and one device per request is shared by every layer's placement.
"""

from __future__ import annotations

import numba
import numpy as np

from ..affinity import token_expert_counts
from ..placement import Placement
from ..trace import RoutingTrace
from .base import PlacementPolicy, Progress
from ..scheduling import balanced_assignment
from .lp import assign_experts


def local_share(counts: np.ndarray, e2d: np.ndarray, ep_size: int) -> np.ndarray:
    """Share of each unit's activations that land on each device.

    counts: ``[L, U, N]``; e2d: ``[L, N]``. Returns ``[U, E]`` float64 averaged over layers.
    """
    L, U, N = counts.shape
    share = np.zeros((U, ep_size))
    for l in range(L):
        onehot = np.zeros((N, ep_size))
        onehot[np.arange(N), e2d[l]] = 1.0
        share += counts[l] @ onehot
    total = counts.sum(axis=(0, 2)).astype(float)[:, None]
    return share / np.maximum(total, 1.0)


def cocluster(counts: np.ndarray, weight: np.ndarray, ep_size: int, *, eps: float, iters: int,
              restarts: int, rng: np.random.Generator,
              init_device: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, float]:
    """Alternating co-clustering of units and experts (see module docstring).

    Args:
        counts: ``[L, U, N]`` activation counts of each unit (layers share the unit's device).
        weight: ``[U]`` token load of each unit.
        init_device: ``[U]`` optional starting device of every unit (one warm-started run);
            otherwise ``restarts`` runs from random balanced placements.
    Returns:
        ``(e2d [L, N], unit_device [U], objective)`` where objective is the profiled share of
        activations that are local.
    """
    L, U, N = counts.shape
    per_device = N // ep_size
    total = max(float(counts.sum()), 1.0)
    weight = weight.astype(np.float64)
    best = (None, None, -1.0)
    starts = [init_device] if init_device is not None else [None] * restarts
    for device in starts:
        if device is None:
            e2d = np.stack([rng.permutation(np.arange(N) // per_device) for _ in range(L)])
        else:
            e2d = _place_for(counts, device, ep_size)
        previous = -1.0
        for _ in range(iters):
            cap = (1.0 + eps) * weight.sum() / ep_size
            device, _ = balanced_assignment(local_share(counts, e2d, ep_size), weight, cap, 60)
            e2d = _place_for(counts, device, ep_size)
            objective = sum(float(counts[l][e2d[l][None, :] == device[:, None]].sum()) for l in range(L)) / total
            if objective <= previous + 1e-6:
                break
            previous = objective
        if objective > best[2]:
            best = (e2d.copy(), device.copy(), objective)
    return best


def _place_for(counts: np.ndarray, device: np.ndarray, ep_size: int) -> np.ndarray:
    """Expert step: ``[L, N]`` placement maximising activations local to the units' devices."""
    onehot = np.zeros((len(device), ep_size))
    onehot[np.arange(len(device)), device] = 1.0
    return np.stack([assign_experts(onehot.T @ counts[l]) for l in range(counts.shape[0])])


def request_expert_counts(trace: RoutingTrace) -> np.ndarray:
    """``[L, R, N]`` int32: activation counts of every request at every layer."""
    return _request_counts(trace.offsets, trace.experts, trace.num_experts)


@numba.njit(cache=True)
def _request_counts(offsets, experts, num_experts):
    T, L, K = experts.shape
    R = len(offsets) - 1
    out = np.zeros((L, R, num_experts), np.int32)
    for r in range(R):
        for t in range(offsets[r], offsets[r + 1]):
            for l in range(L):
                for k in range(K):
                    out[l, r, experts[t, l, k]] += 1
    return out


class SemMoEPolicy(PlacementPolicy):
    """The paper's model–data co-scheduling placement."""

    name = "semmoe"

    def __init__(self, eps: float = 0.05, iters: int = 12, restarts: int = 3):
        self.eps, self.iters, self.restarts = eps, iters, restarts

    def solve(self, profile, ep_size, *, mode="tp", seed=0, progress: Progress = None):
        if mode not in ("tp", "dp"):
            raise ValueError(f"mode must be 'tp' or 'dp', got {mode!r}")
        rng = np.random.default_rng(seed)
        L = profile.num_layers
        if mode == "dp":
            counts = request_expert_counts(profile)
            e2d, _, _ = cocluster(counts, np.diff(profile.offsets), ep_size, eps=self.eps,
                                  iters=self.iters, restarts=self.restarts, rng=rng)
            if progress:
                progress(L, L, "semmoe co-clustering (requests)")
        else:
            _, counts = token_expert_counts(profile)
            weight = counts[0].sum(axis=1) // profile.top_k
            e2d = np.empty((L, profile.num_experts), np.int64)
            device = None
            for l in range(L):
                # warm start from the previous layer's token clusters: device labels then mean
                # the same thing across layers, which makes the A (device-sequence) table sharp
                placed, device, _ = cocluster(counts[l : l + 1], weight, ep_size, eps=self.eps,
                                              iters=self.iters, restarts=self.restarts, rng=rng,
                                              init_device=device)
                e2d[l] = placed[0]
                if progress:
                    progress(l + 1, L, "semmoe co-clustering (tokens, per layer)")
        return Placement(e2d, ep_size, self.name)
