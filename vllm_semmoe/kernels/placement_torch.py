"""Which copy of a replicated expert serves an activation, in PyTorch ops: the rule of
:meth:`vllm_semmoe.core.placement.Placement.serving_device` (Numba, offline) for the ids one serving
rank's router selects, computed where the ids are (no host copy, no host sync, static shapes, so
it can run inside a captured CUDA graph). Property-tested equal to the Numba rule.
"""

from __future__ import annotations

import torch


def serving_slots(ids: torch.Tensor, copies: torch.Tensor, experts_per_device: int, ep_size: int,
                  device: int) -> torch.Tensor:
    """Physical slot serving each activation of tokens that sit on ``device``.

    The rule of :meth:`~vllm_semmoe.core.placement.Placement.serving_device`, one MoE layer, every
    token on ``device``: the device's own copy where it holds one (the activation is local);
    else, for an expert with one copy, its home; else, in slot order ``k``, the first of the
    expert's copies on a device the token is already sent to (the dispatch sends a token once
    per destination device), failing that copy ``(row * K + k) mod copies``, ``row`` being the
    token's row in ``ids`` (in serving, its row in the step's batch, as vLLM's EPLB spreads a
    step's tokens over replicas; offline, its row in the trace).

    Args:
        ids: ``[T, K]`` logical expert ids in ``[0, N)``.
        copies: ``[N, C]`` int64 physical slots of each expert's copies, home first, then
            replicas ascending, ``-1`` padded (one layer of
            :meth:`~vllm_semmoe.core.placement.Placement.logical_to_physical_map`).
        experts_per_device: physical slots per device (``N/E + R``); slot ``s`` is on device
            ``s // experts_per_device``.
        ep_size: E, devices.
        device: the device the tokens sit on.
    Returns:
        ``[T, K]`` int64 physical slots, each holding the logical expert ``ids`` names.
    """
    ids = ids.long()
    T, K = ids.shape
    copy_device = torch.where(copies >= 0, copies // experts_per_device, -1)  # [N, C]
    count = (copies >= 0).sum(dim=1)  # [N]
    cand, cand_device, cand_count = copies[ids], copy_device[ids], count[ids]  # [T, K, C], [T, K, C], [T, K]
    mine = cand_device == device
    local = mine.any(dim=2)
    slot = torch.where(local, cand.gather(2, mine.to(torch.int32).argmax(dim=2, keepdim=True))[..., 0],
                       cand[..., 0])  # local copy, else home (final for single-copy experts)
    single = ~local & (cand_count == 1)
    # devices each token is sent to; column ep_size collects the writes of tokens that send nothing
    sent = torch.zeros(T, ep_size + 1, dtype=torch.bool, device=ids.device)
    sent.scatter_(1, torch.where(single, cand_device[..., 0], ep_size), True)
    row = torch.arange(T, device=ids.device)
    for k in range(K):
        pending = ~local[:, k] & (cand_count[:, k] > 1)
        on_sent = (cand_device[:, k] >= 0) & sent.gather(1, cand_device[:, k].clamp(min=0))  # [T, C]
        spread = (row * K + k) % cand_count[:, k].clamp(min=1)
        choice = torch.where(on_sent.any(dim=1), on_sent.to(torch.int32).argmax(dim=1), spread)
        chosen = cand[:, k].gather(1, choice[:, None])[:, 0]
        slot[:, k] = torch.where(pending, chosen, slot[:, k])
        sent.scatter_(1, torch.where(pending, chosen // experts_per_device, ep_size)[:, None], True)
    return slot
