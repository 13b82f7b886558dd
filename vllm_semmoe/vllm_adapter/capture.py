"""Live routing capture inside vLLM's model runner, and live LAR.

A :class:`RoutingRecorder` sees every real forward step (not vLLM's warm-up or profiling runs,
which bypass ``_model_forward``): which request each token belongs to, its position and id,
and the top-k expert ids every MoE layer chose for it. Routers report *logical* expert ids
(vLLM's capture hook runs before the logical → physical map, and the placement is applied
after it; see :mod:`.replacement`), so the :class:`~vllm_semmoe.trace.RoutingTrace` it builds
has logical ids with or without a placement; prefill and decode tokens are marked.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import torch

from ..placement import Placement
from ..trace import RoutingTrace


class RoutingRecorder:
    """Accumulates per-step routing; one per worker process.

    Args:
        num_layers: MoE layers in the model; top_k: experts per token.
        placement: the placement applied at load time (``None``: physical = logical ids); only
            the live DP counters use it (to tell which rank's slots an activation hit).
        vocab: token strings (index = token id) and ``vocab_size``.
    """

    def __init__(self, num_layers: int, num_experts: int, top_k: int, placement: Placement | None,
                 vocab: list[str], vocab_size: int):
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.l2p = placement.logical_to_physical() if placement is not None else None
        self.vocab, self.vocab_size = vocab, vocab_size
        self._request_index: dict[str, int] = {}
        self._request_names: list[str] = []
        self._prompt_len: list[int] = []
        self._steps: list[dict] = []
        self._current: dict | None = None
        self.dp_counters: DpLiveCounters | None = None

    # ---- hooks -----------------------------------------------------------------------------
    def begin_forward(self, req_ids: list[str], num_prompt_tokens: np.ndarray, bounds: np.ndarray,
                      tokens: np.ndarray | None, positions: np.ndarray | None) -> None:
        """Called by the model-runner hook right before a real forward step.

        Args:
            req_ids: ``[R]`` request ids of the step; num_prompt_tokens: ``[R]`` their prompt lengths.
            bounds: ``[R+1]`` token offsets of each request in the step.
            tokens, positions: ``[n]`` token ids and positions (``None``: nothing to record).
        """
        n = int(bounds[-1]) if len(bounds) else 0
        if tokens is None or n == 0:
            self._current = None
            return
        req = np.empty(n, np.int64)
        for i, name in enumerate(req_ids):
            if name not in self._request_index:
                self._request_index[name] = len(self._request_names)
                self._request_names.append(name)
                self._prompt_len.append(int(num_prompt_tokens[i]))
            req[bounds[i] : bounds[i + 1]] = self._request_index[name]
        self._current = {
            "request": req,
            "token": np.asarray(tokens[:n], np.int64),
            "position": np.asarray(positions[:n], np.int64),
            "experts": [None] * self.num_layers,
        }

    def abort_forward(self) -> None:
        """The step failed: forget its partial routing."""
        self._current = None

    def on_layer(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Capture hook of MoE layer ``layer`` (logical expert ids ``[tokens, K]``)."""
        if self._current is None:
            return
        n = len(self._current["token"])
        self._current["experts"][layer] = topk_ids[:n].detach().to("cpu", torch.int64).numpy().copy()

    def end_forward(self) -> None:
        step, self._current = self._current, None
        if step is None:
            return
        missing = [l for l, e in enumerate(step["experts"]) if e is None]
        if missing:  # e.g. pipeline parallel: this rank does not run every layer
            raise RuntimeError(f"semmoe capture: MoE layers {missing} produced no routing in a step")
        step["experts"] = np.stack(step["experts"], axis=1)  # [n, L, K]
        self._steps.append(step)
        if self.dp_counters is not None:
            prompt = step["position"] < np.asarray(self._prompt_len)[step["request"]]
            physical = step["experts"]
            if self.l2p is not None:
                physical = self.l2p[np.arange(self.num_layers)[None, :, None], physical]
            self.dp_counters.update(physical, int(prompt.sum()), len(self._steps))

    # ---- results ---------------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        return len(self._steps)

    def step_trace(self) -> RoutingTrace:
        """All captured tokens in step order, one "request" per forward step (for live LAR)."""
        steps = self._steps
        if not steps:
            raise RuntimeError("semmoe capture: no forward steps were recorded")
        logical = np.concatenate([s["experts"] for s in steps])
        lengths = [len(s["token"]) for s in steps]
        return RoutingTrace.from_arrays(
            np.concatenate([s["token"] for s in steps]).astype(np.int32), logical.astype(np.int16),
            np.concatenate([[0], np.cumsum(lengths)]), vocab_size=self.vocab_size,
            num_experts=self.num_experts,
        )

    def trace(self) -> RoutingTrace:
        """The captured routing per request (token order), with logical expert ids."""
        if not self._steps:
            raise RuntimeError("semmoe capture: no forward steps were recorded")
        req = np.concatenate([s["request"] for s in self._steps])
        pos = np.concatenate([s["position"] for s in self._steps])
        tok = np.concatenate([s["token"] for s in self._steps])
        experts = np.concatenate([s["experts"] for s in self._steps])
        # order by (request, position); a recomputed position (preemption) keeps its last capture
        order = np.lexsort((np.arange(len(req)), pos, req))
        req, pos, tok, experts = req[order], pos[order], tok[order], experts[order]
        keep = np.ones(len(req), bool)
        keep[:-1] = (req[1:] != req[:-1]) | (pos[1:] != pos[:-1])
        req, pos, tok, experts = req[keep], pos[keep], tok[keep], experts[keep]
        counts = np.bincount(req, minlength=len(self._request_names))
        present = np.nonzero(counts)[0]
        offsets = np.concatenate([[0], np.cumsum(counts[present])])
        is_decode = pos >= np.asarray(self._prompt_len)[req]
        experts = np.sort(experts, axis=2)
        dtype = np.uint8 if self.num_experts <= 256 else np.int16
        vocab = self.vocab if len(self.vocab) == self.vocab_size else None
        return RoutingTrace.from_arrays(
            tok.astype(np.int32), experts.astype(dtype), offsets, vocab=vocab, vocab_size=self.vocab_size,
            num_experts=self.num_experts,
            request_ids=[_request_number(self._request_names[r], r) for r in present],
            is_decode=is_decode,
        )


class DpLiveCounters:
    """Per-engine live counters under data parallelism, written to a small JSON every step.

    Engine processes are often killed at server shutdown before they can write anything, so
    these counters (what ``semmoe bench-serve`` and a user watching the server read) are kept
    on disk as they change: local and remote activations of this DP rank (an activation is
    local when its physical expert slot is on one of this rank's EP devices), prompt tokens
    and steps.
    """

    def __init__(self, path: str, dp_rank: int, dp_size: int, num_experts: int, ep_size: int):
        self.path = path
        self.dp_rank = dp_rank
        group = ep_size // dp_size
        per_device = num_experts // ep_size
        self.first_slot = dp_rank * group * per_device
        self.end_slot = (dp_rank + 1) * group * per_device
        self.local = self.remote = self.prompt_tokens = self.tokens = 0

    def update(self, physical_experts: np.ndarray, prompt_tokens: int, steps: int) -> None:
        local = int(((physical_experts >= self.first_slot) & (physical_experts < self.end_slot)).sum())
        self.local += local
        self.remote += physical_experts.size - local
        self.prompt_tokens += prompt_tokens
        self.tokens += physical_experts.shape[0]
        payload = {"dp_rank": self.dp_rank, "steps": steps, "tokens": self.tokens,
                   "prompt_tokens": self.prompt_tokens, "local_activations": self.local,
                   "remote_activations": self.remote, "lar": self.local / max(self.local + self.remote, 1)}
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f)
        os.replace(tmp, self.path)


def _request_number(name: str, fallback: int) -> int:
    """vLLM request ids look like ``"12"`` or ``"12-9f3a"`` (offline) or ``"cmpl-…"`` (server)."""
    match = re.match(r"(\d+)", name)
    return int(match.group(1)) if match else fallback


def live_lar(recorder: RoutingRecorder, tables, *, dp_rank: int = 0, dp_size: int = 1) -> dict:
    """LAR of the captured steps against ``tables``' placement, as the engine batched them.

    Data-parallel serving (``dp_size > 1``): every token of this engine lives on DP rank
    ``dp_rank``, whose EP devices are ``dp_rank * E/dp_size ..``; an activation is local when its
    expert sits on one of them. Otherwise tokens are scheduled per forward step with Sem-MoE's
    TP scheduler when the tables are Sem-MoE's, else with the default contiguous slices (what
    vLLM does), exactly as :func:`vllm_semmoe.evaluate.evaluate` does for an offline trace.
    """
    from ..evaluate import EvalConfig, evaluate
    from ..tables import device_counts

    steps = recorder.step_trace()
    if dp_size > 1:
        counts = device_counts(steps.experts, tables.placement.expert_device, tables.ep_size)
        group = tables.ep_size // dp_size
        local = int(counts[:, :, dp_rank * group : (dp_rank + 1) * group].sum())
        total = int(counts.sum())
        result = {"lar": local / max(total, 1), "local_activations": local, "remote_activations": total - local}
    else:
        scheduled = tables if tables.placement.method == "semmoe" else None
        result = evaluate(steps, tables.placement, scheduled, EvalConfig(mode="tp", batch_tokens=0))
    result["steps"] = steps.num_requests
    result["tokens"] = steps.num_tokens
    return result
