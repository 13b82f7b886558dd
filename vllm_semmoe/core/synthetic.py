"""Synthetic routing traces with token→expert affinity, for scale tests of other model shapes.

Real traces are preferred everywhere; this generator only exists to check that solvers handle
shapes we have no real trace for (e.g. Qwen3-30B-A3B: 48 layers x 128 experts, top-8).
"""

from __future__ import annotations

import numpy as np

from .trace import RoutingTrace


def synthetic_trace(*, num_layers: int, num_experts: int, top_k: int, vocab_size: int = 4096,
                    num_requests: int = 200, mean_request_tokens: int = 60, num_topics: int = 16,
                    affinity: float = 0.8, seed: int = 0) -> RoutingTrace:
    """A trace where each token id prefers ``top_k`` experts per layer, as real routers do.

    Requests draw tokens from one of ``num_topics`` Zipf-like topic vocabularies; each token
    has a fixed preferred expert set per layer (shared within its topic with probability 0.5)
    and routes there with probability ``affinity``, otherwise to random experts.
    """
    rng = np.random.default_rng(seed)
    topic_experts = _random_expert_sets(rng, (num_topics, num_layers), num_experts, top_k)
    token_topic = rng.integers(0, num_topics, vocab_size)
    own = _random_expert_sets(rng, (vocab_size, num_layers), num_experts, top_k)  # [V, L, K]
    share = rng.random((vocab_size, num_layers)) < 0.5
    preferred = np.where(share[:, :, None], topic_experts[token_topic], own)
    lengths = np.maximum(2, rng.poisson(mean_request_tokens, num_requests))
    zipf = 1.0 / np.arange(1, vocab_size + 1)
    tokens = []
    for length in lengths:
        topic = rng.integers(num_topics)
        pool = np.nonzero(token_topic == topic)[0]
        weights = zipf[: len(pool)] / zipf[: len(pool)].sum()
        tokens.append(rng.choice(pool, size=length, p=weights))
    tokens = np.concatenate(tokens).astype(np.int32)
    experts = preferred[tokens].copy()  # [T, L, K]
    noisy = rng.random(experts.shape[:2]) > affinity
    experts[noisy] = _random_expert_sets(rng, (int(noisy.sum()),), num_experts, top_k)
    experts.sort(axis=2)
    dtype = np.uint8 if num_experts <= 256 else np.int16
    return RoutingTrace.from_arrays(
        tokens, experts.astype(dtype), np.concatenate([[0], np.cumsum(lengths)]),
        vocab_size=vocab_size, num_experts=num_experts,
    )


def _random_expert_sets(rng: np.random.Generator, shape: tuple, num_experts: int, top_k: int) -> np.ndarray:
    """``[*shape, top_k]``: distinct random expert ids per entry."""
    return np.argpartition(rng.random((*shape, num_experts)), top_k, axis=-1)[..., :top_k]
