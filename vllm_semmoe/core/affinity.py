"""Token→expert affinity: count tables, confidence, and the evidence that routing is
context-independent (the observation Sem-MoE rests on).

Pure NumPy/Numba; no vLLM import.
"""

from __future__ import annotations

import numba
import numpy as np

from .trace import RoutingTrace


def token_expert_counts(trace: RoutingTrace) -> tuple[np.ndarray, np.ndarray]:
    """Activation counts of every profiled token at every MoE layer.

    Returns:
        token_ids: ``[J]`` int32, the distinct token ids of ``trace`` (ascending).
        counts: ``[L, J, N]`` int32, ``counts[l, j, e]`` = how often token ``token_ids[j]``
            activated expert ``e`` at layer ``l``.
    """
    token_ids, token_row = np.unique(trace.tokens, return_inverse=True)
    counts = _count(token_row.astype(np.int64), trace.experts, len(token_ids), trace.num_experts)
    return token_ids.astype(np.int32), counts


@numba.njit(cache=True)
def _count(token_row, experts, num_rows, num_experts):
    T, L, K = experts.shape
    counts = np.zeros((L, num_rows, num_experts), dtype=np.int32)
    for t in range(T):
        j = token_row[t]
        for l in range(L):
            for k in range(K):
                counts[l, j, experts[t, l, k]] += 1
    return counts


def confidence(counts: np.ndarray) -> np.ndarray:
    """``Cp = T / Σ_e T``: per token, the share of its activations that go to each expert.

    counts: ``[..., N]``. Returns float32 of the same shape; all-zero rows stay zero.
    """
    total = counts.sum(axis=-1, keepdims=True).astype(np.float32)
    return np.divide(counts, total, out=np.zeros(counts.shape, np.float32), where=total > 0)


def affinity_report(trace: RoutingTrace, min_count: int = 20) -> dict:
    """Per-layer evidence of context-independent routing, over tokens seen ≥ ``min_count`` times.

    For each such token and layer:
      - ``f1``: F1 of predicting each occurrence's experts as the token's k most frequent
        experts, counted from its *other* occurrences (leave-one-out, so it is an honest
        prediction score; with |predicted| = |actual| = k, F1 = precision = recall);
      - ``topk_mass``: cumulative confidence ``Cp`` of its k hottest experts;
      - ``next_mass``: ``Cp`` of its hottest expert outside those k.
    Returns ``{"min_count", "tokens_considered", "token_share", "layers": [{"layer",
    "f1": [p25, p50, p75], "topk_mass": [...], "next_mass": [...]}, ...]}``.
    """
    token_ids, counts = token_expert_counts(trace)
    occurrences = counts[0].sum(axis=1) // trace.top_k
    frequent = np.nonzero(occurrences >= min_count)[0]
    _, token_row = np.unique(trace.tokens, return_inverse=True)
    f1 = _leave_one_out_f1(token_row.astype(np.int64), trace.experts, counts, frequent)
    layers = []
    for l in range(trace.num_layers):
        cp = confidence(counts[l, frequent])
        ranked = -np.sort(-cp, axis=1)
        topk = ranked[:, : trace.top_k].sum(axis=1)
        nxt = ranked[:, trace.top_k] if trace.num_experts > trace.top_k else np.zeros(len(frequent))
        layers.append(
            {
                "layer": l,
                "f1": _quartiles(f1[l]),
                "topk_mass": _quartiles(topk),
                "next_mass": _quartiles(nxt),
            }
        )
    return {
        "min_count": min_count,
        "tokens_considered": int(len(frequent)),
        "token_share": float(occurrences[frequent].sum() / max(occurrences.sum(), 1)),
        "layers": layers,
    }


def _quartiles(x: np.ndarray) -> list[float]:
    if len(x) == 0:
        return [float("nan")] * 3
    return [float(v) for v in np.percentile(x, [25, 50, 75])]


@numba.njit(cache=True)
def _leave_one_out_f1(token_row, experts, counts, frequent):
    """``[L, len(frequent)]`` mean leave-one-out F1 per frequent token and layer."""
    T, L, K = experts.shape
    N = counts.shape[2]
    slot = np.full(counts.shape[1], -1, np.int64)
    for i in range(len(frequent)):
        slot[frequent[i]] = i
    hits = np.zeros((L, len(frequent)))
    seen = np.zeros(len(frequent))
    row = np.empty(N, np.int64)
    for t in range(T):
        s = slot[token_row[t]]
        if s < 0:
            continue
        seen[s] += 1
        for l in range(L):
            for e in range(N):
                row[e] = counts[l, token_row[t], e]
            for k in range(K):
                row[experts[t, l, k]] -= 1
            # top-k of the other occurrences (ties → lower expert id), then overlap
            order = np.argsort(-row, kind="mergesort")
            for k in range(K):
                e = order[k]
                for kk in range(K):
                    if experts[t, l, kk] == e:
                        hits[l, s] += 1.0
                        break
    for l in range(L):
        for i in range(len(frequent)):
            hits[l, i] /= seen[i] * K
    return hits


def checkpoint_embedding(model_dir: str) -> np.ndarray:
    """``[V, H]`` float32 input embedding matrix of a Hugging Face checkpoint directory
    (``*.safetensors``, the tensor named ``...embed_tokens.weight``), for
    :func:`vllm_semmoe.core.tables.nearest_profiled_rows`. Reads only that tensor."""
    import glob
    import os

    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}: give the model's checkpoint directory")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.endswith("embed_tokens.weight"):
                    return f.get_tensor(name).float().numpy()
    raise FileNotFoundError(f"{model_dir}: no tensor named *embed_tokens.weight in {', '.join(files)}")
