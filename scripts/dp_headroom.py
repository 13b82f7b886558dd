"""Where DP LAR at R = 0 is lost (against the DP bar, 0.175): eight studies of the DP placement and router.

All on the DeepSeek-V2-Lite dev trace, EP 8, the solver as deployed (``SemMoEPolicy``'s DP
co-clustering with its default restarts and θ, ``policy.semmoe.DEFAULT_LOAD_PRICE``), IDF-weighted
DP tables built on the profile. Each study
prints, per case, ``oracle`` (every evaluated request on its best rank), ``pure`` (on its
best-voted rank, no balance) and the balanced rule's LAR at knobs ``(balance, price step)``
with its window imbalance relative to the online least-loaded balancer's (``lar@ratio``).

- ``shrink`` (profile only, never evaluation requests): each seed's 20% profile split 50/50
  both ways; the co-clustering fitted on one half with every request's counts replaced by
  ``(1 - beta) * actual + beta * predicted`` (predicted: the sum of its tokens' mean expert
  counts over the fit half; suffix ``i``: IDF-weighted, ``w``: cluster cap on work instead of
  prompt tokens, ``c``: predicted counts cross-fitted over 5 folds); measured on the other
  half, W = 64.
- ``restarts`` (diagnostic, on evaluation requests): 20 single-restart co-clusterings of each
  seed's profile; their profiled objective against what they reach on evaluation requests.
- ``fit`` (diagnostic): the placement fitted on the profile, on the evaluation requests
  themselves, or on every request; tables always from the profile; measured on evaluation.
- ``curve`` (diagnostic): a placement fitted on n = 140 .. 1000 requests, tables from 280 of
  them, measured on 399 other requests.
- ``online`` (a simulation, no look-ahead): the evaluation stream in blocks of ``--block``
  requests (280); block k is served by tables (``tables``) or a placement and tables
  (``placement``) re-solved on the profile plus the routing of every request served before it
  (what a deployment that refreshes from its own capture would have), a new placement's device
  labels matched to the previous one's (fewest expert moves); one router over the whole stream.
- ``foresight`` (diagnostic, on evaluation requests): the deployed placement's LAR within 1.05x
  least-loaded's window imbalance (W = 256) for the online rule with the T2D votes (as served)
  and with every request's true local counts as its votes (a router that knew each request's
  routing in advance), knobs the best of a grid in hindsight (per seed, and one pair for every
  seed), and the per-window optimum with look-ahead and true counts
  (:func:`windowed_optimum`).
- ``bigram`` (exploratory, on evaluation requests): votes whose token rows are conditioned on
  the previous token where the profile saw that pair (:func:`bigram_votes`), against the
  served votes, at three knob pairs.
- ``theta`` (exploratory): the DP co-clustering without its expert-load price (θ 0) against
  the deployed θ, at the same knob pairs, with the evaluation's expert imbalance.

The ``default`` knobs are ``scheduling``'s (``DEFAULT_DP_BALANCE``, ``DEFAULT_DP_PRICE_STEP``).
The studies' figures: benchmarks/SEEDS.md (where the rest of the DP bar is lost).

Every study splits the requests outside the tuning split (``vllm_semmoe.core.trace.TUNING_FRAC``, the
requests the knobs are chosen on) as ``semmoe eval`` does; ``--no-hold-out-tuning`` splits them
all (``curve`` then also fits on up to 1,000).

    .venv/bin/python scripts/dp_headroom.py shrink|restarts|fit|curve|online|foresight|bigram|theta [--seeds 0,1]
        [--block 280] [--no-hold-out-tuning]
"""

import argparse
import time
from pathlib import Path

import numpy as np

from vllm_semmoe.core import scheduling
from vllm_semmoe.core.affinity import token_expert_counts
from vllm_semmoe.core.placement import Placement
from vllm_semmoe.core.policy.lp import assign_experts
from vllm_semmoe.core.policy.semmoe import SemMoEPolicy, cocluster, request_expert_counts
from vllm_semmoe.core.tables import build_tables, placement_device_counts, request_idf
from vllm_semmoe.core.capture_store import load_trace

TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "routing" / "dsv2lite_puffin-dev.npz"
E = 8
DEFAULT_KNOBS = (scheduling.DEFAULT_DP_BALANCE, scheduling.DEFAULT_DP_PRICE_STEP)


HOLD_OUT_TUNING = True  # --no-hold-out-tuning: the seeds split every request, the tuning split's too


def seed_split(trace, seed):
    """The seed's ``(profile, evaluation)``, as ``semmoe eval --profile-frac 0.2`` splits it."""
    return trace.split(0.2, seed, hold_out_tuning=HOLD_OUT_TUNING)


def predicted_counts(fit, folds=0, idf=False, alpha=1.0):
    """``[L, R, N]`` float64: every request's summed per-token mean expert counts (K per
    token, smoothed towards the layer's expert prior); with ``folds``, a request's tokens take
    their means from the other folds' requests (a token unseen there: the prior)."""
    if not folds:
        return _predicted(fit, fit, idf, alpha)
    out = np.zeros((fit.num_layers, fit.num_requests, fit.num_experts))
    fold = np.random.default_rng(7).permutation(fit.num_requests) % folds
    for k in range(folds):
        held = np.nonzero(fold == k)[0]
        out[:, held] = _predicted(fit.select_requests(np.nonzero(fold != k)[0]), fit.select_requests(held),
                                  idf, alpha)
    return out


def _predicted(source, target, idf, alpha):
    token_ids, counts = token_expert_counts(source)  # [L, J, N]
    K = source.top_k
    prior = counts.sum(axis=1).astype(np.float64)
    prior *= K / prior.sum(axis=1, keepdims=True)  # [L, N], sums to K
    occurrences = counts[0].sum(axis=1) / K
    mean = (counts + alpha * prior[:, None, :]) / (occurrences[None, :, None] + alpha)  # [L, J, N]
    mean = np.concatenate([mean, prior[:, None, :]], axis=1)  # row J: a token never seen
    row = np.minimum(np.searchsorted(token_ids, target.tokens), len(token_ids) - 1)
    row = np.where(token_ids[row] == target.tokens, row, len(token_ids))
    weight = np.append(request_idf(source, token_ids), np.log(source.num_requests + 1.0) + 1.0)[row] \
        if idf else np.ones(len(row))
    request = np.repeat(np.arange(target.num_requests), np.diff(target.offsets))
    out = np.zeros((source.num_layers, target.num_requests, source.num_experts))
    for l in range(source.num_layers):
        np.add.at(out[l], request, mean[l, row] * weight[:, None])
    return out


def solve(fit, seed, beta=0.0, idf=False, work_cap=False, folds=0, restarts=None, load_price=None):
    """The DP co-clustering of ``SemMoEPolicy`` (its own settings; ``restarts`` and
    ``load_price`` override its restart count and θ) on (optionally shrunk) request counts;
    returns ``(placement, profiled objective)``.
    With ``beta = 0`` this is ``SemMoEPolicy().solve(fit, E, mode="dp", seed=seed)``."""
    policy = SemMoEPolicy()
    counts = request_expert_counts(fit).astype(np.float64)
    if beta:
        counts = (1 - beta) * counts + beta * predicted_counts(fit, folds, idf)
    lengths = np.diff(fit.offsets)
    weight = scheduling.request_work(lengths) if work_cap else lengths
    e2d, _, objective = cocluster(counts, weight, E, eps=policy.eps, iters=policy.iters,
                                  restarts=policy.restarts if restarts is None else restarts,
                                  rng=np.random.default_rng(seed), load_slack=policy.load_slack,
                                  load_price=policy.load_price if load_price is None else load_price)
    return Placement(e2d, E, policy.name), objective


def local_and_votes(tables, target):
    """``([R, E] local activations of each request per rank, [R, E] its T2D votes)``."""
    counts = placement_device_counts(target.experts, tables.placement)
    local = np.add.reduceat(counts.sum(axis=1, dtype=np.int64), target.offsets[:-1], axis=0)
    votes = scheduling.request_votes(tables.token_rows(target.tokens), target.offsets,
                                     tables.t2d_score.astype(np.float32), tables.oov_score)
    return local, votes


def knob_curve(local, votes, work, window, least, grid):
    """``[len(grid), 2]``: the router's local activations and window imbalance relative to
    least-loaded's at each ``(balance, price step)`` of ``grid``."""
    rows = np.arange(len(work))
    out = []
    for balance, step in grid:
        rank = scheduling.dp_assign(votes, work, balance, window, False, step)
        out.append((local[rows, rank].sum(), scheduling.window_imbalance(rank, work, E, window) / least))
    return np.array(out)


def measure(tables_from, target, placement, knobs, window):
    """``[oracle, pure, lar_1, ratio_1, ...]`` on ``target`` with tables built on ``tables_from``."""
    activations = target.num_tokens * target.num_layers * target.top_k
    local, votes = local_and_votes(build_tables(tables_from, placement, mode="dp"), target)
    work = scheduling.request_work(np.diff(target.offsets))
    least = scheduling.window_imbalance(scheduling.least_loaded_assign(work, E, window), work, E, window)
    rows = np.arange(target.num_requests)
    curve = knob_curve(local, votes, work, window, least, knobs)
    curve[:, 0] /= activations
    return [local.max(axis=1).sum() / activations, local[rows, votes.argmax(axis=1)].sum() / activations,
            *curve.ravel()]


def fmt(m):
    return f"oracle {m[0]:.4f} pure {m[1]:.4f} " + " ".join(f"{m[i]:.4f}@{m[i + 1]:.3f}" for i in range(2, len(m), 2))


def study_shrink(trace, seeds, variants):
    knobs = [DEFAULT_KNOBS, (128.0, 0.2), (256.0, 0.2), (64.0, 0.4), (128.0, 0.4)]
    print("knobs:", knobs)
    results = {v: [] for v in variants}
    for seed in seeds:
        profile, _ = seed_split(trace, seed)
        a, b = profile.split(0.5, 100 + seed)
        for fit, held in ((a, b), (b, a)):
            for v in variants:
                beta = float(v.rstrip("iwc"))
                placement, _ = solve(fit, seed, beta, idf="i" in v, work_cap="w" in v, folds=5 if "c" in v else 0)
                results[v].append(measure(fit, held, placement, knobs, 64))
                print(f"seed {seed} beta {v}: {fmt(results[v][-1])}", flush=True)
    for v in variants:
        print(f"mean, beta {v}: {fmt(np.mean(results[v], axis=0))}")


def study_restarts(trace, seeds):
    knobs = [(0.0, 0.2), DEFAULT_KNOBS]
    print("knobs:", knobs, "W = 256; columns: profiled objective, then the evaluation figures")
    for seed in seeds:
        profile, evaluation = seed_split(trace, seed)
        rows = []
        for r in range(20):
            placement, objective = solve(profile, 1000 + r, restarts=1)
            rows.append([objective] + measure(profile, evaluation, placement, knobs, 256))
        rows = np.array(rows)
        for row in rows[np.argsort(-rows[:, 0])]:
            print(f"seed {seed}: profiled {row[0]:.4f} | {fmt(row[1:])}")
        corr = [np.corrcoef(rows[:, 0], rows[:, i])[0, 1] for i in (1, 2, 3, 5)]
        print(f"seed {seed}: range over restarts: oracle {rows[:, 1].min():.4f}-{rows[:, 1].max():.4f}, "
              f"knob 0 {rows[:, 3].min():.4f}-{rows[:, 3].max():.4f}, default {rows[:, 5].min():.4f}-"
              f"{rows[:, 5].max():.4f}; correlation of the profiled objective with oracle / pure / "
              f"knob 0 / default: {' / '.join(f'{c:.2f}' for c in corr)}", flush=True)


def study_fit(trace, seeds):
    knobs = [(0.0, 0.2), DEFAULT_KNOBS]
    print("knobs:", knobs, "W = 256")
    for seed in seeds:
        profile, evaluation = seed_split(trace, seed)
        for name, fit in (("profile (as deployed)", profile), ("evaluation requests", evaluation),
                          ("every request", trace.tuning_split()[1] if HOLD_OUT_TUNING else trace)):
            placement, _ = solve(fit, seed)
            print(f"seed {seed}, placement fitted on {name}: {fmt(measure(profile, evaluation, placement, knobs, 256))}",
                  flush=True)


def study_curve(trace, seeds):
    knobs = [(0.0, 0.2)]
    print("knobs:", knobs, "W = 128")
    if HOLD_OUT_TUNING:
        trace = trace.tuning_split()[1]
    for seed in seeds:
        order = np.random.default_rng(50 + seed).permutation(trace.num_requests)
        test = trace.select_requests(np.sort(order[:399]))
        tables_from = trace.select_requests(np.sort(order[399:399 + 280]))
        for n in (n for n in (140, 280, 560, 1000) if 399 + n <= trace.num_requests):
            placement, _ = solve(trace.select_requests(np.sort(order[399:399 + n])), seed)
            print(f"seed {seed}, fitted on {n} requests: {fmt(measure(tables_from, test, placement, knobs, 128))}",
                  flush=True)


def relabel(previous, placement):
    """``placement`` with its devices renamed to keep the most (layer, expert) pairs where
    ``previous`` has them (a perfect matching; fewest expert weights to move)."""
    overlap = np.zeros((E, E))
    np.add.at(overlap, (previous.expert_device.ravel(), placement.expert_device.ravel()), 1)
    label = assign_experts(overlap)  # [new device] -> previous label
    return Placement(label[placement.expert_device], E, placement.method)


def study_online(trace, seeds, block=280):
    knobs = [(0.0, 0.2), DEFAULT_KNOBS]
    window = 256
    print("knobs:", knobs, f"W = {window}, blocks of {block} requests")
    for seed in seeds:
        profile, evaluation = seed_split(trace, seed)
        R = evaluation.num_requests
        work = scheduling.request_work(np.diff(evaluation.offsets))
        least = scheduling.window_imbalance(scheduling.least_loaded_assign(work, E, window), work, E, window)
        profiled = np.searchsorted(trace.request_ids, profile.request_ids)
        served = np.searchsorted(trace.request_ids, evaluation.request_ids)
        for online in ("none", "tables", "placement"):
            local = np.zeros((R, E))
            votes = np.zeros((R, E))
            moved, placement = [], None
            for start in range(0, R, block):
                requests = np.arange(start, min(start + block, R))
                if placement is None or online != "none":
                    seen = trace.select_requests(np.sort(np.concatenate([profiled, served[:start]])))
                    if placement is None or online == "placement":
                        new, _ = solve(seen, seed)
                        if placement is not None:
                            new = relabel(placement, new)
                            moved.append(float((new.expert_device != placement.expert_device).mean()))
                        placement = new
                    tables = build_tables(seen, placement, mode="dp")
                local[requests], votes[requests] = local_and_votes(tables, evaluation.select_requests(requests))
            activations = evaluation.num_tokens * evaluation.num_layers * evaluation.top_k
            rows = np.arange(R)
            m = [local.max(axis=1).sum() / activations, local[rows, votes.argmax(axis=1)].sum() / activations]
            for balance, step in knobs:  # one router over the whole stream: prices and loads carry on
                rank = scheduling.dp_assign(votes, work, balance, window, False, step)
                m += [local[rows, rank].sum() / activations, scheduling.window_imbalance(rank, work, E, window) / least]
            what = {"none": "profile placement and tables",
                    "tables": f"profile placement, tables rebuilt every {block} requests",
                    "placement": f"re-placed every {block} requests (experts moved per re-placement: "
                                 + ", ".join(f"{x:.0%}" for x in moved) + ")"}[online]
            print(f"seed {seed}, {what}: {fmt(m)}", flush=True)


def windowed_optimum(local, work, window, rho):
    """``[R]`` rank per request, with look-ahead and perfect foresight: each window of ``window``
    consecutive requests assigned offline to maximise its local activations with every rank's
    work at most ``rho`` × the window's mean (:func:`.scheduling.balanced_assignment`)."""
    rank = np.empty(len(work), np.int64)
    for s in range(0, len(work), window):
        w = work[s:s + window]
        rank[s:s + window], _ = scheduling.balanced_assignment(
            local[s:s + window] / w[:, None], w, rho * w.sum() / E, 400)
    return rank


def study_foresight(trace, seeds, window=256, bar=1.05):
    grid = [(b, s) for b in (0.0, 4.0, 16.0, 64.0, 256.0) for s in (0.05, 0.1, 0.2, 0.4, 0.8, 1.6)]
    print(f"W = {window}; knobs: the best of {len(grid)} within {bar}x least-loaded's window imbalance, "
          "chosen with hindsight on the evaluation requests, per seed or one pair for every seed")
    oracle, optimum, curves = [], [], {"T2D votes (as served)": [], "true counts (perfect foresight)": []}
    for seed in seeds:
        profile, evaluation = seed_split(trace, seed)
        placement, _ = solve(profile, seed)
        local, votes = local_and_votes(build_tables(profile, placement, mode="dp"), evaluation)
        local = local.astype(np.float64)
        activations = evaluation.num_tokens * evaluation.num_layers * evaluation.top_k
        work = scheduling.request_work(np.diff(evaluation.offsets))
        least = scheduling.window_imbalance(scheduling.least_loaded_assign(work, E, window), work, E, window)
        for name, v in zip(curves, (votes, local)):
            curve = knob_curve(local, v, work, window, least, grid)
            curve[:, 0] /= activations
            curves[name].append(curve)
        rank = windowed_optimum(local, work, window, bar * least)
        oracle.append(local.max(axis=1).sum() / activations)
        optimum.append((local[np.arange(len(work)), rank].sum() / activations,
                        scheduling.window_imbalance(rank, work, E, window) / least))
        line = [f"seed {seed}: oracle {oracle[-1]:.4f}"]
        for name in curves:
            c = curves[name][-1]
            ok = np.nonzero(c[:, 1] <= bar)[0]
            i = ok[np.argmax(c[ok, 0])]
            line.append(f"online router, {name} {c[i, 0]:.4f} @ {c[i, 1]:.3f} {grid[i]}")
        line.append(f"per-window optimum, true counts {optimum[-1][0]:.4f} @ {optimum[-1][1]:.3f}")
        print(" | ".join(line), flush=True)
    print(f"oracle {np.mean(oracle):.4f} ± {np.std(oracle):.4f}; per-window optimum with perfect foresight "
          f"{np.mean([o[0] for o in optimum]):.4f} ± {np.std([o[0] for o in optimum]):.4f}")
    for name, c in curves.items():
        c = np.array(c)  # [seeds, grid, 2]
        per_seed = [ci[np.nonzero(ci[:, 1] <= bar)[0]][:, 0].max(initial=0.0) for ci in c]
        ok = np.nonzero(c[:, :, 1].max(axis=0) <= bar)[0]
        i = ok[np.argmax(c[:, ok, 0].mean(axis=0))]
        print(f"online router, {name}: knobs per seed {np.mean(per_seed):.4f} ± {np.std(per_seed):.4f}; "
              f"one pair for every seed {grid[i]}: {c[:, i, 0].mean():.4f} ± {c[:, i, 0].std():.4f} "
              f"(worst seed {c[:, i, 0].min():.4f}, ratio at most {c[:, i, 1].max():.3f})")


def previous_rows(rows, offsets):
    """``[T]`` the table row of each token's predecessor in its request (``-1``: first token)."""
    prev = np.full(len(rows), -1, np.int64)
    prev[1:] = rows[:-1]
    prev[offsets[:-1]] = -1
    return prev


def bigram_votes(tables, profile, placement, target, beta):
    """``[R, E]`` T2D votes of ``target``'s requests with each token's row conditioned on its
    predecessor: a (previous token, token) pair seen in the profile votes its own mean local
    activations per rank, smoothed towards the token's row with ``beta`` pseudo-occurrences
    (and IDF-weighted as the token's row is); other tokens vote their row, as served."""
    K = profile.top_k
    J = len(tables.t2d_tokens)
    unigram = tables.t2d_score.astype(np.float64).sum(axis=0)  # [J, E], IDF-weighted, summed over layers
    idf = request_idf(profile, tables.t2d_tokens)
    rows = tables.token_rows(profile.tokens)
    keys = (previous_rows(rows, profile.offsets) + 1) * (J + 1) + rows
    pairs, pair = np.unique(keys, return_inverse=True)
    shares = np.zeros((len(pairs), E))
    np.add.at(shares, pair, placement_device_counts(profile.experts, placement).sum(axis=1) / K)
    seen = np.bincount(pair, minlength=len(pairs)).astype(np.float64)
    rows = tables.token_rows(target.tokens)
    prev = previous_rows(rows, target.offsets)
    keys = (prev + 1) * (J + 1) + rows
    at = np.minimum(np.searchsorted(pairs, keys), len(pairs) - 1)
    hit = (pairs[at] == keys) & (rows >= 0) & (prev >= 0)
    token = np.where(rows[:, None] >= 0, unigram[np.maximum(rows, 0)],
                     tables.oov_score.astype(np.float64).sum(axis=0)[None, :])
    j = rows[hit]
    token[hit] = (shares[at[hit]] + beta * unigram[j] / idf[j, None]) / (seen[at[hit], None] + beta) * idf[j, None]
    votes = np.zeros((target.num_requests, E))
    np.add.at(votes, np.repeat(np.arange(target.num_requests), np.diff(target.offsets)), token)
    return votes, hit.mean()


def _summary(name, rows, knobs):
    r = np.array(rows)  # [seeds, 2 + 2 * knobs]
    cells = [f"{k} {r[:, 2 + 2 * i].mean():.4f} ± {r[:, 2 + 2 * i].std():.4f} (worst seed {r[:, 3 + 2 * i].max():.3f}x)"
             for i, k in enumerate(knobs)]
    print(f"{name}: oracle {r[:, 0].mean():.4f} pure {r[:, 1].mean():.4f} | " + " | ".join(cells), flush=True)


def study_bigram(trace, seeds, betas=(1.0, 4.0, 16.0), window=256):
    knobs = [DEFAULT_KNOBS, (0.0, 0.2), (16.0, 0.2)]
    print("knobs:", knobs, f"W = {window}; votes: the served T2D rows, or rows conditioned on the previous token")
    results = {b: [] for b in (None, *betas)}
    for seed in seeds:
        profile, evaluation = seed_split(trace, seed)
        placement, _ = solve(profile, seed)
        tables = build_tables(profile, placement, mode="dp")
        local, served = local_and_votes(tables, evaluation)
        activations = evaluation.num_tokens * evaluation.num_layers * evaluation.top_k
        work = scheduling.request_work(np.diff(evaluation.offsets))
        least = scheduling.window_imbalance(scheduling.least_loaded_assign(work, E, window), work, E, window)
        rows = np.arange(evaluation.num_requests)
        for beta in results:
            votes, hit = (served, None) if beta is None else bigram_votes(tables, profile, placement, evaluation, beta)
            curve = knob_curve(local, votes, work, window, least, knobs)
            curve[:, 0] /= activations
            results[beta].append([local.max(axis=1).sum() / activations,
                                  local[rows, votes.argmax(axis=1)].sum() / activations, *curve.ravel()])
            label = "served" if beta is None else f"bigram beta {beta:g} (pairs seen: {hit:.3f} of tokens)"
            print(f"seed {seed}, {label}: {fmt(results[beta][-1])}", flush=True)
    for beta, rows in results.items():
        _summary("served votes" if beta is None else f"bigram beta {beta:g}", rows, knobs)


def study_theta(trace, seeds, thetas=(None, 0.0)):
    knobs = [DEFAULT_KNOBS, (0.0, 0.2), (16.0, 0.2)]
    print("knobs:", knobs, "W = 256; θ: the DP co-clustering's expert-load price (None: as deployed)")
    for theta in thetas:
        rows, imbalance = [], []
        for seed in seeds:
            profile, evaluation = seed_split(trace, seed)
            placement, _ = solve(profile, seed, load_price=theta)
            rows.append(measure(profile, evaluation, placement, knobs, 256))
            experts = evaluation.experts.astype(np.int64)  # [T, L, K]
            e2d = placement.expert_device
            imbalance.append(np.mean([np.bincount(e2d[l][experts[:, l]].ravel(), minlength=E).max()
                                      / (experts[:, l].size / E) for l in range(experts.shape[1])]))
            print(f"seed {seed}, θ {theta}: {fmt(rows[-1])} expert imbalance {imbalance[-1]:.4f}", flush=True)
        _summary(f"θ {theta} (expert imbalance {np.mean(imbalance):.4f})", rows, knobs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("study", choices=("shrink", "restarts", "fit", "curve", "online", "foresight", "bigram", "theta"))
    parser.add_argument("--seeds", default=None, help="default: 0-4 for shrink, 0,1 otherwise")
    parser.add_argument("--variants", default="0,0.25,0.5,0.75,1,0.5i,0.5w,0.5c,1c")
    parser.add_argument("--block", type=int, default=280, help="online: requests served between re-solves")
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument("--hold-out-tuning", action=argparse.BooleanOptionalAction, default=True,
                        help="keep the tuning split out of every profile and evaluation set (default)")
    args = parser.parse_args()
    global HOLD_OUT_TUNING
    HOLD_OUT_TUNING = args.hold_out_tuning
    trace = load_trace(args.trace)
    seeds = [int(s) for s in (args.seeds or ("0,1,2,3,4" if args.study == "shrink" else "0,1")).split(",")]
    start = time.time()
    if args.study == "shrink":
        study_shrink(trace, seeds, args.variants.split(","))
    elif args.study == "online":
        study_online(trace, seeds, args.block)
    else:
        {"restarts": study_restarts, "fit": study_fit, "curve": study_curve,
         "foresight": study_foresight, "bigram": study_bigram, "theta": study_theta}[args.study](trace, seeds)
    print(f"({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
