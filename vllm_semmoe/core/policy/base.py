"""The one interface every placement policy implements."""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import Callable, Optional

from ..modes import ServingMode
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
    #: whether ``solve`` can fill ``redundant > 0`` replica slots per device
    supports_redundant: bool = False
    #: whether the policy also schedules data (tokens in mode ``tp``, requests in mode ``dp``) with
    #: tables built for its placement; ``False``: placement only, data stays where vLLM puts it
    schedules_data: bool = False

    def __init_subclass__(cls, **kwargs):
        """Every implementation's :meth:`solve` first checks the EP size against the trace
        (:func:`~vllm_semmoe.core.placement.check_ep_size`), so no solver sees an impossible one."""
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
        mode: str = ServingMode.TP,
        seed: int = 0,
        redundant: int = 0,
        progress: Progress = None,
    ) -> Placement:
        """Return a balanced :class:`Placement` (exactly N/E home experts per device per layer,
        plus ``redundant`` replica slots per device where the policy supports replication).

        ``mode`` is the serving mode the placement is for (``"tp"``: tokens are scheduled per
        layer; ``"dp"``: whole requests stay on one rank); policies that schedule no data
        (:attr:`schedules_data` false) ignore it.
        """


def check_redundant(redundant: int, num_experts: int, ep_size: int, policy: str = "") -> None:
    """Raise :class:`PlacementError` if ``redundant`` replica slots per device are not possible
    (negative, more than the experts a device lacks, or asked of a policy without replication)."""
    from ..placement import PlacementError

    if redundant < 0:
        raise PlacementError(f"redundant slots per device must be >= 0, got {redundant}")
    if policy and redundant:
        raise PlacementError(f"the {policy} placement does not replicate experts; use --redundant 0 "
                             "or --method semmoe or eplb")
    if redundant > num_experts - num_experts // ep_size:
        raise PlacementError(f"{redundant} redundant slots per device exceed the "
                             f"{num_experts - num_experts // ep_size} experts a device does not hold")
