"""Live routing capture inside vLLM's model runner, and the live counters.

A :class:`RoutingRecorder` sees every real forward step (not vLLM's warm-up or profiling runs,
which bypass ``_model_forward``): which request each token belongs to, its position and id,
and the top-k expert ids every MoE layer chose for it. Routers report *logical* expert ids
(vLLM's capture hook runs before the logical → physical map, and the placement is applied
after it; see :mod:`.replacement`). When the step's forward pass ends the recorder appends the
step to this engine's segment of the durable capture (:mod:`vllm_semmoe.core.capture_store`): the
capture survives any way the engine stops, and the recorder keeps no history beyond one small
record per live request (the positions it has covered, for coverage below). Nothing is
evaluated during steps: the offline evaluator replays the written capture when the engine
flushes its summary (:func:`vllm_semmoe.evaluation.evaluate.replay_capture`).

Coverage: a request's first step need not start at position 0 (vLLM's prefix cache serves the
leading tokens another request computed; a KV connector loads them), and then no MoE layer routes
those tokens. The recorder notes, per live request, the positions computed so far; positions a
step skips over are written to the capture with their token ids, marked as not routed
(:mod:`vllm_semmoe.core.capture_store` format 2), and counted (:meth:`RoutingRecorder.coverage`). A
request's tokens here are the positions of its KV cache: its prompt and every generated token fed
back (not the last token sampled, which no forward step takes as input).
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import torch

from ..core.capture_store import SegmentWriter
from ..core.placement import Placement

logger = logging.getLogger("vllm.semmoe")


class RoutingRecorder:
    """Records per-step routing and appends it to disk and the live counters; one per worker process.

    Args:
        num_layers: MoE layers in the model; top_k: experts per token.
        placement: the placement applied at load time (``None``: physical = logical ids); only
            the live DP counters use it (to tell which rank's slots an activation hit).
        token_device: the device whose copies the routers prefer (replicas,
            :meth:`~vllm_semmoe.core.placement.Placement.device_map`; ``None``: home copies).
        vocab: token strings (index = token id) and ``vocab_size``.

    ``store`` (a :class:`~vllm_semmoe.core.capture_store.SegmentWriter`, set by :meth:`open_store`)
    receives every step as it ends.
    """

    def __init__(self, num_layers: int, num_experts: int, top_k: int, placement: Placement | None,
                 vocab: list[str], vocab_size: int, token_device: int | None = None):
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.l2p = placement.device_map(token_device) if placement is not None else None
        self.vocab, self.vocab_size = vocab, vocab_size
        self.num_steps = 0  # steps recorded since start
        self._current: dict | None = None
        self.store: SegmentWriter | None = None
        self.writes_capture = False  # whether this recorder opened the capture (a store), stopped or not
        self.live_counters: LiveCounters | None = None
        #: request id -> [next position not yet covered, [[start, end) ranges skipped, not routed]]
        self._covered: dict[str, list] = {}
        self.routed_positions = self.unrouted_positions = 0
        #: why the capture stopped (``None``: it did not)
        self.capture_error: str | None = None
        #: ``on_failure(kind, reason)``: told when the capture stops (kind ``"capture_error"``)
        self.on_failure = None

    # ---- hooks -----------------------------------------------------------------------------
    def begin_forward(self, req_ids: list[str], num_prompt_tokens: np.ndarray, bounds: np.ndarray,
                      tokens: np.ndarray | None, positions: np.ndarray | None, token_ids=None,
                      live=None) -> None:
        """Called by the model-runner hook right before a real forward step.

        Args:
            req_ids: ``[R]`` request ids of the step; num_prompt_tokens: ``[R]`` their prompt lengths.
            bounds: ``[R+1]`` token offsets of each request in the step.
            tokens, positions: ``[n]`` token ids and positions (``None``: nothing to record).
            token_ids: ``token_ids(i, start, end)`` -> the token ids of the step's request ``i``
                at positions ``start:end`` (read for positions the step skips; required when
                ``tokens`` is given).
            live: the ids of every request the engine still holds (a container; ``None``: keep
                every request's coverage record).
        """
        n = int(bounds[-1]) if len(bounds) else 0
        if live is not None:
            for gone in [r for r in self._covered if r not in live]:
                del self._covered[gone]
        if tokens is None or n == 0:
            self._current = None
            return
        positions = np.asarray(positions[:n], np.int64)
        self._current = {
            "names": list(req_ids),
            "prompt_len": np.asarray(num_prompt_tokens, np.int64).copy(),
            "request": np.repeat(np.arange(len(req_ids), dtype=np.int64), np.diff(bounds)),
            "token": np.asarray(tokens[:n], np.int64).copy(),
            "position": positions.copy(),
            "experts": [None] * self.num_layers,
            "unrouted": self._cover(req_ids, bounds, positions, token_ids),
        }

    def _cover(self, req_ids, bounds, positions, token_ids):
        """Advance each request's covered positions by this step's rows; return the positions the
        step skips (``(request index, position, token id)`` arrays, or ``None``)."""
        skipped = []
        for i, rid in enumerate(req_ids):
            start, end = int(bounds[i]), int(bounds[i + 1])
            if start == end:
                continue
            first, last = int(positions[start]), int(positions[end - 1]) + 1
            record = self._covered.get(rid)
            if record is None:
                record = self._covered[rid] = [0, []]
            done, gaps = record
            if first > done:  # positions done..first were never computed here
                ids = np.asarray(token_ids(i, done, first), np.int64)
                skipped.append((np.full(first - done, i, np.int64), np.arange(done, first, dtype=np.int64), ids))
                gaps.append([done, first])
                self.unrouted_positions += first - done
            kept = []
            for gap_start, gap_end in gaps:  # a skipped range computed after all (recomputed later)
                lo, hi = max(gap_start, first), min(gap_end, last)
                if lo >= hi:
                    kept.append([gap_start, gap_end])
                    continue
                self.unrouted_positions -= hi - lo
                self.routed_positions += hi - lo
                kept += [g for g in ([gap_start, lo], [hi, gap_end]) if g[0] < g[1]]
            record[1] = kept
            self.routed_positions += max(0, last - max(done, first))
            record[0] = max(done, last)
        if not skipped:
            return None
        return tuple(np.concatenate(column) for column in zip(*skipped))

    def coverage(self) -> dict:
        """Positions of this engine's requests with routing computed, and without, so far."""
        total = self.routed_positions + self.unrouted_positions
        return {"routed_tokens": self.routed_positions, "unrouted_tokens": self.unrouted_positions,
                "routed_share": self.routed_positions / total if total else 1.0}

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
        experts = np.stack(step["experts"], axis=1)  # [n, L, K] logical ids
        self.num_steps += 1
        if self.store is not None:
            try:
                self.store.append(step["names"], step["prompt_len"], step["request"], step["position"],
                                  step["token"], experts, step["unrouted"])
            except OSError as exc:  # disk full, file system gone, ...: keep serving, make it known
                store, self.store = self.store, None
                try:
                    store.close()  # its unwritten bytes cannot be written either
                except OSError:
                    pass
                self.fail(f"could not append to the routing capture {store.path} ({exc.strerror or exc}); "
                          f"capture stopped after {self.num_steps - 1} steps")
        if self.live_counters is not None:
            prompt = step["position"] < step["prompt_len"][step["request"]]
            physical = experts
            if self.l2p is not None:
                physical = self.l2p[np.arange(self.num_layers)[None, :, None], experts]
            try:
                self.live_counters.update(physical, int(prompt.sum()), self.num_steps)
            except OSError as exc:
                path, self.live_counters = self.live_counters.path, None
                self.fail(f"could not write the live counters {path} ({exc.strerror or exc}); they stopped "
                          f"after {self.num_steps - 1} steps")

    def fail(self, reason: str) -> None:
        """The capture (or its live counters) stopped: log it at error level, keep the first
        reason, tell :attr:`on_failure`."""
        logger.error("semmoe: %s", reason)
        if self.capture_error is None:
            self.capture_error = reason
        if self.on_failure is not None:
            self.on_failure("capture_error", reason)

    # ---- storage ---------------------------------------------------------------------------
    def open_store(self, path: str, *, dp_rank: int = 0, dp_size: int = 1) -> None:
        """Append every step from now on to ``path``'s durable capture (this engine's segment)."""
        self.store = SegmentWriter(path, num_layers=self.num_layers, num_experts=self.num_experts,
                                   top_k=self.top_k, vocab_size=self.vocab_size,
                                   vocab=self.vocab if len(self.vocab) == self.vocab_size else (),
                                   dp_rank=dp_rank, dp_size=dp_size)
        self.writes_capture = True


class LiveCounters:
    """Per-engine live counters, written to a small JSON every step.

    Engine processes are often killed at server shutdown before they can write anything, so
    these counters (what ``semmoe bench-serve`` and a user watching the server read) are kept
    on disk as they change: tokens, prompt tokens and steps of this engine, the MoE exchange
    counters of this rank (``moe_traffic``: bytes its collectives sent, activations its exchange
    found local / remote), and under data parallelism the local and remote activations of this
    DP rank (an activation is local when its physical expert slot is on one of this rank's EP
    devices). One file per DP rank, and per TP rank when TP > 1 (each TP rank sends its own
    bytes). ``failures`` (the engine's :attr:`~.state.EngineState.failures`: a capture that
    stopped, MoE layers whose exchange is not metered) is written with them when not empty.

    Args:
        num_slots: physical expert slots of a MoE layer (``N + E*R``), ``ep_size`` EP ranks
            holding equal shares in order.
        dp_size: ``> 1``: count this DP rank's local / remote activations here; ``1``: the
            exchange counts them (TP shuffle) or nothing is remote (one EP rank per token).
    """

    def __init__(self, path: str, dp_rank: int, dp_size: int, num_slots: int, ep_size: int,
                 traffic: dict | None = None, tp_rank: int = 0, failures: dict | None = None):
        self.path = path
        self.traffic = traffic  # the engine's MoE exchange counters (read, written with the rest)
        self.failures = failures if failures is not None else {}
        self.dp_rank, self.tp_rank = dp_rank, tp_rank
        self.counts_locality = dp_size > 1
        group = ep_size // dp_size
        per_device = num_slots // ep_size
        self.first_slot = dp_rank * group * per_device
        self.end_slot = (dp_rank + 1) * group * per_device
        self.local = self.remote = self.prompt_tokens = self.tokens = self.steps = 0

    def update(self, physical_experts: np.ndarray, prompt_tokens: int, steps: int) -> None:
        if self.counts_locality:
            local = int(((physical_experts >= self.first_slot) & (physical_experts < self.end_slot)).sum())
            self.local += local
            self.remote += physical_experts.size - local
        self.prompt_tokens += prompt_tokens
        self.tokens += physical_experts.shape[0]
        self.steps = steps
        self.write()

    def write(self) -> None:
        """Write the counters (atomically: readers never see half a file)."""
        payload = {"dp_rank": self.dp_rank, "tp_rank": self.tp_rank, "steps": self.steps, "tokens": self.tokens,
                   "prompt_tokens": self.prompt_tokens}
        if self.counts_locality:
            payload.update(local_activations=self.local, remote_activations=self.remote,
                           lar=self.local / max(self.local + self.remote, 1))
        if self.traffic is not None:
            payload["moe_traffic"] = dict(self.traffic)
        if self.failures:
            payload["failures"] = dict(self.failures)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f)
        os.replace(tmp, self.path)
