"""The engine's MoE exchange counters on vLLM's ``/metrics``.

Exported per DP rank (label ``dp_rank``), from the counters of :mod:`.ep_dispatch`:

- ``vllm:semmoe_moe_bytes_total{op="dispatch"|"combine"|"metadata"|"allreduce"|"reduce_scatter"|"allgather"}``:
  bytes the engine's expert- and tensor-parallel collectives sent to other ranks (ring volumes
  for the tensor-parallel ones, see :mod:`.ep_dispatch`);
- ``vllm:semmoe_local_activations_total`` / ``vllm:semmoe_remote_activations_total``: expert
  activations on this rank / on another (counted by the sparse exchange).

Engines run in their own processes; vLLM's API servers aggregate counters of all processes
through ``prometheus_client``'s multiprocess mode, which ``vllm serve`` turns on when it runs
more than one API server (its default under data parallelism: one per DP rank). Without it
(one API server) the counters stay in the engine's capture JSON and ``bench-serve``'s output.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("vllm.semmoe")

_COUNTERS: dict = {}


def prometheus_counters(key: str, specs: tuple) -> tuple:
    """The ``prometheus_client`` counters ``specs`` (``(name, help, labels)`` each), created once
    per process under ``key``; ``()`` when Prometheus is unavailable (metrics are optional)."""
    if key not in _COUNTERS:
        try:
            from prometheus_client import Counter

            _COUNTERS[key] = tuple(Counter(name, doc, list(labels)) for name, doc, labels in specs)
        except Exception as exc:
            logger.warning("semmoe: no Prometheus counters for %s (%s)", key, exc)
            _COUNTERS[key] = ()
    return _COUNTERS[key]


def _metrics():
    return prometheus_counters("the MoE exchange", (
        ("vllm:semmoe_moe_bytes", "Bytes the MoE layers handed to their collectives for other ranks",
         ("dp_rank", "op")),
        ("vllm:semmoe_local_activations", "Expert activations on the token's own rank", ("dp_rank",)),
        ("vllm:semmoe_remote_activations", "Expert activations on another rank", ("dp_rank",)),
    ))


class EngineMetrics:
    """Adds the growth of an engine's counters (a dict of :data:`~.state.MOE_COUNTER_KEYS`)
    since the last :meth:`update` to the Prometheus counters of its DP rank."""

    def __init__(self, dp_rank: int):
        self.dp_rank = str(dp_rank)
        self._seen: dict = {}

    @staticmethod
    def available() -> bool:
        """Whether an API server can read counters of this (engine) process."""
        return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR")) and bool(_metrics())

    def update(self, counters: dict) -> None:
        metrics = _metrics()
        if not metrics:
            return
        moe_bytes, local, remote = metrics
        from .ep_dispatch import BYTE_KEYS

        for key in BYTE_KEYS:
            self._add(moe_bytes.labels(dp_rank=self.dp_rank, op=key.removesuffix("_bytes")), counters, key)
        self._add(local.labels(dp_rank=self.dp_rank), counters, "local_activations")
        self._add(remote.labels(dp_rank=self.dp_rank), counters, "remote_activations")

    def _add(self, counter, counters: dict, key: str) -> None:
        grown = counters[key] - self._seen.get(key, 0)
        if grown > 0:
            counter.inc(grown)
            self._seen[key] = counters[key]
