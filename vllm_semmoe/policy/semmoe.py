"""Sem-MoE model scheduling: co-cluster data (tokens or requests) and experts.

The paper's 0-1 program assigns data units to devices (``R``) and experts to devices (``C``) to
minimise token-load imbalance plus expected remote activations. Like the paper we alternate:

1. data step: given the placement, move every unit to the device holding most of its
   activation mass, under a token-load cap ``(1 + eps)·S/E`` (Lagrangian prices on devices);
2. expert step: given the units' devices, place experts, exactly N/E per device, to maximise
   the activations that become local. This is a transportation problem; HiGHS solves it
   exactly (it replaces the paper's greedy placement plus random pair swaps). Expert load
   (the paper's θ term, here a constraint): pairwise swaps that cost the least locality then
   bring every device's profiled expert activations within ``(1 + load_slack)`` of the mean
   (:func:`balance_swaps`). With ``R`` redundant slots per device, each device then also takes
   copies of the ``R`` experts that would serve most of its units' activations remotely
   (replication for locality; copies also split a hot expert's load).

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
from .base import PlacementPolicy, Progress, check_redundant
from ..scheduling import balanced_assignment
from .lp import assign_experts


#: default expert-load bound of the solve: a device's profiled expert activations may exceed
#: the mean by this share (chosen on a split of the seed-0 profile; see benchmarks/SEEDS.md)
DEFAULT_LOAD_SLACK = 0.05


def holds_matrix(e2d: np.ndarray, replicas: np.ndarray, ep_size: int) -> np.ndarray:
    """``[L, N, E]`` float64 1 where device ``e`` holds expert ``n`` (home ``e2d [L, N]`` or
    replica ``replicas [L, E, R]``)."""
    L, N = e2d.shape
    holds = np.zeros((L, N, ep_size))
    holds[np.arange(L)[:, None], np.arange(N)[None, :], e2d] = 1.0
    for d in range(ep_size):
        for r in range(replicas.shape[2]):
            holds[np.arange(L), replicas[:, d, r], d] = 1.0
    return holds


def local_share(counts: np.ndarray, holds: np.ndarray) -> np.ndarray:
    """Share of each unit's activations that land on each device.

    counts: ``[L, U, N]``; holds: ``[L, N, E]`` (:func:`holds_matrix`). Returns ``[U, E]``
    float64 averaged over layers (rows sum to more than 1 with replicas).
    """
    L, U, N = counts.shape
    share = np.zeros((U, holds.shape[2]))
    for l in range(L):
        _add_share(share, counts[l], holds[l])
    total = counts.sum(axis=(0, 2)).astype(float)[:, None]
    return share / np.maximum(total, 1.0)


# Small products as Numba loops, not BLAS: a multi-threaded BLAS on a busy 2-core machine turns
# an [8 x 5000] @ [5000 x 64] product into ~0.4 s of thread contention.
@numba.njit(cache=True)
def _add_share(share, counts, holds):
    """``share [U, E] += counts [U, N] @ holds [N, E]``."""
    U, N = counts.shape
    E = holds.shape[1]
    for u in range(U):
        for n in range(N):
            c = counts[u, n]
            if c:
                for e in range(E):
                    share[u, e] += c * holds[n, e]


@numba.njit(cache=True)
def _gain(counts, device, ep_size):
    """``[E, N]`` float64: activations of expert ``n`` by the units on device ``e``.

    counts: ``[U, N]``; device: ``[U]``."""
    U, N = counts.shape
    gain = np.zeros((ep_size, N))
    for u in range(U):
        d = device[u]
        for n in range(N):
            gain[d, n] += counts[u, n]
    return gain


def cocluster(counts: np.ndarray, weight: np.ndarray, ep_size: int, *, eps: float, iters: int,
              restarts: int, rng: np.random.Generator, init_device: np.ndarray | None = None,
              redundant: int = 0, load_slack: float = np.inf,
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Alternating co-clustering of units and experts (see module docstring).

    Args:
        counts: ``[L, U, N]`` activation counts of each unit (layers share the unit's device).
        weight: ``[U]`` token load of each unit.
        init_device: ``[U]`` optional starting device of every unit (one warm-started run);
            otherwise ``restarts`` runs from random balanced placements.
        redundant: R, replica slots per device.
        load_slack: a device's expert activations may exceed the mean by this share.
    Returns:
        ``(e2d [L, N], replicas [L, E, R], unit_device [U], objective)`` where objective is
        the profiled share of activations that are local.
    """
    L, U, N = counts.shape
    per_device = N // ep_size
    total = max(float(counts.sum()), 1.0)
    weight = weight.astype(np.float64)
    best = (None, None, None, -1.0)
    starts = [init_device] if init_device is not None else [None] * restarts
    for device in starts:
        if device is None:
            e2d = np.stack([rng.permutation(np.arange(N) // per_device) for _ in range(L)])
            replicas = np.zeros((L, ep_size, 0), np.int64)
            if redundant:  # random distinct non-home copies
                replicas = np.stack([_random_replicas(row, ep_size, redundant, rng) for row in e2d])
        else:
            e2d, replicas = _place_for(counts, device, ep_size, redundant, load_slack)
        previous = -1.0
        for _ in range(iters):
            cap = (1.0 + eps) * weight.sum() / ep_size
            holds = holds_matrix(e2d, replicas, ep_size)
            device, _ = balanced_assignment(local_share(counts, holds), weight, cap, 60)
            e2d, replicas = _place_for(counts, device, ep_size, redundant, load_slack)
            holds = holds_matrix(e2d, replicas, ep_size)
            objective = sum(float((_gain(counts[l], device, ep_size) * holds[l].T).sum()) for l in range(L)) / total
            if objective <= previous + 1e-6:
                break
            previous = objective
        if objective > best[3]:
            best = (e2d.copy(), replicas.copy(), device.copy(), objective)
    return best


def _random_replicas(e2d_row: np.ndarray, ep_size: int, redundant: int, rng) -> np.ndarray:
    return np.stack([rng.choice(np.nonzero(e2d_row != d)[0], redundant, replace=False) for d in range(ep_size)])


def _place_for(counts: np.ndarray, device: np.ndarray, ep_size: int, redundant: int = 0,
               load_slack: float = np.inf) -> tuple[np.ndarray, np.ndarray]:
    """Expert step: ``([L, N] home placement, [L, E, R] replicas)`` maximising activations
    local to the units' devices, with the expert-load bound and the replica choice."""
    L, N = counts.shape[0], counts.shape[2]
    e2d = np.empty((L, N), np.int64)
    replicas = np.empty((L, ep_size, redundant), np.int64)
    for l in range(L):
        gain = _gain(counts[l], device, ep_size)  # [E, N]: activations of expert n by units on device e
        e2d[l] = assign_experts(gain)
        if np.isfinite(load_slack):
            load = counts[l].sum(axis=0).astype(np.float64)
            e2d[l] = balance_swaps(gain, e2d[l], load, (1.0 + load_slack) * load.sum() / ep_size)
        if redundant:
            remote = gain.copy()
            remote[e2d[l], np.arange(N)] = -np.inf  # never copy an expert a device already holds
            replicas[l] = np.argsort(-remote, axis=1, kind="stable")[:, :redundant]
    return e2d, replicas


@numba.njit(cache=True)
def balance_swaps(gain, device, load, cap):
    """Bring every device's expert load within ``cap`` by swapping expert pairs between the
    most loaded device and another, each time the swap that loses the least gain per unit of
    load moved; stops when balanced or no swap lowers the maximum.

    Args:
        gain: ``[E, N]`` value of expert ``n`` on device ``e``; device: ``[N]`` placement;
        load: ``[N]`` expert loads; cap: the most load a device should carry.
    Returns:
        ``[N]`` int64 new placement (still N/E per device).
    """
    E, N = gain.shape
    device = device.copy()
    dev_load = np.zeros(E)
    for n in range(N):
        dev_load[device[n]] += load[n]
    for _ in range(4 * N):
        h = np.argmax(dev_load)
        if dev_load[h] <= cap:
            break
        best_a, best_b, best_cost = -1, -1, np.inf
        for a in range(N):
            if device[a] != h:
                continue
            for b in range(N):
                d = device[b]
                if d == h or load[b] >= load[a]:
                    continue
                moved = load[a] - load[b]
                if dev_load[d] + moved >= dev_load[h]:
                    continue  # would not lower the maximum
                cost = (gain[h, a] + gain[d, b] - gain[h, b] - gain[d, a]) / min(moved, dev_load[h] - cap)
                if cost < best_cost:
                    best_a, best_b, best_cost = a, b, cost
        if best_a < 0:
            break
        d = device[best_b]
        moved = load[best_a] - load[best_b]
        device[best_a], device[best_b] = d, h
        dev_load[h] -= moved
        dev_load[d] += moved
    return device


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

    supports_redundant = True

    def __init__(self, eps: float = 0.05, iters: int = 12, restarts: int = 3,
                 load_slack: float = DEFAULT_LOAD_SLACK):
        self.eps, self.iters, self.restarts, self.load_slack = eps, iters, restarts, load_slack

    def solve(self, profile, ep_size, *, mode="tp", seed=0, redundant=0, progress: Progress = None):
        if mode not in ("tp", "dp"):
            raise ValueError(f"mode must be 'tp' or 'dp', got {mode!r}")
        check_redundant(redundant, profile.num_experts, ep_size)
        rng = np.random.default_rng(seed)
        L = profile.num_layers
        if mode == "dp":
            counts = request_expert_counts(profile)
            e2d, replicas, _, _ = cocluster(counts, np.diff(profile.offsets), ep_size, eps=self.eps,
                                            iters=self.iters, restarts=self.restarts, rng=rng,
                                            redundant=redundant, load_slack=self.load_slack)
            if progress:
                progress(L, L, "semmoe co-clustering (requests)")
        else:
            _, counts = token_expert_counts(profile)
            weight = counts[0].sum(axis=1) // profile.top_k
            e2d = np.empty((L, profile.num_experts), np.int64)
            replicas = np.empty((L, ep_size, redundant), np.int64)
            device = None
            for l in range(L):
                # warm start from the previous layer's token clusters: device labels then mean
                # the same thing across layers, which makes the A (device-sequence) table sharp
                placed, copies, device, _ = cocluster(
                    counts[l : l + 1], weight, ep_size, eps=self.eps, iters=self.iters,
                    restarts=self.restarts, rng=rng, init_device=device, redundant=redundant,
                    load_slack=self.load_slack)
                e2d[l], replicas[l] = placed[0], copies[0]
                if progress:
                    progress(l + 1, L, "semmoe co-clustering (tokens, per layer)")
        return Placement(e2d, ep_size, self.name, replicas if redundant else None)
