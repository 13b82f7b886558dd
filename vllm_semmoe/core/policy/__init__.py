"""Placement policies: pluggable algorithms behind :class:`PlacementPolicy`.

Pure NumPy/Numba/HiGHS; nothing here imports vLLM.
"""

from __future__ import annotations

from .base import PlacementPolicy, Progress
from .eplb import EplbPolicy
from .moetuner import MoETunerPolicy
from .semmoe import SemMoEPolicy
from .simple import RoundRobinPolicy, VanillaPolicy

POLICIES: dict[str, type[PlacementPolicy]] = {
    p.name: p for p in (VanillaPolicy, RoundRobinPolicy, EplbPolicy, MoETunerPolicy, SemMoEPolicy)
}


def get_policy(name: str) -> PlacementPolicy:
    """Instantiate the policy registered as ``name``; ``ValueError`` lists the valid names."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown placement method {name!r}; choose from {', '.join(POLICIES)}") from None


__all__ = ["POLICIES", "PlacementPolicy", "Progress", "get_policy"]
