"""MoETuner-style placement: follow inter-layer routing dependencies under balanced load.

MoETuner (Go & Mahajan, 2025) places experts with an ILP so that a token's consecutive-layer
experts tend to share a GPU while expert load stays balanced. Solved here layer by layer with
HiGHS: layer 0 by load-balanced packing, then each layer ``l`` given layer ``l-1`` fixed,

    max  Σ_{e1, e2} F_l[e1, e2] · [dev(e1) == dev(e2)]
    s.t. N/E experts per device,  Σ_{e on d} load_l[e] <= (1 + slack) · mean load,

where ``F_l[e1, e2]`` counts tokens routed to ``e1`` at layer ``l-1`` and ``e2`` at layer ``l``.
"""

from __future__ import annotations

import numba
import numpy as np

from ..modes import ServingMode
from ..placement import Placement
from .base import PlacementPolicy, Progress, check_redundant
from .lp import assign_experts
from .simple import balanced_packing, expert_loads


@numba.njit(cache=True)
def layer_transitions(experts, num_experts):
    """``[L-1, N, N]`` int64: ``F[l, a, b]`` = tokens with expert ``a`` at layer ``l`` and ``b`` at ``l+1``.

    experts: ``[T, L, K]`` routed expert ids.
    """
    T, L, K = experts.shape
    F = np.zeros((max(L - 1, 0), num_experts, num_experts), np.int64)
    for t in range(T):
        for l in range(L - 1):
            for a in range(K):
                for b in range(K):
                    F[l, experts[t, l, a], experts[t, l + 1, b]] += 1
    return F


def chain_placement(transitions: np.ndarray, loads: np.ndarray, ep_size: int, slack: float,
                    progress: Progress = None) -> np.ndarray:
    """Sequential ILP placement.

    Args:
        transitions: ``[L-1, N, N]`` consecutive-layer co-activation counts.
        loads: ``[L, N]`` expert activation counts.
        slack: allowed relative excess of a device's load over the mean.
    Returns:
        ``[L, N]`` int64 expert→device.
    """
    L, N = loads.shape
    e2d = np.empty((L, N), np.int64)
    e2d[0] = balanced_packing(loads[:1].astype(float), ep_size)[0]
    onehot = np.zeros((N, ep_size))
    for l in range(1, L):
        onehot[:] = 0
        onehot[np.arange(N), e2d[l - 1]] = 1
        gain = onehot.T @ transitions[l - 1]  # [E, N]: tokens arriving from device d
        max_load = (1.0 + slack) * loads[l].sum() / ep_size
        e2d[l] = assign_experts(gain, max_load=max_load, load=loads[l], time_limit=2.0)
        if progress:
            progress(l, L - 1, "moetuner layers")
    return e2d


class MoETunerPolicy(PlacementPolicy):
    """Inter-layer-affinity ILP placement with a balanced-load constraint (MoETuner's idea)."""

    name = "moetuner"

    def __init__(self, load_slack: float = 0.10):
        self.load_slack = load_slack

    def solve(self, profile, ep_size, *, mode=ServingMode.TP, seed=0, redundant=0, progress: Progress = None):
        check_redundant(redundant, profile.num_experts, ep_size, self.name)
        F = layer_transitions(profile.experts, profile.num_experts)
        e2d = chain_placement(F, expert_loads(profile), ep_size, self.load_slack, progress)
        return Placement(e2d, ep_size, self.name)
