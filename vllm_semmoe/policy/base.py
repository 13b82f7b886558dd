"""The one interface every placement policy implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Optional

from ..placement import Placement
from ..trace import RoutingTrace

#: ``progress(done, total, message)``: called by long solvers; may be ``None``.
Progress = Optional[Callable[[int, int, str], None]]


class PlacementPolicy(ABC):
    """Decides expert→device for every MoE layer from a profiled routing trace.

    Implementations are pure (NumPy/Numba/HiGHS, no vLLM) and deterministic for a seed.
    """

    #: registry name, used by ``semmoe solve --method``
    name: str = ""

    @abstractmethod
    def solve(
        self,
        profile: RoutingTrace,
        ep_size: int,
        *,
        mode: str = "tp",
        seed: int = 0,
        progress: Progress = None,
    ) -> Placement:
        """Return a balanced :class:`Placement` (exactly N/E experts per device per layer).

        ``mode`` is the serving mode the placement is for (``"tp"``: tokens are scheduled per
        layer; ``"dp"``: whole requests stay on one rank); policies without a data-scheduling
        side ignore it.
        """
