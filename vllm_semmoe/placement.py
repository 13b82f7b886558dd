"""Expert placement: which device holds which expert at every MoE layer.

A :class:`Placement` is what every solver in :mod:`vllm_semmoe.policy` returns and what the
vLLM adapter applies. Physical layout convention (vLLM's ``linear`` expert map): device ``d``
owns physical expert slots ``d*n .. (d+1)*n - 1`` with ``n = N / E``; within a device, logical
experts are kept in ascending id order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class PlacementError(ValueError):
    """An expert placement violates its invariants; the message says which."""


def valid_ep_sizes(num_experts: int) -> list[int]:
    """EP sizes that split ``num_experts`` evenly (the divisors of N)."""
    return [e for e in range(1, num_experts + 1) if num_experts % e == 0]


def check_ep_size(num_experts: int, ep_size: int, *, option: str = "--ep") -> None:
    """Raise :class:`PlacementError` unless ``ep_size`` devices can each hold N/E experts.

    Every policy runs this before solving (see :class:`~vllm_semmoe.policy.base.PlacementPolicy`),
    so a bad ``--ep`` is one line naming the valid sizes for every method.
    """
    if isinstance(ep_size, bool) or not isinstance(ep_size, (int, np.integer)) or ep_size < 1:
        raise PlacementError(f"{option} must be an integer >= 1, got {ep_size!r}")
    valid = ", ".join(map(str, valid_ep_sizes(num_experts)))
    if ep_size > num_experts:
        raise PlacementError(f"{option} {ep_size} exceeds the {num_experts} experts per layer; "
                             f"choose one of {valid}")
    if num_experts % ep_size:
        raise PlacementError(f"{option} {ep_size} does not divide the {num_experts} experts per layer evenly; "
                             f"choose one of {valid}")


@dataclass(frozen=True)
class Placement:
    """Expert→device map for every MoE layer.

    Attributes:
        expert_device: ``[L, N]`` int16, device of each logical expert.
        ep_size: E, number of expert-parallel devices; every device holds exactly N/E experts
            of every layer.
        method: name of the policy that produced it.
    """

    expert_device: np.ndarray
    ep_size: int
    method: str = ""

    def __post_init__(self):
        e2d = np.asarray(self.expert_device)
        if e2d.ndim != 2:
            raise PlacementError(f"expert_device: expected [L, N], got shape {e2d.shape}")
        L, N = e2d.shape
        E = int(self.ep_size)
        if E < 1 or N % E:
            raise PlacementError(f"{N} experts cannot be split evenly over ep_size={E}")
        if e2d.size and (e2d.min() < 0 or e2d.max() >= E):
            raise PlacementError(f"expert_device: device ids must be in [0, {E}), got {e2d.min()}..{e2d.max()}")
        per_device = np.stack([np.bincount(row, minlength=E) for row in e2d]) if L else np.zeros((0, E))
        bad = np.argwhere(per_device != N // E)
        if len(bad):
            l, d = bad[0]
            raise PlacementError(
                f"layer {l}: device {d} holds {per_device[l, d]} experts, expected exactly {N // E}"
            )
        object.__setattr__(self, "expert_device", e2d.astype(np.int16))
        object.__setattr__(self, "ep_size", E)

    @property
    def num_layers(self) -> int:
        return self.expert_device.shape[0]

    @property
    def num_experts(self) -> int:
        return self.expert_device.shape[1]

    @property
    def experts_per_device(self) -> int:
        return self.num_experts // self.ep_size

    def physical_to_logical(self) -> np.ndarray:
        """``[L, N]`` int64: logical expert stored in each physical slot.

        Apply it as ``w13[l] = w13_logical[l][p2l[l]]`` and
        ``router_logits_physical = router_logits_logical[:, p2l[l]]``.
        """
        # stable sort by device keeps logical ids ascending inside a device
        return np.argsort(self.expert_device, axis=1, kind="stable")

    def logical_to_physical(self) -> np.ndarray:
        """``[L, N]`` int64: physical slot of each logical expert (inverse of the above)."""
        p2l = self.physical_to_logical()
        l2p = np.empty_like(p2l)
        rows = np.arange(self.num_layers)[:, None]
        l2p[rows, p2l] = np.arange(self.num_experts)[None, :]
        return l2p

    @classmethod
    def from_physical_to_logical(cls, p2l: np.ndarray, ep_size: int, method: str = "") -> "Placement":
        """Inverse of :meth:`physical_to_logical`: slot ``p`` lives on device ``p // (N/E)``."""
        p2l = np.asarray(p2l)
        L, N = p2l.shape
        e2d = np.empty((L, N), np.int16)
        rows = np.arange(L)[:, None]
        e2d[rows, p2l] = (np.arange(N) // (N // ep_size))[None, :]
        return cls(e2d, ep_size, method)
