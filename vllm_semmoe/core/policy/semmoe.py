"""Sem-MoE model scheduling: co-cluster data (tokens or requests) and experts.

The paper's 0-1 program assigns data units to devices (``R``) and experts to devices (``C``) to
minimise token-load imbalance plus expected remote activations. Like the paper we alternate:

1. data step: given the placement, move every unit to the device holding most of its
   activation mass, under a token-load cap ``(1 + eps)·S/E`` (Lagrangian prices on devices);
2. expert step: given the units' devices, place experts, exactly N/E per device, to maximise
   the activations that become local. This is a transportation problem; HiGHS solves it
   exactly (it replaces the paper's greedy placement plus random pair swaps). Expert load
   (the paper's θ term): pairwise swaps that cost the least locality per unit of load moved
   (:func:`balance_swaps`) go from the locality optimum down to the mean, and the placement
   along the way that maximises local share minus θ × expert imbalance (``load_price``,
   :data:`DEFAULT_LOAD_PRICE`) is kept: a Lagrangian price, so every layer gives up balance
   where it is cheapest in locality. A hard bound instead (``load_slack``: every device's
   profiled expert activations within ``(1 + load_slack)`` of the mean) reaches about the same
   held-out locality at the same expert imbalance on the tuning split (benchmarks/SEEDS.md).

Replication for locality (``R`` redundant slots per device, after the co-clustering): the
online scheduler is simulated on the profile with the solved placement's tables, and every
device takes copies of the ``R`` experts that the tokens (TP) or requests (DP) it was given
use most remotely (:func:`replicas_for_schedule`); copies also split a hot expert's load.
Choosing the copies against the real scheduler beat co-clustering with replica-aware units on
a split of the seed-0 profile (+3.8 vs +3.5 LAR points for R = 1).

A run stops when an iteration no longer raises the objective (the load-bound swaps and the
approximate data step can lower it) and keeps its best iterate; of the seeded restarts the best
run is kept. 6 restarts, chosen on 8 50/50 splits of the tuning split (TP, held-out LAR with the
load bound: 0.3835 / 0.3860 / 0.3866 with 3 / 6 / 10 random restarts beside the previous layer's
clusters; 10 adds 0.06 points for 1.6x the solve time; ``scripts/tune_load_slack.py --restarts``).

The data unit depends on the serving mode:

- ``tp`` (Attention-TP): tokens are re-scheduled at every layer, so each layer is co-clustered
  on its own with token ids as units; one run starts from the previous layer's clusters, the
  others from random placements, and the winner's labels are matched to the previous layer's;
- ``dp`` (Attention-DP): a request stays on one rank for all layers, so units are profiled
  requests and one device per request is shared by every layer's placement.
"""

from __future__ import annotations

import numba
import numpy as np

from ..affinity import token_expert_counts
from ..modes import ServingMode, serving_mode
from ..placement import Placement
from ..trace import RoutingTrace
from .base import PlacementPolicy, Progress, check_redundant
from ..schedulers import EvalConfig, scheduled_devices
from ..scheduling import balanced_assignment
from ..tables import build_tables
from .lp import assign_experts


#: default θ of the solve's expert-load term: TP LAR given up per unit of a layer's expert
#: imbalance (max / mean device load). Chosen on 8 50/50 splits of the tuning split
#: (``trace.TUNING_FRAC``), which no evaluation uses (``scripts/tune_load_slack.py --prices``: the
#: smallest θ whose held-out expert imbalance is at or below that of the hard bound ``load_slack``
#: 0.05, the bound chosen before it); see benchmarks/SEEDS.md
DEFAULT_LOAD_PRICE = 0.3


def local_share(counts: np.ndarray, e2d: np.ndarray, ep_size: int) -> np.ndarray:
    """Share of each unit's activations that land on each device.

    counts: ``[L, U, N]``; e2d: ``[L, N]``. Returns ``[U, E]`` float64 averaged over layers.
    """
    L, U, N = counts.shape
    share = np.zeros((U, ep_size))
    for l in range(L):
        _add_share(share, counts[l], e2d[l].astype(np.int64))
    total = counts.sum(axis=(0, 2)).astype(float)[:, None]
    return share / np.maximum(total, 1.0)


# Small products as Numba loops, not BLAS: a multi-threaded BLAS on a busy 2-core machine turns
# an [8 x 5000] @ [5000 x 64] product into ~0.4 s of thread contention.
@numba.njit(cache=True)
def _add_share(share, counts, device):
    """``share [U, E] += counts [U, N]`` summed by expert device ``device [N]``."""
    U, N = counts.shape
    for u in range(U):
        for n in range(N):
            share[u, device[n]] += counts[u, n]


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
              load_slack: float = np.inf, load_price: float = 0.0) -> tuple[np.ndarray, np.ndarray, float]:
    """Alternating co-clustering of units and experts (see module docstring).

    Args:
        counts: ``[L, U, N]`` activation counts of each unit (layers share the unit's device).
        weight: ``[U]`` token load of each unit.
        restarts: runs from random balanced placements (one if there is no other run).
        init_device: ``[U]`` optional starting device of every unit: one more run starts from
            it; whichever run wins has its device labels matched to ``init_device``'s
            (:func:`match_labels`), so a label means the same cluster as in the run that gave
            ``init_device``.
        load_slack: a device's expert activations may exceed the mean by this share.
        load_price: θ, LAR given up per unit of expert imbalance (max / mean device load).
    Returns:
        ``(e2d [L, N], unit_device [U], objective)`` where objective is the profiled share of
        activations that are local.
    """
    L, U, N = counts.shape
    per_device = N // ep_size
    total = max(float(counts.sum()), 1.0)
    weight = weight.astype(np.float64)
    best = (None, None, -1.0)
    starts = ([init_device] if init_device is not None else []) + [None] * restarts or [None]
    for device in starts:
        if device is None:
            e2d = np.stack([rng.permutation(np.arange(N) // per_device) for _ in range(L)])
        else:
            e2d = _place_for(counts, device, ep_size, load_slack, load_price)
        previous = -1.0
        for _ in range(iters):
            cap = (1.0 + eps) * weight.sum() / ep_size
            device, _ = balanced_assignment(local_share(counts, e2d, ep_size), weight, cap, 60)
            e2d = _place_for(counts, device, ep_size, load_slack, load_price)
            objective = sum(float(_gain(counts[l], device, ep_size)[e2d[l], np.arange(N)].sum())
                            for l in range(L)) / total
            if objective > best[2]:  # the best iterate: a bounded step can lower the objective
                best = (e2d.copy(), device.copy(), objective)
            if objective <= previous + 1e-6:
                break
            previous = objective
    if init_device is not None:
        label = match_labels(init_device, best[1], weight, ep_size)
        best = (label[best[0]], label[best[1]], best[2])
    return best


def match_labels(reference: np.ndarray, device: np.ndarray, weight: np.ndarray, ep_size: int) -> np.ndarray:
    """``[E]`` relabelling of ``device``'s clusters that keeps the most unit weight on the label
    it has in ``reference`` (a perfect matching, solved exactly).

    reference, device: ``[U]`` device of every unit in two clusterings; weight: ``[U]``.
    Returns ``label`` with ``label[device]`` the relabelled clustering (a permutation of devices).
    """
    overlap = np.zeros((ep_size, ep_size))  # [reference label, label in device]
    np.add.at(overlap, (reference.astype(np.int64), device.astype(np.int64)), weight)
    return assign_experts(overlap)  # one reference label per label of ``device``


def _place_for(counts: np.ndarray, device: np.ndarray, ep_size: int, load_slack: float = np.inf,
               load_price: float = 0.0) -> np.ndarray:
    """Expert step: ``[L, N]`` placement maximising, per layer, the activations local to the
    units' devices minus ``load_price`` times the layer's expert imbalance (both in shares of
    the layer's activations), within the hard bound ``load_slack``."""
    L, N = counts.shape[0], counts.shape[2]
    e2d = np.empty((L, N), np.int64)
    for l in range(L):
        gain = _gain(counts[l], device, ep_size)  # [E, N]: activations of expert n by units on device e
        e2d[l] = assign_experts(gain)
        load = counts[l].sum(axis=0).astype(np.float64)
        mean = load.sum() / ep_size
        if np.isfinite(load_slack):
            e2d[l] = balance_swaps(gain, e2d[l], load, (1.0 + load_slack) * mean)
        if load_price > 0:
            # gain/(E·mean) - θ·max/mean, times E·mean: the price of a device's load is θ·E
            e2d[l] = balance_swaps(gain, e2d[l], load, mean, load_price * ep_size)
    return e2d


def replicas_for_schedule(profile: RoutingTrace, placement: Placement, redundant: int, mode: str) -> np.ndarray:
    """``[L, E, R]`` replicas: for every device the ``R`` experts not at home there that the
    online scheduler's units on it activate most, the scheduler simulated on the profile with
    ``placement``'s tables (TP: 512-token batches; DP: the default balance rule).
    """
    E, L, N = placement.ep_size, placement.num_layers, placement.num_experts
    tables = build_tables(profile, placement, mode=mode)
    device = scheduled_devices(profile, placement, tables, EvalConfig(mode=mode))  # [T, L]
    use = np.zeros((L, E, N))
    for l in range(L):
        np.add.at(use[l], (np.repeat(device[:, l], profile.top_k), profile.experts[:, l].ravel().astype(np.int64)), 1)
    use[np.arange(L)[:, None], placement.expert_device.astype(np.int64), np.arange(N)[None, :]] = -np.inf
    return np.argsort(-use, axis=2, kind="stable")[:, :, :redundant]


def replicas_for_load(profile: RoutingTrace, placement: Placement, redundant: int, mode: str) -> np.ndarray:
    """``[L, E, R]`` replicas for load and locality: the slots go, one at a time, to the expert
    whose activations per copy are highest (DeepSeek EPLB's rule for which experts to copy), each
    copy on the device, among those with a free slot and no copy yet, whose scheduled units use
    that expert most (where its tokens are; the online scheduler simulated on the profile as in
    :func:`replicas_for_schedule`)."""
    E, L, N = placement.ep_size, placement.num_layers, placement.num_experts
    tables = build_tables(profile, placement, mode=mode)
    device = scheduled_devices(profile, placement, tables, EvalConfig(mode=mode))  # [T, L]
    out = np.zeros((L, E, redundant), np.int64)
    for l in range(L):
        use = np.zeros((E, N))
        np.add.at(use, (np.repeat(device[:, l], profile.top_k), profile.experts[:, l].ravel().astype(np.int64)), 1)
        out[l] = _hot_copies(use, placement.expert_device[l].astype(np.int64), redundant)
    return out


@numba.njit(cache=True)
def _hot_copies(use, home, redundant):
    """``[E, R]``: :func:`replicas_for_load` for one layer; ``use [E, N]`` activations of each
    expert by the units on each device, ``home [N]``."""
    E, N = use.shape
    load = use.sum(axis=0)
    copies = np.ones(N)
    holds = np.zeros((E, N), np.bool_)
    for n in range(N):
        holds[home[n], n] = True
    free = np.full(E, redundant)
    out = np.zeros((E, redundant), np.int64)
    for _ in range(E * redundant):
        best_n, best_share = -1, -1.0
        for n in range(N):
            share = load[n] / copies[n]
            if share > best_share:
                eligible = False
                for e in range(E):
                    if free[e] > 0 and not holds[e, n]:
                        eligible = True
                        break
                if eligible:
                    best_n, best_share = n, share
        best_e, best_use = -1, -1.0
        for e in range(E):
            if free[e] > 0 and not holds[e, best_n] and use[e, best_n] > best_use:
                best_e, best_use = e, use[e, best_n]
        out[best_e, redundant - free[best_e]] = best_n
        free[best_e] -= 1
        holds[best_e, best_n] = True
        copies[best_n] += 1
    return out


@numba.njit(cache=True)
def balance_swaps(gain, device, load, cap, theta=0.0):
    """Bring every device's expert load within ``cap`` by swapping expert pairs between the
    most loaded device and another, each time the swap that loses the least gain per unit of
    load moved; stops when balanced or no swap lowers the maximum.

    With ``theta > 0`` (a Lagrangian price, gain per unit of the most loaded device's load)
    the swaps go on down to ``cap`` and the placement along the way that maximises
    ``gain - theta * max device load`` is returned.

    Args:
        gain: ``[E, N]`` value of expert ``n`` on device ``e``; device: ``[N]`` placement;
        load: ``[N]`` expert loads; cap: the most load a device should carry.
    Returns:
        ``[N]`` int64 new placement (still N/E per device).
    """
    E, N = gain.shape
    device = device.copy()
    dev_load = np.zeros(E)
    total = 0.0
    for n in range(N):
        dev_load[device[n]] += load[n]
        total += gain[device[n], n]
    best_device = device.copy()
    best_value = total - theta * dev_load.max()
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
        total -= gain[h, best_a] + gain[d, best_b] - gain[h, best_b] - gain[d, best_a]
        device[best_a], device[best_b] = d, h
        dev_load[h] -= moved
        dev_load[d] += moved
        value = total - theta * dev_load.max()
        if value > best_value:
            best_device[:] = device
            best_value = value
    return best_device if theta > 0 else device


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


#: how the ``R`` redundant slots are filled: copies of what each device's units use most
#: remotely (``locality``), or of the experts with the most activations per copy, each placed
#: where its tokens are (``load``)
REPLICA_RULES = {"locality": replicas_for_schedule, "load": replicas_for_load}


class SemMoEPolicy(PlacementPolicy):
    """The paper's model–data co-scheduling placement."""

    name = "semmoe"

    supports_redundant = True
    schedules_data = True

    def __init__(self, eps: float = 0.05, iters: int = 12, restarts: int = 6,
                 load_slack: float = np.inf, load_price: float = DEFAULT_LOAD_PRICE, replicas: str = "locality"):
        if replicas not in REPLICA_RULES:
            raise ValueError(f"replicas must be one of {', '.join(REPLICA_RULES)}, got {replicas!r}")
        self.eps, self.iters, self.restarts = eps, iters, restarts
        self.load_slack, self.load_price, self.replicas = load_slack, load_price, replicas

    def solve(self, profile, ep_size, *, mode="tp", seed=0, redundant=0, progress: Progress = None):
        mode = serving_mode(mode)
        check_redundant(redundant, profile.num_experts, ep_size)
        rng = np.random.default_rng(seed)
        L = profile.num_layers
        if mode == ServingMode.DP:
            counts = request_expert_counts(profile)
            e2d, _, _ = cocluster(counts, np.diff(profile.offsets), ep_size, eps=self.eps,
                                  iters=self.iters, restarts=self.restarts, rng=rng,
                                  load_slack=self.load_slack, load_price=self.load_price)
            if progress:
                progress(L, L, "semmoe co-clustering (requests)")
        else:
            _, counts = token_expert_counts(profile)
            weight = counts[0].sum(axis=1) // profile.top_k
            e2d = np.empty((L, profile.num_experts), np.int64)
            device = None
            for l in range(L):
                # the previous layer's token clusters start one run, beside the random restarts
                # (under the expert-load bound a warm start alone often stays in a poorer local
                # optimum); labels are matched to them, so a device label means the same thing
                # across layers, which makes the A (device-sequence) table sharp
                placed, device, _ = cocluster(
                    counts[l : l + 1], weight, ep_size, eps=self.eps, iters=self.iters,
                    restarts=self.restarts, rng=rng, init_device=device, load_slack=self.load_slack,
                    load_price=self.load_price)
                e2d[l] = placed[0]
                if progress:
                    progress(l + 1, L, "semmoe co-clustering (tokens, per layer)")
        placement = self.replicate(profile, Placement(e2d, ep_size, self.name), redundant, mode)
        if redundant and progress:
            progress(1, 1, f"semmoe replicas for {self.replicas} (R = {redundant})")
        return placement

    def replicate(self, profile, homes: Placement, redundant: int, mode) -> Placement:
        """``homes`` (a placement without replicas) with ``redundant`` slots per device filled by
        this policy's replica rule (:data:`REPLICA_RULES`); ``homes`` itself for ``redundant = 0``."""
        if not redundant:
            return homes
        rule = REPLICA_RULES[self.replicas]
        return Placement(homes.expert_device, homes.ep_size, self.name,
                         rule(profile, homes, redundant, serving_mode(mode)))
