"""Expert placement: which device holds which expert at every MoE layer.

A :class:`Placement` is what every solver in :mod:`vllm_semmoe.core.policy` returns and what the
vLLM adapter applies. Every logical expert has one *home* device (``expert_device``, exactly
``N/E`` per device); with ``R`` redundant slots per device (replication for locality), device
``d`` also holds copies of ``R`` other experts (``replicas[l, d]``).

Physical layout (vLLM's ``linear`` expert map, and vLLM EPLB's ``num_redundant_experts``
layout with ``num_redundant_experts = E * R``): device ``d`` owns the ``n + R`` physical slots
``d*(n+R) .. (d+1)*(n+R) - 1`` with ``n = N / E``: first its ``n`` home experts in ascending
logical id, then its ``R`` replicas in ascending logical id. ``physical_to_logical()`` is
EPLB's ``physical_to_logical_map`` ``[L, E*(n+R)]``; ``logical_to_physical_map()`` and
``replica_count()`` are its ``logical_to_physical_map`` / ``logical_replica_count``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np


class PlacementError(ValueError):
    """An expert placement violates its invariants; the message says which."""


def valid_ep_sizes(num_experts: int) -> list[int]:
    """EP sizes that split ``num_experts`` evenly (the divisors of N)."""
    return [e for e in range(1, num_experts + 1) if num_experts % e == 0]


def check_ep_size(num_experts: int, ep_size: int, *, option: str = "--ep") -> None:
    """Raise :class:`PlacementError` unless ``ep_size`` devices can each hold N/E experts.

    Every policy runs this before solving (see :class:`~vllm_semmoe.core.policy.base.PlacementPolicy`),
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
        replicas: ``[L, E, R]`` int16, logical expert copied into each of device ``d``'s ``R``
            redundant slots (never one of ``d``'s home experts, no duplicates on a device);
            ``None`` or ``R = 0``: no replication.
    """

    expert_device: np.ndarray
    ep_size: int
    method: str = ""
    replicas: np.ndarray | None = None

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
        object.__setattr__(self, "replicas", _check_replicas(self.replicas, e2d, E))

    @property
    def num_layers(self) -> int:
        return self.expert_device.shape[0]

    @property
    def num_experts(self) -> int:
        return self.expert_device.shape[1]

    @property
    def redundant(self) -> int:
        """R, redundant (replica) slots per device."""
        return int(self.replicas.shape[2])

    @property
    def experts_per_device(self) -> int:
        """Physical expert slots per device, ``N/E + R`` (what each EP rank allocates)."""
        return self.num_experts // self.ep_size + self.redundant

    @property
    def num_physical_experts(self) -> int:
        """``E * (N/E + R)`` = ``N + E*R`` (vLLM's ``num_physical_experts``)."""
        return self.ep_size * self.experts_per_device

    def holds(self) -> np.ndarray:
        """``[L, N, E]`` bool: device ``e`` holds a copy (home or replica) of expert ``n``."""
        L, N, E = self.num_layers, self.num_experts, self.ep_size
        out = np.zeros((L, N, E), bool)
        rows = np.arange(L)[:, None]
        out[rows, np.arange(N)[None, :], self.expert_device] = True
        if self.redundant:
            devices = np.broadcast_to(np.arange(E)[None, :, None], self.replicas.shape)
            out[np.broadcast_to(rows[:, :, None], self.replicas.shape), self.replicas, devices] = True
        return out

    def replica_count(self) -> np.ndarray:
        """``[L, N]`` int64: copies of each logical expert (vLLM's ``logical_replica_count``)."""
        return self.holds().sum(axis=2).astype(np.int64)

    def physical_to_logical(self) -> np.ndarray:
        """``[L, E*(N/E+R)]`` int64: logical expert stored in each physical slot.

        Apply it as ``w13[l] = w13_logical[l][p2l[l]]``; with ``R = 0`` it is a permutation and
        ``router_logits_physical = router_logits_logical[:, p2l[l]]``.
        """
        # stable sort by device keeps logical ids ascending inside a device
        home = np.argsort(self.expert_device, axis=1, kind="stable")
        if not self.redundant:
            return home
        L, E, n = self.num_layers, self.ep_size, self.num_experts // self.ep_size
        home = home.reshape(L, E, n)
        extra = np.sort(self.replicas.astype(np.int64), axis=2)
        return np.concatenate([home, extra], axis=2).reshape(L, E * (n + self.redundant))

    def logical_to_physical(self) -> np.ndarray:
        """``[L, N]`` int64: physical slot of each logical expert's home copy (with ``R = 0``,
        the inverse of :meth:`physical_to_logical`)."""
        return self.logical_to_physical_map()[:, :, 0]

    def logical_to_physical_map(self) -> np.ndarray:
        """``[L, N, 1 + E*R]`` int64: physical slots of every copy of each logical expert, home
        slot first, then replica slots ascending, padded with ``-1`` (vLLM EPLB's
        ``logical_to_physical_map``, whose width is ``num_redundant_experts + 1``)."""
        p2l = self.physical_to_logical()
        L, P = p2l.shape
        N, n, R = self.num_experts, self.num_experts // self.ep_size, self.redundant
        out = np.full((L, N, 1 + self.ep_size * R), -1, np.int64)
        fill = np.zeros((L, N), np.int64)
        is_home = (np.arange(P) % (n + R)) < n
        for p in np.concatenate([np.nonzero(is_home)[0], np.nonzero(~is_home)[0]]):
            rows = np.arange(L)
            out[rows, p2l[:, p], fill[rows, p2l[:, p]]] = p
            fill[rows, p2l[:, p]] += 1
        return out

    def device_map(self, device: int | None) -> np.ndarray:
        """``[L, N]`` int64: the physical slot each logical expert is served from for tokens on
        ``device``: the device's own copy (home or replica) where it holds one, else the
        expert's home slot. ``None``: home slots for every token (:meth:`logical_to_physical`).

        Which activations are local on ``device`` (a replica serves the tokens of the device
        holding it): :meth:`serving_device` picks the same local copies and differs only in
        *which* remote copy serves a remote activation (here always the home copy), so the
        local count is the same.
        """
        copies = self.logical_to_physical_map()  # [L, N, C] physical slots, home first, -1 padded
        if device is None or not self.redundant:
            return copies[:, :, 0]
        if not 0 <= int(device) < self.ep_size:
            raise ValueError(f"device {device} outside [0, {self.ep_size})")
        mine = (copies >= 0) & (copies // self.experts_per_device == int(device))
        local = np.take_along_axis(copies, mine.argmax(axis=2)[..., None], axis=2)[..., 0]
        return np.where(mine.any(axis=2), local, copies[:, :, 0])

    def serving_device(self, experts: np.ndarray, token_device: np.ndarray) -> np.ndarray:
        """Which device computes each activation, given where its token is.

        The token's own device where it holds a copy of the expert (home or replica): the
        activation is local. Otherwise one of the expert's copies (:func:`_serving_kernel`):
        a copy on a device the token is sent to anyway (for another of its experts), since the
        dispatch sends a token once per destination device; failing that, the copy at index
        ``position mod copies`` of the expert's copies in :meth:`logical_to_physical_map`
        order (home first), as vLLM's EPLB spreads tokens over replicas
        (``eplb_map_to_physical_and_record``), ``position`` being the activation's flat index
        ``row * K + slot`` in ``experts``. With ``R = 0`` this is the expert's home device.

        Args:
            experts: ``[T, L, K]`` logical experts of each token at each layer.
            token_device: ``[T, L]`` device each token sits on at each layer.
        Returns:
            ``[T, L, K]`` int64 device computing each activation.
        """
        experts = np.asarray(experts, np.int64)
        device = np.asarray(token_device, np.int64)
        if experts.ndim != 3 or device.shape != experts.shape[:2] or experts.shape[1] != self.num_layers:
            raise ValueError(f"experts must be [T, L={self.num_layers}, K] and token_device [T, L]; "
                             f"got {experts.shape} and {device.shape}")
        if not self.redundant:
            return self.expert_device.astype(np.int64)[np.arange(self.num_layers)[None, :, None], experts]
        copies = self.logical_to_physical_map()  # [L, N, C] physical slots, home first, -1 padded
        copy_device = np.where(copies >= 0, copies // self.experts_per_device, -1)
        return _serving_kernel(experts, device, copy_device, self.replica_count(), self.ep_size)

    @classmethod
    def from_physical_to_logical(cls, p2l: np.ndarray, ep_size: int, method: str = "",
                                 num_experts: int | None = None) -> "Placement":
        """Inverse of :meth:`physical_to_logical`: device ``d`` owns slots
        ``d*(n+R) .. (d+1)*(n+R)-1``, the first ``n`` being home copies.

        ``num_experts`` (N) defaults to the slot count (``R = 0``); give it when ``R > 0``.
        """
        p2l = np.asarray(p2l, np.int64)
        L, P = p2l.shape
        N = P if num_experts is None else int(num_experts)
        E = int(ep_size)
        if E < 1 or P % E or N % E or P < N:
            raise PlacementError(f"physical_to_logical of width {P} does not fit {N} experts on ep_size={E}")
        n, R = N // E, (P - N) // E
        per_device = p2l.reshape(L, E, n + R)
        e2d = np.full((L, N), -1, np.int64)
        rows = np.arange(L)[:, None]
        e2d[rows, per_device[:, :, :n].reshape(L, N)] = (np.arange(N) // n)[None, :]
        if (e2d < 0).any():
            raise PlacementError("physical_to_logical: some logical expert has no home slot")
        return cls(e2d, E, method, per_device[:, :, n:] if R else None)


def _check_replicas(replicas, e2d: np.ndarray, ep_size: int) -> np.ndarray:
    """Validate ``[L, E, R]`` replica ids against the home placement; ``None`` → ``R = 0``."""
    L, N = e2d.shape
    if replicas is None:
        return np.zeros((L, ep_size, 0), np.int16)
    rep = np.asarray(replicas)
    if rep.ndim != 3 or rep.shape[:2] != (L, ep_size):
        raise PlacementError(f"replicas: expected shape [L={L}, E={ep_size}, R], got {rep.shape}")
    R = rep.shape[2]
    if R and (rep.min() < 0 or rep.max() >= N):
        raise PlacementError(f"replicas: expert ids must be in [0, {N}), got {rep.min()}..{rep.max()}")
    if R > N - N // ep_size:
        raise PlacementError(f"{R} redundant slots per device exceed the {N - N // ep_size} experts a device lacks")
    rep = rep.astype(np.int64)
    if R:
        home = np.take_along_axis(e2d.astype(np.int64), rep.reshape(L, -1), axis=1).reshape(rep.shape)
        bad = np.argwhere(home == np.arange(ep_size)[None, :, None])
        if len(bad):
            l, d, r = bad[0]
            raise PlacementError(f"layer {l}: device {d} replicates expert {rep[l, d, r]}, which it already holds")
        srt = np.sort(rep, axis=2)
        dup = np.argwhere(srt[:, :, 1:] == srt[:, :, :-1])
        if len(dup):
            l, d, _ = dup[0]
            raise PlacementError(f"layer {l}: device {d} holds two copies of one replicated expert")
    return rep.astype(np.int16)


@numba.njit(cache=True)
def _serving_kernel(experts, device, copy_device, count, ep_size):
    """:meth:`Placement.serving_device` with replicas, one (token, layer) at a time.

    experts ``[T, L, K]``, device ``[T, L]``, copy_device ``[L, N, C]`` (devices holding each
    expert, home first, ``-1`` padded), count ``[L, N]`` copies. Three passes per (token,
    layer): local copies; experts with a single copy (their home: the token goes there
    anyway); then each remaining activation, in slot order, to the first of its copies the
    token already goes to, else to copy ``(t*K + k) mod count``.
    """
    T, L, K = experts.shape
    out = np.empty((T, L, K), np.int64)
    sent = np.zeros(ep_size, np.bool_)
    for t in range(T):
        for l in range(L):
            d = device[t, l]
            sent[:] = False
            pending = 0
            for k in range(K):
                e = experts[t, l, k]
                out[t, l, k] = -1
                for c in range(count[l, e]):
                    if copy_device[l, e, c] == d:
                        out[t, l, k] = d
                if out[t, l, k] < 0:
                    if count[l, e] == 1:
                        out[t, l, k] = copy_device[l, e, 0]
                        sent[copy_device[l, e, 0]] = True
                    else:
                        pending += 1
            if pending == 0:
                continue
            for k in range(K):
                if out[t, l, k] >= 0:
                    continue
                e = experts[t, l, k]
                for c in range(count[l, e]):
                    if sent[copy_device[l, e, c]]:
                        out[t, l, k] = copy_device[l, e, c]
                        break
                if out[t, l, k] < 0:
                    out[t, l, k] = copy_device[l, e, (t * K + k) % count[l, e]]
                    sent[out[t, l, k]] = True
    return out
