"""Placements with no locality objective: what vLLM/SGLang do by default, and EPLB."""

from __future__ import annotations

import numpy as np

from ..placement import Placement
from ..trace import RoutingTrace
from .base import PlacementPolicy, Progress, check_redundant


def contiguous_placement(num_layers: int, num_experts: int, ep_size: int) -> np.ndarray:
    """``[L, N]``: expert ``n`` on device ``n // (N/E)`` (vLLM ``linear``, SGLang default)."""
    row = np.arange(num_experts) // (num_experts // ep_size)
    return np.tile(row, (num_layers, 1))


def round_robin_placement(num_layers: int, num_experts: int, ep_size: int) -> np.ndarray:
    """``[L, N]``: expert ``n`` on device ``n mod E`` (vLLM ``round_robin``)."""
    return np.tile(np.arange(num_experts) % ep_size, (num_layers, 1))


def expert_loads(profile: RoutingTrace) -> np.ndarray:
    """``[L, N]`` int64: activation count of every expert in the profile."""
    L, N = profile.num_layers, profile.num_experts
    flat = profile.experts.transpose(1, 0, 2).reshape(L, -1).astype(np.int64)
    return np.stack([np.bincount(flat[l], minlength=N) for l in range(L)])


def balanced_packing(weight: np.ndarray, num_packs: int) -> np.ndarray:
    """Pack items into ``num_packs`` packs of equal item count, balancing total weight.

    DeepSeek EPLB's ``balanced_packing``: heaviest item first, into the lightest pack that
    still has room.

    Args:
        weight: ``[L, N]`` item weights per layer.
    Returns:
        ``[L, N]`` int64 pack of each item.
    """
    L, N = weight.shape
    per_pack = N // num_packs
    pack = np.empty((L, N), np.int64)
    for l in range(L):
        load = np.zeros(num_packs)
        count = np.zeros(num_packs, np.int64)
        for n in np.argsort(-weight[l], kind="stable"):
            open_packs = np.nonzero(count < per_pack)[0]
            p = open_packs[np.argmin(load[open_packs])]
            pack[l, n] = p
            load[p] += weight[l, n]
            count[p] += 1
    return pack


class VanillaPolicy(PlacementPolicy):
    """Contiguous blocks of experts per device (vLLM/SGLang default)."""

    name = "vanilla"

    def solve(self, profile, ep_size, *, mode="tp", seed=0, redundant=0, progress: Progress = None):
        check_redundant(redundant, profile.num_experts, ep_size, self.name)
        e2d = contiguous_placement(profile.num_layers, profile.num_experts, ep_size)
        return Placement(e2d, ep_size, self.name)


class RoundRobinPolicy(PlacementPolicy):
    """Expert ``n`` on device ``n mod E`` (vLLM's ``--expert-placement-strategy round_robin``)."""

    name = "round_robin"

    def solve(self, profile, ep_size, *, mode="tp", seed=0, redundant=0, progress: Progress = None):
        check_redundant(redundant, profile.num_experts, ep_size, self.name)
        e2d = round_robin_placement(profile.num_layers, profile.num_experts, ep_size)
        return Placement(e2d, ep_size, self.name)


class EplbPolicy(PlacementPolicy):
    """DeepSeek EPLB without replication: balance expert activation load, no locality."""

    name = "eplb"

    def solve(self, profile, ep_size, *, mode="tp", seed=0, redundant=0, progress: Progress = None):
        check_redundant(redundant, profile.num_experts, ep_size, self.name)
        e2d = balanced_packing(expert_loads(profile).astype(float), ep_size)
        return Placement(e2d, ep_size, self.name)
