"""Placements with no locality objective: what vLLM/SGLang do by default (EPLB: :mod:`.eplb`)."""

from __future__ import annotations

import numpy as np

from ..modes import ServingMode
from ..placement import Placement
from .base import PlacementPolicy, Progress, check_redundant
from .eplb import balanced_packing as eplb_packing
from .eplb import expert_loads  # noqa: F401  (re-exported: the solvers' load counts)


def contiguous_placement(num_layers: int, num_experts: int, ep_size: int) -> np.ndarray:
    """``[L, N]``: expert ``n`` on device ``n // (N/E)`` (vLLM ``linear``, SGLang default)."""
    row = np.arange(num_experts) // (num_experts // ep_size)
    return np.tile(row, (num_layers, 1))


def round_robin_placement(num_layers: int, num_experts: int, ep_size: int) -> np.ndarray:
    """``[L, N]``: expert ``n`` on device ``n mod E`` (vLLM ``round_robin``)."""
    return np.tile(np.arange(num_experts) % ep_size, (num_layers, 1))


def balanced_packing(weight: np.ndarray, num_packs: int) -> np.ndarray:
    """``[L, N]`` int64 pack of each item: DeepSeek EPLB's packing (:func:`.eplb.balanced_packing`,
    heaviest item first into the lightest pack with room, equal item counts) of ``weight`` ``[L, N]``."""
    return eplb_packing(weight, num_packs)[0]


class VanillaPolicy(PlacementPolicy):
    """Contiguous blocks of experts per device (vLLM/SGLang default)."""

    name = "vanilla"

    def solve(self, profile, ep_size, *, mode=ServingMode.TP, seed=0, redundant=0, progress: Progress = None):
        check_redundant(redundant, profile.num_experts, ep_size, self.name)
        e2d = contiguous_placement(profile.num_layers, profile.num_experts, ep_size)
        return Placement(e2d, ep_size, self.name)


class RoundRobinPolicy(PlacementPolicy):
    """Expert ``n`` on device ``n mod E`` (vLLM's ``--expert-placement-strategy round_robin``)."""

    name = "round_robin"

    def solve(self, profile, ep_size, *, mode=ServingMode.TP, seed=0, redundant=0, progress: Progress = None):
        check_redundant(redundant, profile.num_experts, ep_size, self.name)
        e2d = round_robin_placement(profile.num_layers, profile.num_experts, ep_size)
        return Placement(e2d, ep_size, self.name)
