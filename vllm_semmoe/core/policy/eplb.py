"""DeepSeek's expert-parallelism load balancer (EPLB) with redundant experts, as vLLM serves it.

The algorithm is DeepSeek's ``eplb.py`` (github.com/deepseek-ai/EPLB), which vLLM copies into
``vllm/distributed/eplb/policy/default.py`` and runs for ``--enable-eplb`` with
``num_redundant_experts``; step for step:

1. :func:`replicate_experts`: the ``E*R`` redundant slots go, one at a time, to the expert with
   the largest load per copy;
2. :func:`balanced_packing` of the ``N + E*R`` physical experts (each copy carrying its expert's
   load over its copies) onto ``E`` ranks of ``N/E + R`` slots: heaviest first, into the lightest
   rank with a free slot;
3. :func:`rebalance_experts`: both steps with the global policy. DeepSeek's hierarchical policy
   first packs expert groups onto nodes; a :class:`~vllm_semmoe.core.placement.Placement` has no node
   groups, and on one node (vLLM's ``num_nodes = 1``) the hierarchical policy is the global one
   up to the order in which equal loads are visited.

Equal loads are visited in ascending id (a stable sort; DeepSeek's ``torch.sort`` leaves their
order unspecified). With ``R = 0`` step 1 does nothing: the placement packs the experts
themselves, one copy each (with ``N = E``, DeepSeek's packing keeps expert ``i`` on rank ``i``).

DeepSeek's map may hold what a ``Placement`` cannot: two copies of one expert on one rank, more
copies of an expert than ranks, or ranks whose one-copy experts exceed ``N/E`` (every expert needs
one home rank, each rank exactly ``N/E`` homes). :func:`to_placement` maps it with the fewest
changes (its docstring lists them), each chosen by load, and :func:`rank_loads` /
:func:`load_imbalance` measure both maps on the same loads.

How vLLM serves replicas (``eplb_map_to_physical_and_record`` in
``vllm/model_executor/layers/fused_moe/router/base_router.py``): a token takes replica
``(row * 2654435769 mod 2^32) mod copies`` of each of its experts, ``row`` being its row in the
rank's batch and the copies listed in ascending physical slot; where the token sits plays no
part. :func:`vllm_serving_device` applies that rule.

NumPy only; nothing here imports vLLM or torch.
"""

from __future__ import annotations

import numpy as np

from ..placement import Placement, PlacementError
from ..trace import RoutingTrace
from .base import PlacementPolicy, Progress, check_redundant

#: vLLM's replica hash multiplier, ``floor(2^32 / golden ratio)`` (Knuth's multiplicative hash)
KNUTH_MULTIPLIER = 2654435769


def expert_loads(profile: RoutingTrace) -> np.ndarray:
    """``[L, N]`` int64: activation count of every expert in the profile."""
    L, N = profile.num_layers, profile.num_experts
    flat = profile.experts.transpose(1, 0, 2).reshape(L, -1).astype(np.int64)
    return np.stack([np.bincount(flat[l], minlength=N) for l in range(L)])


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack ``n`` weighted items into ``num_packs`` packs of exactly ``n / num_packs`` items each,
    balancing the packs' total weight: heaviest item first, into the lightest pack with room.

    Args:
        weight: ``[X, n]`` item weights, one packing per row.
        num_packs: number of packs; must divide ``n``.
    Returns:
        ``(pack_index [X, n], rank_in_pack [X, n])`` int64: each item's pack and its position in
        that pack (the order it was packed in).
    """
    weight = np.asarray(weight, np.float64)
    X, n = weight.shape
    if n % num_packs:
        raise ValueError(f"{n} items cannot be split evenly into {num_packs} packs")
    per_pack = n // num_packs
    if per_pack == 1:
        return np.tile(np.arange(n, dtype=np.int64), (X, 1)), np.zeros((X, n), np.int64)
    pack_index = np.full((X, n), -1, np.int64)
    rank_in_pack = np.full((X, n), -1, np.int64)
    for i in range(X):
        load = np.zeros(num_packs)
        items = np.zeros(num_packs, np.int64)
        for item in np.argsort(-weight[i], kind="stable"):
            open_packs = np.flatnonzero(items < per_pack)
            pack = open_packs[np.argmin(load[open_packs])]
            pack_index[i, item] = pack
            rank_in_pack[i, item] = items[pack]
            load[pack] += weight[i, item]
            items[pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replicate ``num_log`` experts into ``num_phy >= num_log`` physical experts, each extra copy
    to the expert whose load per copy is then the largest (minimising the heaviest copy).

    Args:
        weight: ``[X, num_log]`` expert loads.
        num_phy: physical experts after replication.
    Returns:
        ``(phy2log [X, num_phy], rank [X, num_phy], logcnt [X, num_log])`` int64: the logical
        expert of each physical one (the first ``num_log`` are the experts themselves), which copy
        of its expert it is, and each expert's number of copies.
    """
    weight = np.asarray(weight, np.float64)
    X, num_log = weight.shape
    if num_phy < num_log:
        raise ValueError(f"{num_phy} physical experts cannot hold {num_log} logical ones")
    phy2log = np.tile(np.arange(num_phy, dtype=np.int64), (X, 1))
    rank = np.zeros((X, num_phy), np.int64)
    logcnt = np.ones((X, num_log), np.int64)
    rows = np.arange(X)
    for i in range(num_log, num_phy):
        hottest = np.argmax(weight / logcnt, axis=1)
        phy2log[:, i] = hottest
        rank[:, i] = logcnt[rows, hottest]
        logcnt[rows, hottest] += 1
    return phy2log, rank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    """``[X, n]`` inverse of each row's permutation."""
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def rebalance_experts(weight: np.ndarray, num_replicas: int, num_gpus: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DeepSeek EPLB's global policy: replicate, then pack the physical experts onto GPUs.

    Args:
        weight: ``[L, N]`` load of every logical expert.
        num_replicas: physical experts ``P``, a multiple of ``num_gpus`` (``N + E*R``).
        num_gpus: EP ranks ``E``; rank ``g`` holds physical slots ``g*P/E .. (g+1)*P/E - 1``.
    Returns:
        ``(phy2log [L, P], log2phy [L, N, C], logcnt [L, N])``: the logical expert in each
        physical slot, the slots of each logical expert's copies (``-1`` padded, ``C`` the most
        copies), and each expert's number of copies.
    """
    weight = np.asarray(weight, np.float64)
    L, N = weight.shape
    if num_replicas % num_gpus:
        raise ValueError(f"{num_replicas} physical experts cannot be split evenly over {num_gpus} ranks")
    per_gpu = num_replicas // num_gpus
    phy2log, phyrank, logcnt = replicate_experts(weight, num_replicas)
    tokens_per_phy = np.take_along_axis(weight / logcnt, phy2log, axis=1)
    pack_index, rank_in_pack = balanced_packing(tokens_per_phy, num_gpus)
    pphy2phy = _inverse(pack_index * per_gpu + rank_in_pack)
    pphy2log = np.take_along_axis(phy2log, pphy2phy, axis=1)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, axis=1)
    log2phy = np.full((L, N, int(logcnt.max())), -1, np.int64)
    rows = np.broadcast_to(np.arange(L)[:, None], pphy2log.shape)
    log2phy[rows, pphy2log, pphyrank] = np.broadcast_to(np.arange(num_replicas), pphy2log.shape)
    return pphy2log, log2phy, logcnt


def rank_loads(phy2log: np.ndarray, weight: np.ndarray, num_gpus: int) -> np.ndarray:
    """``[L, E]`` load of every rank when each copy of an expert takes an equal share of its load.

    Args:
        phy2log: ``[L, P]`` logical expert in each physical slot (rank ``p // (P/E)``).
        weight: ``[L, N]`` expert loads.
    """
    phy2log = np.asarray(phy2log, np.int64)
    L, P = phy2log.shape
    copies = np.stack([np.bincount(row, minlength=weight.shape[1]) for row in phy2log])
    share = np.take_along_axis(np.asarray(weight, np.float64) / np.maximum(copies, 1), phy2log, axis=1)
    return share.reshape(L, num_gpus, P // num_gpus).sum(axis=2)


def load_imbalance(loads: np.ndarray) -> float:
    """Mean over layers of max/mean rank load; ``loads`` ``[L, E]``."""
    loads = np.asarray(loads, np.float64)
    return float((loads.max(axis=1) / np.maximum(loads.mean(axis=1), 1e-12)).mean())


def to_placement(phy2log: np.ndarray, weight: np.ndarray, num_gpus: int, method: str = "eplb") -> Placement:
    """A :class:`Placement` holding ``phy2log`` (``[L, E*(N/E+R)]``, DeepSeek's map) with the
    fewest changes, layer by layer:

    1. an expert with more than ``E`` copies gives each surplus copy (taken from a rank holding it
       twice) to the expert with the largest load per copy among those the rank lacks and that
       have fewer than ``E`` copies (:func:`replicate_experts`' rule under the cap);
    2. a rank holding an expert twice swaps one copy with an expert of another rank that lacks it
       (and that it lacks), choosing the swap that leaves the heavier of the two ranks lightest,
       then the closest load;
    3. every expert gets a home among the ranks holding it, ``N/E`` per rank (a maximum
       bipartite matching, one-copy experts first). Where none exists, a copy of an expert that
       cannot get one moves to a rank with a free home, swapped against that rank's replica that
       leaves the heavier of the two ranks lightest, until one does.

    Ranks keep their ``N/E + R`` slots and every expert its copy count except in step 1, so on
    DeepSeek's maps without such conflicts this is the identity on the expert→ranks map.
    """
    phy2log = np.asarray(phy2log, np.int64)
    weight = np.asarray(weight, np.float64)
    L, P = phy2log.shape
    N, E = weight.shape[1], int(num_gpus)
    if P % E or N % E or P < N:
        raise PlacementError(f"physical_to_logical of width {P} does not fit {N} experts on {E} ranks")
    n, R = N // E, (P - N) // E
    expert_device = np.empty((L, N), np.int64)
    replicas = np.empty((L, E, R), np.int64)
    for l in range(L):
        slots = [list(phy2log[l, g * (n + R):(g + 1) * (n + R)]) for g in range(E)]
        copies = np.bincount(phy2log[l], minlength=N)
        _cap_copies(slots, copies, weight[l], E, l)
        _split_duplicates(slots, copies, weight[l], E, l)
        home = _assign_homes(slots, copies, weight[l], n, l)
        expert_device[l] = home
        for g in range(E):
            replicas[l, g] = sorted(e for e in slots[g] if home[e] != g)
    return Placement(expert_device, E, method, replicas if R else None)


def _loads(slots: list, copies: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """``[E]`` rank loads, each copy taking ``weight / copies`` of its expert."""
    return np.array([sum(weight[e] / copies[e] for e in s) for s in slots])


def _cap_copies(slots, copies, weight, E, layer) -> None:
    """Step 1 of :func:`to_placement`, in place."""
    while copies.max() > E:
        e = int(np.argmax(copies > E))
        g = max(range(E), key=lambda r: (slots[r].count(e), -r))
        free = [f for f in range(len(copies)) if copies[f] < E and f not in slots[g]]
        if not free:
            raise PlacementError(f"layer {layer}: expert {e} has {copies[e]} copies on {E} ranks and no other "
                                 "expert can take its surplus slot; use fewer redundant slots (--redundant)")
        f = max(free, key=lambda x: (weight[x] / copies[x], -x))
        slots[g][slots[g].index(e)] = f
        copies[e] -= 1
        copies[f] += 1


def _split_duplicates(slots, copies, weight, E, layer) -> None:
    """Step 2 of :func:`to_placement`, in place."""
    share = weight / np.maximum(copies, 1)
    for g in range(E):
        while len(set(slots[g])) < len(slots[g]):
            e = min(x for x in slots[g] if slots[g].count(x) > 1)
            loads = _loads(slots, copies, weight)
            best = None
            for h in range(E):
                if h == g or e in slots[h]:
                    continue
                for y in sorted(set(slots[h]) - set(slots[g])):
                    key = (max(loads[g] - share[e] + share[y], loads[h] - share[y] + share[e]),
                           abs(share[e] - share[y]), h, y)
                    best = key if best is None or key < best else best
            if best is None:
                raise PlacementError(f"layer {layer}: rank {g} holds expert {e} twice and no swap can separate "
                                     "them; use fewer redundant slots (--redundant)")
            _, _, h, y = best
            slots[g][slots[g].index(e)] = y
            slots[h][slots[h].index(y)] = e


def _match_homes(slots, copies, n) -> tuple[np.ndarray, list]:
    """Maximum matching of experts to home ranks (``n`` per rank) among the ranks holding them,
    by augmenting paths; one-copy experts first, then ascending copies and id. Returns
    ``(home [N], -1 where none; homed [E] experts per rank)``."""
    N, E = len(copies), len(slots)
    holders = [[g for g in range(E) if e in slots[g]] for e in range(N)]
    home = np.full(N, -1, np.int64)
    homed = [[] for _ in range(E)]

    def place(e, seen):
        for g in holders[e]:
            if g in seen:
                continue
            seen.add(g)
            if len(homed[g]) < n:
                homed[g].append(e)
                home[e] = g
                return True
            for i, x in enumerate(homed[g]):
                if place(x, seen):  # x found a home on another rank: e takes its place here
                    homed[g][i] = e
                    home[e] = g
                    return True
        return False

    for e in sorted(range(N), key=lambda x: (copies[x], x)):
        place(e, set())
    return home, homed


def _assign_homes(slots, copies, weight, n, layer) -> np.ndarray:
    """Step 3 of :func:`to_placement`: ``[N]`` home rank of every expert (``slots`` may change)."""
    N, E = len(copies), len(slots)
    share = weight / np.maximum(copies, 1)
    for _ in range(N + 1):
        home, homed = _match_homes(slots, copies, n)
        if (home >= 0).all():
            return home
        # the ranks and experts an unhomed expert reaches by alternating copies and homes: every
        # such rank is full, and every such expert has all its copies among them
        u = int(np.argmax(home < 0))
        ranks, experts, frontier = set(), {u}, [u]
        while frontier:
            e = frontier.pop()
            for g in range(E):
                if e in slots[g] and g not in ranks:
                    ranks.add(g)
                    new = [x for x in homed[g] if x not in experts]
                    experts.update(new)
                    frontier += new
        loads = _loads(slots, copies, weight)
        best = None
        for f in (g for g in range(E) if len(homed[g]) < n):
            for x in sorted(experts):
                for a in sorted(g for g in ranks if x in slots[g]):
                    for y in sorted(y for y in slots[f] if home[y] != f and y not in slots[a]):
                        key = (max(loads[a] - share[x] + share[y], loads[f] - share[y] + share[x]),
                               abs(share[x] - share[y]), f, x, a, y)
                        best = key if best is None or key < best else best
        if best is None:
            break
        _, _, f, x, a, y = best
        slots[a][slots[a].index(x)] = y
        slots[f][slots[f].index(y)] = x
    raise PlacementError(f"layer {layer}: no rank assignment gives every expert a home rank with "
                         f"{n} per rank; use fewer redundant slots (--redundant)")


def eplb_placement(weight: np.ndarray, ep_size: int, redundant: int = 0, method: str = "eplb") -> Placement:
    """DeepSeek EPLB's placement of experts with loads ``weight`` ``[L, N]`` on ``ep_size`` ranks
    with ``redundant`` replica slots each: :func:`rebalance_experts`, then :func:`to_placement`."""
    weight = np.asarray(weight, np.float64)
    check_redundant(redundant, weight.shape[1], ep_size)
    phy2log, _, _ = rebalance_experts(weight, weight.shape[1] + ep_size * redundant, ep_size)
    return to_placement(phy2log, weight, ep_size, method)


def copy_devices(phy2log: np.ndarray, num_gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's per-expert replica lists as ranks: ``(devices [L, N, C], count [L, N])``, the rank
    of every copy of each logical expert in ascending physical slot (``-1`` padded), as vLLM
    builds ``logical_to_physical_map`` from ``physical_to_logical_map``.

    Args:
        phy2log: ``[L, P]`` logical expert in each physical slot (rank ``p // (P/E)``).
    """
    phy2log = np.asarray(phy2log, np.int64)
    L, P = phy2log.shape
    N = int(phy2log.max()) + 1
    count = np.stack([np.bincount(row, minlength=N) for row in phy2log])
    order = np.argsort(phy2log, axis=1, kind="stable")  # slots grouped by expert, ascending slot
    first = np.concatenate([np.zeros((L, 1), np.int64), np.cumsum(count, axis=1)[:, :-1]], axis=1)
    which = np.arange(P)[None, :] - np.repeat(first.ravel(), count.ravel()).reshape(L, P)
    devices = np.full((L, N, int(count.max())), -1, np.int64)
    rows = np.broadcast_to(np.arange(L)[:, None], (L, P))
    devices[rows, np.take_along_axis(phy2log, order, axis=1), which] = order // (P // num_gpus)
    return devices, count


def vllm_replica_index(token_row: np.ndarray, copies: np.ndarray) -> np.ndarray:
    """vLLM's replica choice: ``(row * KNUTH_MULTIPLIER mod 2^32) mod copies``, elementwise
    (``token_row`` the token's row in its rank's batch, broadcast against ``copies``)."""
    hashed = (np.asarray(token_row, np.int64) * KNUTH_MULTIPLIER) & 0xFFFFFFFF
    return hashed % np.maximum(np.asarray(copies, np.int64), 1)


def vllm_serving_device(phy2log: np.ndarray, num_gpus: int, experts: np.ndarray, token_row: np.ndarray
                        ) -> np.ndarray:
    """The rank computing each activation when vLLM's EPLB serves ``phy2log``: the copy
    :func:`vllm_replica_index` picks, wherever the token is.

    Args:
        phy2log: ``[L, P]`` logical expert in each physical slot (``Placement.physical_to_logical``).
        experts: ``[T, L, K]`` logical experts of each token at each layer.
        token_row: ``[T, L]`` row of each token in its rank's batch (:func:`rank_rows`).
    Returns:
        ``[T, L, K]`` int64 rank of each activation's copy.
    """
    experts = np.asarray(experts, np.int64)
    devices, count = copy_devices(phy2log, num_gpus)
    layer = np.arange(experts.shape[1])[None, :, None]
    pick = vllm_replica_index(np.asarray(token_row, np.int64)[:, :, None], count[layer, experts])
    return devices[layer, experts, pick]


def rank_rows(token_device: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """``[T, L]`` int64 row of each token in its rank's batch: its position among the tokens of
    the same step on the same rank, in token order.

    Args:
        token_device: ``[T, L]`` rank of each token at each layer.
        starts: ``[S]`` first token of each step (ascending, ``starts[0] == 0``).
    """
    device = np.asarray(token_device, np.int64)
    T, L = device.shape
    step = np.repeat(np.arange(len(starts)), np.diff(np.append(np.asarray(starts, np.int64), T)))
    E = int(device.max(initial=0)) + 1
    out = np.empty((T, L), np.int64)
    for l in range(L):
        key = step * E + device[:, l]
        order = np.argsort(key, kind="stable")
        sorted_key = key[order]
        group_start = np.flatnonzero(np.r_[True, sorted_key[1:] != sorted_key[:-1]])
        first = np.repeat(group_start, np.diff(np.append(group_start, T)))
        out[order, l] = np.arange(T) - first
    return out


def served_by_vllm_eplb(placement: Placement) -> bool:
    """Whether ``placement`` stands for vLLM's own EPLB (the ``eplb`` method's, with replicas),
    whose tokens take their copy by :func:`vllm_serving_device`, not by where they sit."""
    return placement.method == EplbPolicy.name and placement.redundant > 0


class EplbPolicy(PlacementPolicy):
    """DeepSeek EPLB: balance expert load, hot experts copied into the redundant slots; no
    locality. Served by vLLM's EPLB (``num_redundant_experts = E*R``)."""

    name = "eplb"
    supports_redundant = True

    def solve(self, profile, ep_size, *, mode="tp", seed=0, redundant=0, progress: Progress = None):
        check_redundant(redundant, profile.num_experts, ep_size)
        return eplb_placement(expert_loads(profile), ep_size, redundant, self.name)


__all__ = ["EplbPolicy", "KNUTH_MULTIPLIER", "balanced_packing", "copy_devices", "eplb_placement", "expert_loads",
           "load_imbalance", "rank_loads", "rank_rows", "rebalance_experts", "replicate_experts",
           "served_by_vllm_eplb", "to_placement", "vllm_replica_index", "vllm_serving_device"]
