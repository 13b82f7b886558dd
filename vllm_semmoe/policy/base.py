"""The one interface every placement policy implements."""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import Callable, Optional

from ..placement import Placement, check_ep_size
from ..trace import RoutingTrace

#: ``progress(done, total, message)``: called by long solvers; may be ``None``.
Progress = Optional[Callable[[int, int, str], None]]


class PlacementPolicy(ABC):
    """Decides expert→device for every MoE layer from a profiled routing trace.

    Implementations are pure (NumPy/Numba/HiGHS, no vLLM) and deterministic for a seed.
    """

    #: registry name, used by ``semmoe solve --method``
    name: str = ""

    def __init_subclass__(cls, **kwargs):
        """Every implementation's :meth:`solve` first checks the EP size against the trace
        (:func:`~vllm_semmoe.placement.check_ep_size`), so no solver sees an impossible one."""
        super().__init_subclass__(**kwargs)
        solve = cls.__dict__.get("solve")
        if solve is not None and not getattr(solve, "_checks_ep_size", False):
            @functools.wraps(solve)
            def checked_solve(self, profile, ep_size, *args, **kw):
                check_ep_size(profile.num_experts, ep_size)
                return solve(self, profile, ep_size, *args, **kw)

            checked_solve._checks_ep_size = True
            cls.solve = checked_solve

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
