"""Online data scheduling decisions (Numba): which device a token or a request goes to.

Pure functions over plain arrays so that the vLLM adapter, the offline evaluator and the
benchmarks all call the same code. Scores are "share of the token's activations that would be
local on each device" as stored in :class:`~vllm_semmoe.core.tables.SemMoETables`.

- Attention-TP (intra-request): :func:`tp_expert_scores` scores devices per token from T2D and
  the experts the token activated at the two previous layers (the X table; :func:`tp_layer_scores`
  is the paper's rule with the A table, for tables without X); :func:`align` gives every rank at most ``ceil(B/E)`` tokens, spilling to the
  next-best rank; :func:`shuffle_permutation` turns the result into the permutation applied by
  the shuffled reduce-scatter and its inverse (applied by the shuffled all-gather).
- Attention-DP (inter-request): :func:`request_votes` sums T2D votes over a prompt;
  :func:`dp_assign` picks ranks by :func:`dp_choose_balanced` (locality against the
  ranks' work, :func:`request_work`: prompt tokens plus a decode weight); :func:`least_loaded_assign`,
  :func:`round_robin_assign` and SGLang's DP-attention balancers (:func:`sglang_total_requests_assign`,
  :func:`sglang_total_tokens_assign`) are the locality-blind references, :func:`window_imbalance` the
  lock-step balance figure; :func:`dp_balanced_values` is what :func:`dp_choose_balanced` maximises,
  for every rank (a rank ranking for an outside router, :mod:`.route`).
"""

from __future__ import annotations

import numba
import numpy as np

PAD = -1  # slot without a token in an aligned slice


# ---- Attention-TP ----------------------------------------------------------------------------
COMBINE_CONFIDENCE = 0  # the paper: use T2D or A, whichever is more confident
COMBINE_PRODUCT = 1  # both as independent evidence: T2D · A / prior, normalised


@numba.njit(cache=True, nogil=True)
def tp_layer_scores(rows, history, t2d_layer, oov_layer, markov_layer, combine):
    """Per-token device scores at one layer from T2D and the A table.

    Args:
        rows: ``[B]`` int64 row of each token in ``t2d_layer`` (``-1``: unseen → ``oov_layer``).
        history: ``[B]`` int64 ``d2 * E + d1`` (majority devices at the two previous layers),
            or ``-1`` when unknown (first two layers); then only T2D is used.
        t2d_layer: ``[J, E]`` float32; oov_layer: ``[E]`` (the layer prior); markov_layer:
            ``[E*E, E]``.
        combine: ``COMBINE_CONFIDENCE`` (pick the more confident table, as in the paper) or
            ``COMBINE_PRODUCT`` (naive-Bayes product of both, relative to the prior).
    Returns:
        ``[B, E]`` float32 scores (a distribution over devices per token).
    """
    B = len(rows)
    E = oov_layer.shape[0]
    scores = np.empty((B, E), np.float32)
    for b in range(B):
        for e in range(E):
            scores[b, e] = t2d_layer[rows[b], e] if rows[b] >= 0 else oov_layer[e]
        h = history[b]
        if h < 0:
            continue
        if combine == COMBINE_CONFIDENCE:
            if markov_layer[h].max() > scores[b].max():
                for e in range(E):
                    scores[b, e] = markov_layer[h, e]
        else:
            total = 0.0
            for e in range(E):
                scores[b, e] = scores[b, e] * markov_layer[h, e] / max(oov_layer[e], 1e-9)
                total += scores[b, e]
            for e in range(E):
                scores[b, e] /= max(total, 1e-30)
    return scores


#: default weights of :func:`tp_expert_scores`: (T2D exponent, lag-1 weight, lag-2 weight),
#: chosen on a 50/50 split of the tuning split only (``trace.TUNING_FRAC``,
#: ``scripts/tune_tp_evidence.py``)
TP_EVIDENCE_WEIGHTS = (0.3, 0.3, 0.2)


@numba.njit(cache=True, nogil=True)
def tp_expert_scores(rows, prev, t2d_layer, oov_layer, log_evidence, log_prior, holds, weights):
    """Per-token device scores at one layer from T2D and the token's earlier experts.

    The experts of layer ``l`` are predicted from those the token activated at layers ``l-1``
    and ``l-2`` (known when layer ``l``'s shuffle is decided) as a tempered naive-Bayes
    product, ``log q(m) = log p(m) + Σ_j w_j Σ_{n ∈ prev_j} log(X_j[n, m] / p(m))``, normalised;
    ``q`` summed over the experts each device holds is the share of activations local there,
    which multiplies T2D's (raised to ``w_0``) relative to the layer prior. Weights below 1
    temper evidence that is not independent (a token's experts are correlated).

    Args:
        rows: ``[B]`` int64 row of each token in ``t2d_layer`` (``-1``: unseen → ``oov_layer``).
        prev: ``[B, 2, K]`` int64 logical experts of each token at layers ``l-1`` and ``l-2``
            (``-1``: unknown, e.g. at the first layers).
        t2d_layer: ``[J, E]`` float32; oov_layer: ``[E]`` (the layer prior over devices).
        log_evidence: ``[2, N, N]`` float32 ``log(X / p)`` (:meth:`.tables.SemMoETables.log_evidence`).
        log_prior: ``[N]`` float32 ``log p`` of the layer's experts.
        holds: ``[N, E]`` float32, 1 where device ``e`` holds a copy of expert ``n``.
        weights: ``[3]`` float64 (T2D exponent, lag-1 weight, lag-2 weight).
    Returns:
        ``[B, E]`` float32 scores (a distribution over devices per token).
    """
    B = len(rows)
    N, E = holds.shape
    K = prev.shape[2]
    scores = np.empty((B, E), np.float32)
    logs = np.empty(E)
    q = np.empty(N)
    for b in range(B):
        known = False
        for j in range(prev.shape[1]):
            for k in range(K):
                if prev[b, j, k] >= 0:
                    known = True
        for e in range(E):
            base = t2d_layer[rows[b], e] if rows[b] >= 0 else oov_layer[e]
            logs[e] = weights[0] * np.log(max(base, 1e-9))
        if known:
            for m in range(N):
                q[m] = log_prior[m]
            for j in range(prev.shape[1]):
                for k in range(K):
                    n = prev[b, j, k]
                    if n >= 0:
                        for m in range(N):
                            q[m] += weights[1 + j] * log_evidence[j, n, m]
            _softmax(q)
            for e in range(E):
                local = 0.0
                for m in range(N):
                    local += q[m] * holds[m, e]
                logs[e] += np.log(max(local, 1e-9) / max(oov_layer[e], 1e-9))
        _softmax(logs)
        for e in range(E):
            scores[b, e] = logs[e]
    return scores


@numba.njit(cache=True)
def _softmax(x):
    """``x [n]`` float64 log-weights → their normalised exponentials, in place."""
    top = x.max()
    total = 0.0
    for i in range(len(x)):
        x[i] = np.exp(x[i] - top)
        total += x[i]
    for i in range(len(x)):
        x[i] /= total


@numba.njit(cache=True)
def balanced_assignment(score, weight, cap, rounds):
    """Assign units to devices maximising ``Σ weight·score`` with device load <= cap.

    Lagrangian prices on devices are raised while a device is over its cap; whatever is still
    over after ``rounds`` is repaired by moving the units that lose least to their next-best
    device with room.

    Args:
        score: ``[U, E]`` value of each unit on each device (its local activation share).
        weight: ``[U]`` load of each unit (tokens).
        cap: the most load a device may take (``Σ weight <= E · cap`` for a feasible answer).
        rounds: price-update rounds.
    Returns:
        ``([U] int64 device per unit, [E] final device prices)``.
    """
    U, E = score.shape
    price = np.zeros(E)
    device = np.zeros(U, np.int64)
    load = np.zeros(E)
    step = 0.05 * (score.max() - score.min() + 1e-9)
    for _ in range(rounds):
        load[:] = 0.0
        for u in range(U):
            best, best_value = 0, score[u, 0] - price[0]
            for e in range(1, E):
                value = score[u, e] - price[e]
                if value > best_value:
                    best, best_value = e, value
            device[u] = best
            load[best] += weight[u]
        if load.max() <= cap:
            break
        for e in range(E):
            price[e] = max(0.0, price[e] + step * (load[e] / cap - 1.0))
        step *= 0.93
    # repair: move the cheapest units out of devices still over the cap
    if np.all(weight == 1.0):
        repair_unit(score, device, load, cap)
    else:
        _repair_weighted(score, weight, device, load, cap)
    return device, price


@numba.njit(cache=True, nogil=True)
def align(scores, capacity):
    """Assign tokens to devices, exactly at most ``capacity`` each, maximising total score.

    The batch-level optimum under equal slices (prices on over-subscribed devices), so tokens
    that lose least overflow to their next-best rank.

    Args:
        scores: ``[B, E]``; capacity: slots per device, ``E * capacity >= B``.
    Returns:
        ``[B]`` int64 device per token.
    """
    device, _ = balanced_assignment(scores.astype(np.float64), np.ones(scores.shape[0]), float(capacity), 40)
    return device


@numba.njit(cache=True)
def _repair_weighted(score, weight, device, load, cap):
    """The repair of :func:`balanced_assignment`, any weights: while a device is over ``cap``,
    move the unit of the most loaded device that loses least (``score[u, over] - score[u, e]``;
    ties: lowest ``u``, then lowest ``e``) to a device with room. ``device [U]`` and ``load [E]``
    are updated in place. ``O(moves · U · E)``."""
    U, E = score.shape
    for _ in range(U):
        over = np.argmax(load)
        if load[over] <= cap:
            break
        best_u, best_e, best_loss = -1, -1, np.inf
        for u in range(U):
            if device[u] != over:
                continue
            for e in range(E):
                if e != over and load[e] + weight[u] <= cap:
                    loss = score[u, over] - score[u, e]
                    if loss < best_loss:
                        best_u, best_e, best_loss = u, e, loss
        if best_u < 0:
            break
        device[best_u] = best_e
        load[over] -= weight[best_u]
        load[best_e] += weight[best_u]


@numba.njit(cache=True)
def _best_target(score, load, cap, u, over):
    """``(loss, e)``: the first device ``e != over`` with room for one more unit that minimises
    ``score[u, over] - score[u, e]``; ``(inf, -1)`` when none has room."""
    best_e, best_loss = -1, np.inf
    for e in range(score.shape[1]):
        if e != over and load[e] + 1.0 <= cap:
            loss = score[u, over] - score[u, e]
            if loss < best_loss:
                best_e, best_loss = e, loss
    return best_loss, best_e


@numba.njit(cache=True)
def _before(hl, hu, i, j):
    return hl[i] < hl[j] or (hl[i] == hl[j] and hu[i] < hu[j])


@numba.njit(cache=True)
def _sift_down(hl, hu, lo, n, i):
    """Restore the (loss, unit) min-heap ``hl/hu[lo:lo+n]`` below its entry ``i``."""
    while True:
        c = 2 * i + 1
        if c >= n:
            return
        if c + 1 < n and _before(hl, hu, lo + c + 1, lo + c):
            c += 1
        if not _before(hl, hu, lo + c, lo + i):
            return
        hl[lo + c], hl[lo + i] = hl[lo + i], hl[lo + c]
        hu[lo + c], hu[lo + i] = hu[lo + i], hu[lo + c]
        i = c


@numba.njit(cache=True)
def repair_unit(score, device, load, cap):
    """:func:`_repair_weighted` for unit weights, the same moves in ``O((moves + U) log U · E)``.

    Each device over ``cap`` keeps a min-heap of its units keyed by (loss to the best device
    with room, unit). Devices only lose room (a move fills its target; the over device stays
    over until it reaches ``cap``), so a unit's best target stays best while it has room: an
    entry whose target has filled is recomputed when it reaches the top (its loss can only
    grow), and the top valid entry is the sequential loop's choice, ties included.

    Args:
        score: ``[U, E]`` float64; device: ``[U]`` int64 and load: ``[E]`` float64 (its counts),
        both updated in place; cap: the most units a device may hold.
    Returns:
        ``device``.
    """
    U, E = score.shape
    if U == 0:
        return device
    start = np.zeros(E + 1, np.int64)
    for u in range(U):
        start[device[u] + 1] += 1
    for e in range(E):
        start[e + 1] += start[e]
    size = np.zeros(E, np.int64)
    built = np.zeros(E, np.bool_)
    target = np.full(U, -1, np.int64)
    hl = np.empty(U)
    hu = np.empty(U, np.int64)
    for _ in range(U):
        over = np.argmax(load)
        if load[over] <= cap:
            break
        lo = start[over]
        if not built[over]:
            built[over] = True
            n = 0
            for u in range(U):
                if device[u] == over:
                    loss, e = _best_target(score, load, cap, u, over)
                    if e >= 0:
                        hl[lo + n], hu[lo + n], target[u] = loss, u, e
                        n += 1
            size[over] = n
            for i in range(n // 2 - 1, -1, -1):
                _sift_down(hl, hu, lo, n, i)
        moved = -1
        while size[over] > 0:
            u = hu[lo]
            if load[target[u]] + 1.0 <= cap:
                moved = u
                break
            loss, e = _best_target(score, load, cap, u, over)
            if e < 0:  # no device has room for it, nor will
                size[over] -= 1
                hl[lo], hu[lo] = hl[lo + size[over]], hu[lo + size[over]]
            else:
                hl[lo], target[u] = loss, e
            _sift_down(hl, hu, lo, size[over], 0)
        if moved < 0:
            break
        size[over] -= 1
        hl[lo], hu[lo] = hl[lo + size[over]], hu[lo + size[over]]
        _sift_down(hl, hu, lo, size[over], 0)
        device[moved] = target[moved]
        load[over] -= 1.0
        load[target[moved]] += 1.0
    return device


@numba.njit(cache=True)
def shuffle_permutation(device, ep_size, capacity):
    """Permutation that groups tokens by device into equal slices.

    Args:
        device: ``[B]`` target device of each token (at most ``capacity`` per device).
    Returns:
        ``slot_token [E * capacity]``: token in each slot (``PAD`` = -1 where a slice is not
        full); slice ``e`` is ``slot_token[e*capacity:(e+1)*capacity]``, tokens in original order.
        ``token_slot [B]``: the inverse, slot of each token.
    """
    B = len(device)
    slot_token = np.full(ep_size * capacity, -1, np.int64)
    token_slot = np.empty(B, np.int64)
    fill = np.zeros(ep_size, np.int64)
    for b in range(B):
        e = device[b]
        s = e * capacity + fill[e]
        fill[e] += 1
        slot_token[s] = b
        token_slot[b] = s
    return slot_token, token_slot


def slice_capacity(num_tokens: int, ep_size: int) -> int:
    """Equal slice size of the shuffled reduce-scatter: ``ceil(B / E)`` (at least 1)."""
    return max(1, -(-num_tokens // ep_size))


def contiguous_slices(num_tokens: int, ep_size: int) -> np.ndarray:
    """``[B]`` device per token under the engines' default reduce-scatter: equal contiguous
    slices of ``ceil(B/E)`` tokens (what vLLM/SGLang do without Sem-MoE)."""
    return np.arange(num_tokens) // slice_capacity(num_tokens, ep_size)


def tp_decide(scores: np.ndarray, ep_size: int):
    """One layer's Attention-TP decision for a batch scored ``[B, E]``
    (:func:`tp_expert_scores` or :func:`tp_layer_scores`).

    Returns ``(device [B], slot_token [E*cap], token_slot [B])``; see :func:`align` and
    :func:`shuffle_permutation`.
    """
    cap = slice_capacity(len(scores), ep_size)
    device = align(scores, cap)
    slot_token, token_slot = shuffle_permutation(device, ep_size, cap)
    return device, slot_token, token_slot


def tp_schedule(rows, history, t2d_layer, oov_layer, markov_layer, ep_size: int,
                combine: int = COMBINE_PRODUCT):
    """:func:`tp_decide` on the A-table rule's scores (:func:`tp_layer_scores`)."""
    return tp_decide(tp_layer_scores(rows, history, t2d_layer, oov_layer, markov_layer, combine), ep_size)


# ---- Attention-DP ----------------------------------------------------------------------------
@numba.njit(cache=True)
def request_votes(rows, offsets, t2d_score, oov_score):
    """T2D votes of each request: predicted local activations (in top-k units) per rank.

    Args:
        rows: ``[T]`` int64 token rows (``-1`` unseen); offsets: ``[R+1]`` request bounds.
        t2d_score: ``[L, J, E]`` float32; oov_score: ``[L, E]``.
    Returns:
        ``[R, E]`` float64, summed over the request's tokens and all layers.
    """
    L, J, E = t2d_score.shape
    R = len(offsets) - 1
    votes = np.zeros((R, E))
    for r in range(R):
        for t in range(offsets[r], offsets[r + 1]):
            j = rows[t]
            for l in range(L):
                for e in range(E):
                    votes[r, e] += t2d_score[l, j, e] if j >= 0 else oov_score[l, e]
    return votes


#: Decode weight of a request when nothing better is known: tokens it will generate.
DEFAULT_DECODE_WEIGHT = 128.0

#: defaults of the DP rule's two balance knobs (:func:`dp_choose_balanced`), chosen on the
#: tuning split only (``trace.TUNING_FRAC``), on arrival streams drawn from it and balanced over
#: the deployed window (``scripts/tune_dp_price.py``; see benchmarks/SEEDS.md)
DEFAULT_DP_BALANCE = 32.0
DEFAULT_DP_PRICE_STEP = 0.2


def request_work(lengths: np.ndarray, decode_weight: float = DEFAULT_DECODE_WEIGHT) -> np.ndarray:
    """``[R]`` float64 work of each request: prompt tokens plus a per-request decode weight.

    DP attention ranks run in lock step, so what a rank must carry is its prefill tokens plus
    one decode token per running request per step; ``decode_weight`` (the expected output
    length: the profile's mean where known, else :data:`DEFAULT_DECODE_WEIGHT`) puts the two
    on one scale. ``lengths``: ``[R]`` prompt tokens.
    """
    return np.maximum(np.asarray(lengths, np.float64), 1.0) + float(decode_weight)


def balance_window(ep_size: int) -> int:
    """Requests per balance window, ``W = 32 × ranks``: long enough for the long-tailed prompt
    lengths (the longest prompt is ~4x a rank's mean load in a 64-request window)."""
    return 32 * int(ep_size)


@numba.njit(cache=True)
def dp_choose_balanced(votes, load, mean_work, work, balance, price, price_step):
    """One online DP decision for lock-stepped ranks: the rank maximising

        votes[e]  -  work · (price[e] + balance · (load[e] - min(load)) / mean_work²),

    then the chosen rank's price rises (``price`` is updated in place).

    Votes are absolute (predicted local activations), and the request pays per unit of its
    work, so locality is given up where it costs least: a long prompt with a clear preference
    keeps its rank, short requests (mostly decode work) and requests with flat votes fill the
    other ranks. Two balance terms:

    - ``price[e]``: a per-rank price in votes per unit of work, learned online from the
      router's own decisions: the chosen rank's price rises by ``price_step · work / mean_work``
      and every price then falls by the same total spread evenly (prices keep a zero mean).
      It settles where each rank attracts an equal share of the work (the dual prices of the
      balanced assignment), so the balance costs little locality: requests with near-ties move,
      clear preferences stay.
    - ``balance``: a proportional term on the work each rank carries now beyond the
      least-loaded one (the marginal cost of a quadratic load penalty), which absorbs what the
      slow prices cannot: bursts of long prompts, ranks that finish late.

    ``balance = price_step = 0`` is pure locality; large values approach the least-loaded
    balancer.

    Args:
        votes: ``[E]`` predicted local activations per rank (:func:`request_votes`); a rank the
            caller excludes has ``-inf`` (at least one must be finite).
        load: ``[E]`` work per rank now: in serving the in-flight work (prompt plus tokens
            generated so far of running requests); offline the work of the rank's requests among
            the last ``W`` (see :func:`dp_assign`).
        mean_work: the mean work of one request (scales ``load`` and the price step).
        work: this request's work (:func:`request_work`).
        balance: the proportional knob, in votes per unit of work per mean request of load gap.
        price: ``[E]`` float64 the ranks' prices (zeros at start); updated in place.
        price_step: how fast prices follow the work each rank is given.
    Returns:
        The chosen rank (ties → lowest).
    """
    E = votes.shape[0]
    chosen = int(np.argmax(_balanced_values(votes, load, mean_work, work, balance, price)))  # ties: lowest
    step = price_step * work / max(mean_work, 1e-30)
    price[chosen] += step
    for e in range(E):
        price[e] -= step / E
    return chosen


@numba.njit(cache=True)
def dp_assign(votes, work, balance, window, round_robin_mask, price_step=DEFAULT_DP_PRICE_STEP):
    """Choose a DP rank per request, in arrival order (no look-ahead), by T2D votes, balanced.

    Each request goes through :func:`dp_choose_balanced` with every rank's work over the last
    ``window`` requests (a stand-in for in-flight work: requests finish roughly in arrival
    order), the mean request work so far, and the prices of the decisions so far (from zero).

    With ``round_robin_mask`` the paper's rule is used instead: within every ``E``
    consecutive requests each rank is chosen once (best-voted free rank, arrival order).

    Args:
        votes: ``[R, E]`` predicted local activations per rank; work: ``[R]`` what the balance
            counts (:func:`request_work`); balance, price_step: the knobs of
            :func:`dp_choose_balanced`.
    Returns:
        ``[R]`` int64 rank per request.
    """
    R, E = votes.shape
    rank = np.empty(R, np.int64)
    load = np.zeros(E)
    price = np.zeros(E)
    eligible = np.ones(E, np.bool_)
    total = 0.0
    for r in range(R):
        total += work[r]
        if round_robin_mask:
            if r % E == 0:
                eligible[:] = True
            ranking = np.argsort(-votes[r], kind="mergesort")
            for k in range(E):
                if eligible[ranking[k]]:
                    rank[r] = ranking[k]
                    eligible[ranking[k]] = False
                    break
        else:
            rank[r] = dp_choose_balanced(votes[r], load, total / (r + 1), work[r], balance, price, price_step)
        load[rank[r]] += work[r]
        if r >= window:
            load[rank[r - window]] -= work[r - window]
    return rank


@numba.njit(cache=True)
def least_loaded_assign(work, ep_size, window):
    """Online least-loaded balancer (no locality): each request, in arrival order, to the rank
    with the least work over the last ``window`` requests (ties → lowest rank).

    work: ``[R]``. Returns ``[R]`` int64 rank per request.
    """
    R = len(work)
    rank = np.empty(R, np.int64)
    load = np.zeros(ep_size)
    for r in range(R):
        rank[r] = np.argmin(load)
        load[rank[r]] += work[r]
        if r >= window:
            load[rank[r - window]] -= work[r - window]
    return rank


@numba.njit(cache=True)
def sglang_total_requests_assign(num_requests, ep_size, window):
    """SGLang's ``--load-balance-method total_requests`` (no locality): each request, in arrival
    order, to the rank with the fewest requests among the last ``window`` (ties → lowest rank).

    SGLang (``python/sglang/srt/managers/data_parallel_controller.py``,
    ``DataParallelController.total_requests_scheduler`` → ``DPBudget.dispatch``): the rank is
    ``total_requests.index(min(total_requests))``, then its count rises by one; the counts are
    reset from each rank scheduler's load snapshot (``DPBudget.update_budget``: running plus
    waiting requests), at most every 20 ms. Here the requests still in flight are the last
    ``window`` (as in :func:`least_loaded_assign`); the snapshot's delay is not modelled.

    Returns ``[num_requests]`` int64 rank per request.
    """
    rank = np.empty(num_requests, np.int64)
    count = np.zeros(ep_size, np.int64)
    for r in range(num_requests):
        best = 0
        for e in range(1, ep_size):
            if count[e] < count[best]:
                best = e
        rank[r] = best
        count[best] += 1
        if r >= window:
            count[rank[r - window]] -= 1
    return rank


@numba.njit(cache=True)
def sglang_total_tokens_assign(tokens, ep_size, window):
    """SGLang's ``--load-balance-method total_tokens`` (no locality): each request, in arrival
    order, to the rank holding the fewest tokens of the last ``window`` requests; ties → the
    rank with fewer of those requests, then the lowest rank.

    SGLang (``python/sglang/srt/managers/data_parallel_controller.py``,
    ``DataParallelController.total_tokens_scheduler`` → ``DPBudget.dispatch``): the rank is
    ``min(range(dp_size), key=lambda i: (total_tokens[i], total_requests[i]))``, then its token
    count rises by the request's ``len(input_ids)`` (its prompt) and its request count by one;
    both are reset from the rank schedulers' load snapshots (``DPBudget.update_budget``:
    ``num_total_tokens``, running plus waiting requests). Here the requests still in flight are
    the last ``window`` and each holds what the dispatch adds, its prompt (the snapshot's
    generated tokens and delay are not modelled).

    Args:
        tokens: ``[R]`` prompt tokens of each request (what one dispatch adds).
    Returns:
        ``[R]`` int64 rank per request.
    """
    R = len(tokens)
    rank = np.empty(R, np.int64)
    held = np.zeros(ep_size)
    count = np.zeros(ep_size, np.int64)
    for r in range(R):
        best = 0
        for e in range(1, ep_size):
            if held[e] < held[best] or (held[e] == held[best] and count[e] < count[best]):
                best = e
        rank[r] = best
        held[best] += tokens[r]
        count[best] += 1
        if r >= window:
            held[rank[r - window]] -= tokens[r - window]
            count[rank[r - window]] -= 1
    return rank


def dp_balanced_values(votes: np.ndarray, load: np.ndarray, mean_work: float, work: float, balance: float,
                       price: np.ndarray) -> np.ndarray:
    """``[E]`` float64 the value :func:`dp_choose_balanced` gives each rank (the rank it chooses
    is the first maximum), without changing ``price``:

        votes[e]  -  work · (price[e] + balance · (load[e] - min(load)) / mean_work²).

    Arguments as :func:`dp_choose_balanced`'s.
    """
    return _balanced_values(np.asarray(votes, np.float64), np.asarray(load, np.float64), float(mean_work),
                            float(work), float(balance), np.asarray(price, np.float64))


@numba.njit(cache=True)
def _balanced_values(votes, load, mean_work, work, balance, price):
    """:func:`dp_balanced_values` on float64 arrays (the one statement of the DP rule's value)."""
    mean_work = max(mean_work, 1e-30)
    gap = balance / (mean_work * mean_work)
    return votes - work * (price + gap * (load - load.min()))


def round_robin_assign(num_requests: int, ep_size: int) -> np.ndarray:
    """``[R]`` int64: request ``r`` to rank ``r mod E`` (vLLM's default without load stats)."""
    return np.arange(num_requests) % ep_size


def window_imbalance(rank: np.ndarray, work: np.ndarray, ep_size: int, window: int) -> float:
    """Mean over consecutive windows of ``window`` requests of max/mean work per rank.

    Lock-stepped DP ranks wait for the most loaded one at every MoE layer, so balance must hold
    over short stretches of the arrival stream, not only cumulatively. Windows are
    non-overlapping; a trailing partial window counts only when it is the only one.

    Args:
        rank: ``[R]`` rank of each request; work: ``[R]`` its work (ones for request counts).
    """
    rank = np.asarray(rank, np.int64)
    work = np.asarray(work, np.float64)
    R = len(rank)
    if R == 0:
        return 1.0
    starts = range(0, max(R - window, 0) + 1, window) if R >= window else [0]
    ratios = []
    for s in starts:
        load = np.bincount(rank[s:s + window], weights=work[s:s + window], minlength=ep_size)
        ratios.append(load.max() / load.mean())
    return float(np.mean(ratios))
