"""The time objective: of the placements Sem-MoE can serve with ``R`` redundant slots per rank,
the one whose modelled MoE-layer step time is least on a :class:`~vllm_semmoe.evaluation.step_time.Target`.

A layer waits for its slowest rank, so the placement with the most local activations is not
always the fastest: where co-located hot experts make a straggler, or where a step is too small
for the exchange saved to outweigh the extra expert weights a replica makes a rank read, a
balanced placement is faster. The candidates (:data:`VARIANTS`):

- ``locality``: Sem-MoE's co-clustering and its data scheduler (θ = the solve's default);
- ``balanced``: the same with a higher expert-load price (:data:`BALANCED_LOAD_PRICE`): fewer
  local activations, a lighter straggler;
- ``hot`` (``R > 0``): the ``locality`` placement with its slots filled by load: the experts with
  the most activations per copy, as DeepSeek's EPLB picks them, each copy where its tokens are;
- ``eplb``: DeepSeek's EPLB at ``R`` (hot experts copied, no locality, vLLM's EPLB serving);
- ``stock``: vLLM's linear placement with no data scheduling and the ``R`` slots left unused.

:func:`choose` times every candidate by two-fold cross-validation on the profile: the
profile's requests are halved (drawn by the seed), each candidate is solved on one half and
timed on the other, both ways, and the two times are averaged; so the choice does not see the
locality a solve overfits to its own data, and every profiled request is timed once.
:func:`solve_for_time` then solves the winner on the whole profile. Nothing here reads
evaluation data: the caller gives the profile.

Pure NumPy on top of the solvers; nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.modes import serving_mode
from ..core.placement import Placement
from ..core.policy.base import check_redundant
from ..core.policy.eplb import EplbPolicy
from ..core.policy.semmoe import DEFAULT_LOAD_PRICE, SemMoEPolicy
from ..core.policy.simple import VanillaPolicy
from .step_time import Target, node_groups, step_time_us, stream_traffic
from ..core.tables import SemMoETables, build_tables
from ..core.trace import RoutingTrace

#: the candidates, in the order ties are broken (module docstring)
VARIANTS = ("locality", "balanced", "hot", "eplb", "stock")
#: variants that schedule data with Sem-MoE's tables
SCHEDULED = ("locality", "balanced", "hot")
#: θ of the ``balanced`` variant: ten times the default, so that the two Sem-MoE candidates differ
#: clearly in how much locality they trade for expert balance (not tuned: the cross-validated
#: step time decides between them per target)
BALANCED_LOAD_PRICE = 10 * DEFAULT_LOAD_PRICE


@dataclass
class Choice:
    """The time objective's decision for one target: the variant served and every candidate's
    modelled ``total_us``, cross-validated on the profile (module docstring)."""

    target: Target
    variant: str
    times_us: dict = field(default_factory=dict)

    def summary(self) -> str:
        ranked = sorted(self.times_us.items(), key=lambda kv: kv[1])
        return f"{self.target}: {self.variant} (" + ", ".join(f"{v} {us:.1f} µs" for v, us in ranked) + ")"


def solve_variant(variant: str, profile: RoutingTrace, ep_size: int, mode, redundant: int = 0, *,
                  seed: int = 0, progress=None) -> tuple[Placement, SemMoETables | None]:
    """``(placement, tables)`` of one candidate solved on ``profile`` (tables ``None`` where the
    variant does not schedule data)."""
    return solve_variants((variant,), profile, ep_size, mode, redundant, seed=seed, progress=progress)[variant]


def solve_variants(variants, profile: RoutingTrace, ep_size: int, mode, redundant: int = 0, *,
                   seed: int = 0, progress=None) -> dict:
    """``{variant: (placement, tables)}`` of each of ``variants`` solved on ``profile``;
    ``locality`` and ``hot`` share one co-clustering (the same homes, different replicas)."""
    mode = serving_mode(mode)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant {', '.join(map(repr, unknown))}; choose from {', '.join(VARIANTS)}")
    homes, out = None, {}
    for variant in variants:
        if variant in SCHEDULED:
            price = BALANCED_LOAD_PRICE if variant == "balanced" else DEFAULT_LOAD_PRICE
            policy = SemMoEPolicy(load_price=price, replicas="load" if variant == "hot" else "locality")
            if variant == "balanced":
                placement = policy.solve(profile, ep_size, mode=mode, seed=seed, redundant=redundant,
                                         progress=progress)
            else:
                if homes is None:
                    homes = policy.solve(profile, ep_size, mode=mode, seed=seed, progress=progress)
                placement = policy.replicate(profile, homes, redundant, mode)
            out[variant] = placement, build_tables(profile, placement, mode=mode)
        elif variant == "eplb":
            out[variant] = EplbPolicy().solve(profile, ep_size, mode=mode, seed=seed, redundant=redundant), None
        else:  # stock
            out[variant] = VanillaPolicy().solve(profile, ep_size, mode=mode, seed=seed), None
    return out


def choose(profile: RoutingTrace, ep_size: int, mode, redundant: int, targets, *, seed: int = 0,
           variants=VARIANTS, max_batches: int | None = None, progress=None) -> dict:
    """``{target: Choice}``: for each of ``targets``, the variant with the least modelled step
    time, cross-validated over the two halves of ``profile``'s requests (module docstring)."""
    mode = serving_mode(mode)
    check_redundant(redundant, profile.num_experts, ep_size)
    targets = tuple(targets)
    if not targets:
        raise ValueError("the time objective needs at least one target")
    variants = tuple(v for v in variants if redundant or v != "hot")  # without slots, hot is locality
    folds = cross_validation_folds(profile, seed)
    groups = node_groups({t.hardware for t in targets})
    batches = sorted({t.batch_tokens for t in targets})
    choices = {t: Choice(t, variants[0]) for t in targets}
    for i, (fit, check) in enumerate(folds):
        if progress:
            progress(i, len(folds), f"time objective ({mode}, R = {redundant}): fold {i + 1}")
        for variant, (placement, tables) in solve_variants(variants, fit, ep_size, mode, redundant, seed=seed).items():
            for batch in batches:
                traffic = stream_traffic(check, placement, tables, mode, batch, groups,
                                         max_batches=max_batches)["traffic"]
                for t in targets:
                    if t.batch_tokens == batch:
                        times = choices[t].times_us
                        times[variant] = times.get(variant, 0.0) + step_time_us(traffic, t, mode, tables) / len(folds)
    for c in choices.values():
        c.variant = min(variants, key=lambda v: c.times_us[v])  # ties: the earlier variant
    if progress:
        progress(len(folds), len(folds), f"time objective ({mode}, R = {redundant})")
    return choices


def cross_validation_folds(profile: RoutingTrace, seed: int = 0) -> tuple:
    """``((first half, second half), (second half, first half))`` of ``profile``'s requests
    (drawn by ``seed``): the (fit, time) pairs :func:`choose` averages over."""
    first, second = profile.split(0.5, seed)
    if first.num_requests == 0 or second.num_requests == 0:
        raise ValueError(f"the profile's {profile.num_requests} request(s) are too few for the time objective, "
                         "which solves on one half of them and times on the other")
    return (first, second), (second, first)


def solve_for_time(profile: RoutingTrace, ep_size: int, mode, redundant: int, target: Target, *,
                   seed: int = 0, progress=None) -> tuple[Choice, Placement, SemMoETables | None]:
    """``(choice, placement, tables)``: the variant :func:`choose` picks for ``target``, solved
    on the whole of ``profile`` (what ``semmoe solve --objective time`` writes)."""
    choice = choose(profile, ep_size, mode, redundant, (target,), seed=seed, progress=progress)[target]
    placement, tables = solve_variant(choice.variant, profile, ep_size, mode, redundant, seed=seed)
    return choice, placement, tables


__all__ = ["BALANCED_LOAD_PRICE", "SCHEDULED", "VARIANTS", "Choice", "Target", "choose", "cross_validation_folds",
           "solve_for_time", "solve_variant", "solve_variants"]
