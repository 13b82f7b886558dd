"""Price rounds of the Attention-TP decision (:func:`vllm_semmoe.core.scheduling.align`) in one kernel.

Every MoE layer of every step decides which device each token goes to: ``[B, E]`` scores, at
most ``capacity`` tokens per device, Lagrangian prices raised on over-subscribed devices for up
to 40 rounds. As separate PyTorch ops on a GPU that is 40 rounds of about ten small kernels:
launch-bound, about 6 ms per layer on an H200 whatever the batch (``scripts/gpu_check.sh``). This
kernel runs all rounds in one program (one launch), walking the batch in tiles; the rounds stop
at the first one that leaves no device over capacity, as the Numba loop breaks.

The arithmetic is Numba's, operation for operation, in float64 (scores minus prices, first
index on ties, ``price + step * (load / cap - 1)`` clamped at 0, ``step *= 0.93``), with
floating-point contraction off, so the devices and loads equal Numba's, not merely come close.
Constants that are not exact in float32 travel in a float64 tensor: Triton passes Python floats
as float32.

With ``repair`` the same program then runs the repair of
:func:`vllm_semmoe.core.scheduling.repair_unit` when a device is still over capacity, making its
moves: while one is, the first most loaded device gives up the unit that loses least by moving
(``score[u, over] - score[u, e]`` to a device ``e`` with room; ties: lowest unit, then lowest
device). Not one move per pass: the moves are taken in epochs, each lasting until a device with
room fills (at most ``E`` epochs). Within one the room is fixed, so every unit of an over device
keeps its key (loss, unit), each over device gives up its units in key order, and the order of
the devices is the loads' alone (level by level from the most loaded, lower devices first at a
level); the epoch ranks the candidates pairwise (``O(C²)`` for ``C`` units on over devices;
where ``C`` is large, after selecting each over device's ``load - capacity`` lowest keys, the
only ones that can move, in 64 counting passes), places each move in that order, and applies
those up to the one that fills a device. The
decision then never needs the host: no flag is read back, so the launch can be captured in a
CUDA graph. (Scores are finite: a unit always has a device with room to lose to.)
"""

from __future__ import annotations

import functools

import torch

from .shuffle import ADD, interpret_mode, triton, tl, uses_triton

__all__ = ["COMPILE_OPTIONS", "align_rounds"]

COMPILE_OPTIONS = {"enable_fp_fusion": False}  # no contracted multiply-adds: Numba's rounding

if triton is not None:
    _MAX = tl.standard._elementwise_max
    _MIN = tl.standard._elementwise_min


def _align_kernel(score_ptr, params_ptr, device_ptr, load_ptr, over_ptr, unit_ptr, target_ptr, owner_ptr, key_ptr,
                  position_ptr, B, E, capacity, rounds,
                  REPAIR: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
                  SELECT_FROM: tl.constexpr):
    """Grid ``(1,)``. score ``[B, E]`` float32 or float64 (contiguous; read as float64); params
    ``[3]`` float64 = (step decay 0.93, step scale 0.05, 1e-9); writes device ``[B]`` int64 (the
    last round's choice, repaired with REPAIR), load ``[E]`` float64 (tokens per device under it)
    and over ``[1]`` int32 (1 when a device is still over ``capacity``). With REPAIR: unit
    ``[B]`` int64, target and owner ``[B]`` int32, key ``[B]`` int64 and position ``[B]`` float64
    are scratch (the candidates of a repair epoch), BLOCK_C the candidates per tile of its
    pairwise passes, SELECT_FROM the candidates above which the movers are selected first."""
    decay = tl.load(params_ptr)
    scale = tl.load(params_ptr + 1)
    tiny = tl.load(params_ptr + 2)
    cap = capacity.to(tl.float64)
    cols = tl.arange(0, BLOCK_E)
    in_e = cols < E
    offs = tl.arange(0, BLOCK_B).to(tl.int64)
    # initial step = 0.05 * (max - min + 1e-9) over the scores, as Numba computes it
    hi = tl.full([BLOCK_E], float("-inf"), tl.float64)
    lo = tl.full([BLOCK_E], float("inf"), tl.float64)
    for start in range(0, B, BLOCK_B):
        b = start + offs
        m = (b < B)[:, None] & in_e[None, :]
        s = tl.load(score_ptr + b[:, None] * E + cols[None, :], mask=m, other=0.0).to(tl.float64)
        hi = tl.where(in_e, tl.maximum(hi, tl.reduce(tl.where(m, s, float("-inf")), 0, _MAX)), hi)
        lo = tl.where(in_e, tl.minimum(lo, tl.reduce(tl.where(m, s, float("inf")), 0, _MIN)), lo)
    step = scale * (tl.reduce(hi, 0, _MAX) - tl.reduce(lo, 0, _MIN) + tiny)
    price = tl.full([BLOCK_E], 0.0, tl.float64)
    load = tl.full([BLOCK_E], 0.0, tl.float64)
    over = tl.full([], 1, tl.int32)
    r = tl.full([], 0, tl.int32)
    while (r < rounds) & (over != 0):
        load = tl.full([BLOCK_E], 0.0, tl.float64)
        for start in range(0, B, BLOCK_B):
            b = start + offs
            in_b = b < B
            s = tl.load(score_ptr + b[:, None] * E + cols[None, :], mask=in_b[:, None] & in_e[None, :],
                        other=float("-inf")).to(tl.float64)
            v = s - price[None, :]
            best_v = tl.reduce(v, 1, _MAX)
            best = tl.reduce(tl.where(v == best_v[:, None], cols[None, :], BLOCK_E), 1, _MIN)
            tl.store(device_ptr + b, best.to(tl.int64), mask=in_b)
            hit = ((best[:, None] == cols[None, :]) & in_b[:, None]).to(tl.float64)
            load += tl.reduce(hit, 0, ADD)
        is_over = tl.reduce(tl.where(in_e, load, 0.0), 0, _MAX) > cap
        over = tl.where(is_over, 1, 0)
        raised = price + step * (load / cap - 1.0)
        price = tl.where(is_over, tl.where(raised > 0.0, raised, 0.0), price)
        step = tl.where(is_over, step * decay, step)
        r += 1
    if REPAIR:
        # Passes read what this program stored (devices, the candidates): a barrier makes every
        # thread's stores visible, and volatile loads bypass the non-coherent cache.
        tl.debug_barrier()
        inf = float("inf")
        offs_c = tl.arange(0, BLOCK_C)
        go = over != 0
        while go:
            # An epoch: the moves until a device with room fills. Its room set is fixed, so
            # each unit of an over device keeps its key (loss to its best device with room,
            # unit) and each over device gives up its units in key order.
            room = in_e & (load + 1.0 <= cap)
            is_over = in_e & (load > cap)
            # 1. the units of over devices, in unit order, with their keys
            count = tl.full([], 0, tl.int32)
            for start in range(0, B, BLOCK_B):
                b = start + offs
                in_b = b < B
                dev = tl.load(device_ptr + b, mask=in_b, other=-1, volatile=True).to(tl.int32)
                mine = dev[:, None] == cols[None, :]
                on_over = tl.reduce(tl.where(mine & is_over[None, :], 1, 0), 1, _MAX) > 0
                s = tl.load(score_ptr + b[:, None] * E + cols[None, :], mask=in_b[:, None] & in_e[None, :],
                            other=0.0).to(tl.float64)
                loss = tl.reduce(tl.where(mine, s, float("-inf")), 1, _MAX)[:, None] - s
                valid = room[None, :] & (loss < inf)  # Numba's strict `loss < best_loss` from inf
                loss = tl.where(valid, loss, inf)
                unit_loss = tl.reduce(loss, 1, _MIN)
                unit_e = tl.reduce(tl.where(valid & (loss == unit_loss[:, None]), cols[None, :], BLOCK_E), 1, _MIN)
                keep = in_b & on_over & (unit_e < BLOCK_E)
                # the loss as an int64 of the same order (-0.0 made +0.0, negatives' bits flipped)
                bits = (unit_loss + 0.0).to(tl.int64, bitcast=True)
                key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFFFFFFFFFF)
                slot = count + tl.associative_scan(keep.to(tl.int32), 0, ADD) - 1
                tl.store(unit_ptr + slot, b, mask=keep)
                tl.store(target_ptr + slot, unit_e, mask=keep)
                tl.store(owner_ptr + slot, dev, mask=keep)
                tl.store(key_ptr + slot, key, mask=keep)
                count += tl.reduce(keep.to(tl.int32), 0, ADD)
            tl.debug_barrier()
            if count > SELECT_FROM:
                # Many candidates: keep only those that can move this epoch, each over device's
                # `need` lowest keys (ties: lowest unit), found bit by bit (the need-th lowest
                # key per device in 64 counting passes), so the pairwise passes below see the
                # moves, not every unit of an over device.
                need = tl.where(is_over, load - cap, 0.0).to(tl.int32)
                one = tl.full([], 1, tl.int64)
                kth = tl.full([BLOCK_E], 0, tl.int64)
                for j in range(0, 64):
                    bit = 63 - j
                    # the highest key with this bit clear under the bits chosen so far (bit 63:
                    # the negative keys, all below zero)
                    trial = tl.where(bit == 63, tl.full([BLOCK_E], -1, tl.int64), kth | ((one << bit) - 1))
                    at_most = tl.full([BLOCK_E], 0, tl.int32)
                    for start in range(0, count, BLOCK_B):
                        i = start + offs
                        in_i = i < count
                        key = tl.load(key_ptr + i, mask=in_i, other=0, volatile=True)
                        own = tl.load(owner_ptr + i, mask=in_i, other=-1, volatile=True)
                        hit = (own[:, None] == cols[None, :]) & (key[:, None] <= trial[None, :])
                        at_most += tl.reduce(hit.to(tl.int32), 0, ADD)
                    # set the bit where fewer than `need` keys are at most the trial (the sign
                    # bit the other way round: set, the key is negative)
                    set_bit = tl.where(bit == 63, at_most >= need, at_most < need)
                    kth = tl.where(set_bit, kth | (one << bit), kth)
                below = tl.full([BLOCK_E], 0, tl.int32)
                for start in range(0, count, BLOCK_B):
                    i = start + offs
                    in_i = i < count
                    key = tl.load(key_ptr + i, mask=in_i, other=0, volatile=True)
                    own = tl.load(owner_ptr + i, mask=in_i, other=-1, volatile=True)
                    below += tl.reduce(((own[:, None] == cols[None, :]) & (key[:, None] < kth[None, :])).to(tl.int32), 0,
                                       ADD)
                take = need - below  # of the units whose key is the need-th lowest, in unit order
                # compact the chosen in place, in unit order (a slot is never after its entry)
                taken = tl.full([BLOCK_E], 0, tl.int32)
                kept = tl.full([], 0, tl.int32)
                for start in range(0, count, BLOCK_B):
                    i = start + offs
                    in_i = i < count
                    key = tl.load(key_ptr + i, mask=in_i, other=0, volatile=True)
                    own = tl.load(owner_ptr + i, mask=in_i, other=-1, volatile=True)
                    unit = tl.load(unit_ptr + i, mask=in_i, other=0, volatile=True)
                    to = tl.load(target_ptr + i, mask=in_i, other=0, volatile=True)
                    mine = own[:, None] == cols[None, :]
                    kth_i = tl.reduce(tl.where(mine, kth[None, :], 0), 1, ADD)
                    tie = mine & (key == kth_i)[:, None]
                    tie_rank = tl.reduce(tl.where(mine, taken[None, :] + tl.associative_scan(tie.to(tl.int32), 0, ADD), 0),
                                         1, ADD)
                    take_i = tl.reduce(tl.where(mine, take[None, :], 0), 1, ADD)
                    keep = in_i & ((key < kth_i) | ((key == kth_i) & (tie_rank <= take_i)))
                    taken += tl.reduce(tie.to(tl.int32), 0, ADD)
                    slot = kept + tl.associative_scan(keep.to(tl.int32), 0, ADD) - 1
                    tl.debug_barrier()  # every entry of the tile read before any is overwritten
                    tl.store(unit_ptr + slot, unit, mask=keep)
                    tl.store(target_ptr + slot, to, mask=keep)
                    tl.store(owner_ptr + slot, own, mask=keep)
                    tl.store(key_ptr + slot, key, mask=keep)
                    kept += tl.reduce(keep.to(tl.int32), 0, ADD)
                count = kept
                tl.debug_barrier()
            # 2. each candidate's rank on its device and the position of its move: devices give
            # units level by level from the most loaded, lower devices first at a level (the
            # sequential loop's first most loaded device); rank r of device d moves at level
            # h = load[d] - r, after every unit above h and the lower devices' at h
            for si in range(0, count, BLOCK_C):
                i = si + offs_c
                in_i = i < count
                key_i = tl.load(key_ptr + i, mask=in_i, other=0, volatile=True)
                own_i = tl.load(owner_ptr + i, mask=in_i, other=-1, volatile=True)
                rank = tl.full([BLOCK_C], 0, tl.int32)
                for sk in range(0, count, BLOCK_C):
                    k = sk + offs_c
                    in_k = k < count
                    key_k = tl.load(key_ptr + k, mask=in_k, other=0, volatile=True)
                    own_k = tl.load(owner_ptr + k, mask=in_k, other=-1, volatile=True)
                    first = (key_k[None, :] < key_i[:, None]) | ((key_k[None, :] == key_i[:, None]) & (k[None, :] < i[:, None]))
                    ahead = in_k[None, :] & (own_k[None, :] == own_i[:, None]) & first
                    rank += tl.reduce(ahead.to(tl.int32), 1, ADD)
                h = tl.reduce(tl.where(cols[None, :] == own_i[:, None], load[None, :], float("-inf")), 1, _MAX) - rank
                above = tl.reduce(tl.where(in_e[None, :], tl.maximum(load[None, :] - h[:, None], 0.0), 0.0), 1, ADD)
                level = in_e[None, :] & (cols[None, :] < own_i[:, None]) & (load[None, :] >= h[:, None])
                position = above + tl.reduce(tl.where(level, 1.0, 0.0), 1, ADD)
                tl.store(position_ptr + i, tl.where(h > cap, position, inf), mask=in_i)
            tl.debug_barrier()
            # 3. the epoch ends with the move that fills a device: the move to e whose count of
            # moves to e up to it equals e's room
            stop = tl.full([], inf, tl.float64)
            for si in range(0, count, BLOCK_C):
                i = si + offs_c
                in_i = i < count
                pos_i = tl.load(position_ptr + i, mask=in_i, other=inf, volatile=True)
                to_i = tl.load(target_ptr + i, mask=in_i, other=-1, volatile=True)
                upto = tl.full([BLOCK_C], 0.0, tl.float64)
                for sk in range(0, count, BLOCK_C):
                    k = sk + offs_c
                    in_k = k < count
                    pos_k = tl.load(position_ptr + k, mask=in_k, other=inf, volatile=True)
                    to_k = tl.load(target_ptr + k, mask=in_k, other=-1, volatile=True)
                    same = (to_k[None, :] == to_i[:, None]) & (pos_k[None, :] <= pos_i[:, None]) & (pos_k < inf)[None, :]
                    upto += tl.reduce(tl.where(same, 1.0, 0.0), 1, ADD)
                space = cap - tl.reduce(tl.where(cols[None, :] == to_i[:, None], load[None, :], float("-inf")), 1, _MAX)
                fills = in_i & (pos_i < inf) & (upto == space)
                stop = tl.minimum(stop, tl.reduce(tl.where(fills, pos_i, inf), 0, _MIN))
            # 4. the epoch's moves
            delta = tl.full([BLOCK_E], 0.0, tl.float64)
            for si in range(0, count, BLOCK_C):
                i = si + offs_c
                in_i = i < count
                pos_i = tl.load(position_ptr + i, mask=in_i, other=inf, volatile=True)
                move = in_i & (pos_i < inf) & (pos_i <= stop)
                unit = tl.load(unit_ptr + i, mask=move, other=0, volatile=True)
                to_i = tl.load(target_ptr + i, mask=move, other=-1, volatile=True)
                own_i = tl.load(owner_ptr + i, mask=move, other=-1, volatile=True)
                tl.store(device_ptr + unit, to_i.to(tl.int64), mask=move)
                gain = tl.where(cols[None, :] == to_i[:, None], 1.0, 0.0) - tl.where(cols[None, :] == own_i[:, None], 1.0, 0.0)
                delta += tl.reduce(tl.where(move[:, None], gain, 0.0), 0, ADD)
            load += delta
            tl.debug_barrier()
            moved = tl.reduce(tl.where(delta > 0.0, delta, 0.0), 0, ADD)
            go = (tl.reduce(tl.where(in_e, load, 0.0), 0, _MAX) > cap) & (moved > 0.0)
        over = tl.where(tl.reduce(tl.where(in_e, load, 0.0), 0, _MAX) > cap, 1, 0)
    tl.store(load_ptr + cols, load, mask=in_e)
    tl.store(over_ptr, over)


#: candidates per side of the repair's pairwise tiles (a REPAIR_TILE² block per step)
REPAIR_TILE = 64
#: candidates above which a repair epoch first selects the movers: the pairwise passes take
#: about (C / REPAIR_TILE)² steps, the selection 64 · C / BLOCK_B, so it pays from a few hundred
#: (counted steps, not measured times)
REPAIR_SELECT_FROM = 8 * REPAIR_TILE

#: integer arguments Triton must not specialise: a value of 1 would become a compile-time
#: constant (a plain int inside the kernel), found on an H200 with capacity 1
_RUNTIME_INTS = ["B", "E", "capacity", "rounds"]


@functools.lru_cache(maxsize=None)
def _kernel(interpret: bool):
    # `interpret` is only part of the cache key: triton.jit reads the same setting itself.
    return triton.jit(_align_kernel, do_not_specialize=_RUNTIME_INTS)


@functools.lru_cache(maxsize=None)
def _params(device: torch.device) -> torch.Tensor:
    """The kernel's float64 constants on ``device`` (made once per device: no copy per call)."""
    return torch.tensor([0.93, 0.05, 1e-9], dtype=torch.float64, device=device)


def align_rounds(score: torch.Tensor, capacity: int, rounds: int, *, repair: bool = False, tile: int | None = None,
                 num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The price rounds of :func:`vllm_semmoe.core.scheduling.balanced_assignment` (unit weights),
    and with ``repair`` its repair, one launch, nothing read back.

    Args:
        score: ``[B, E]`` float32 or float64 (read as float64, as Numba's ``align`` converts it)
            on a CUDA device (or any device under ``TRITON_INTERPRET=1``).
        capacity: tokens a device may take; rounds: most price rounds (>= 1).
        repair: also run :func:`vllm_semmoe.core.scheduling.repair_unit`'s moves where the rounds
            leave a device over ``capacity`` (the device per token is then Numba's ``align``).
        tile, num_warps: scores per tile of the batch walk and Triton's warps; None: 4096 and 4
            for a batch that fits one such tile, else 8192 and 16 (the fastest of those tried
            on an H200 at 512 to 16384 tokens × 8 devices, ``scripts/gpu_check.sh``).
    Returns:
        ``(device [B] int64, load [E] float64, over [1] int32)``: the last round's choice
        (repaired with ``repair``), its loads, and 1 where a device is still over ``capacity``
        (without ``repair``: the caller repairs; with it, only where ``E * capacity < B``).
    """
    if not uses_triton(score):  # (False without Triton)
        raise RuntimeError("align_rounds needs Triton and a CUDA tensor (or TRITON_INTERPRET=1)")
    if score.dim() != 2 or score.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"score must be a [B, E] float32 or float64 tensor, got {tuple(score.shape)} {score.dtype}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    score = score.contiguous()
    B, E = score.shape
    if B == 0:
        return (torch.zeros(0, dtype=torch.int64, device=score.device),
                torch.zeros(E, dtype=torch.float64, device=score.device),
                torch.zeros(1, dtype=torch.int32, device=score.device))
    device = torch.empty(B, dtype=torch.int64, device=score.device)  # every entry written in round 1
    load = torch.empty(E, dtype=torch.float64, device=score.device)
    over = torch.empty(1, dtype=torch.int32, device=score.device)
    block_e = max(2, triton.next_power_of_2(E))
    large = B * block_e > 4096
    tile = tile or (8192 if large else 4096)
    num_warps = num_warps or (16 if large else 4)
    block_b = max(16, min(triton.next_power_of_2(B), tile // block_e))
    options = {} if interpret_mode() else dict(COMPILE_OPTIONS, num_warps=num_warps)
    n = B if repair else 1  # the repair's candidates (unused without it)
    scratch = [torch.empty(n, dtype=dtype, device=score.device)
               for dtype in (torch.int64, torch.int32, torch.int32, torch.int64, torch.float64)]
    _kernel(interpret_mode())[(1,)](score, _params(score.device), device, load, over, *scratch, B, E, int(capacity),
                                    rounds, REPAIR=bool(repair), BLOCK_B=block_b, BLOCK_E=block_e,
                                    BLOCK_C=REPAIR_TILE, SELECT_FROM=REPAIR_SELECT_FROM, **options)
    return device, load, over
