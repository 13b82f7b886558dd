"""The engine's MoE exchange counters on vLLM's ``/metrics``.

Exported per DP rank (label ``dp_rank``), from the counters of :mod:`.ep_dispatch`:

- ``vllm:semmoe_moe_bytes_total{op="dispatch"|"combine"|"metadata"|"allreduce"|"reduce_scatter"|"allgather"}``:
  bytes the engine's expert- and tensor-parallel collectives sent to other ranks (ring volumes
  for the tensor-parallel ones, see :mod:`.ep_dispatch`);
- ``vllm:semmoe_local_activations_total`` / ``vllm:semmoe_remote_activations_total``: expert
  activations on this rank / on another (counted by the sparse exchange);
- ``vllm:semmoe_capture_errors_total``: times the routing capture (or its live counters) stopped
  on an error while the engine went on serving;
- ``vllm:semmoe_unmetered_moe_layers_total``: MoE layers whose token exchange the plugin does not
  meter (their bytes are missing from ``vllm:semmoe_moe_bytes_total``).

Engines run in their own processes; vLLM's API servers aggregate counters of all processes
through ``prometheus_client``'s multiprocess mode, which ``vllm serve`` turns on when it runs
more than one API server (its default under data parallelism: one per DP rank). Without it
(one API server) the counters stay in the engine's capture JSON and ``bench-serve``'s output.

The two failure counters reach ``/metrics`` with one API server too: an engine reports a failure
(:func:`report_failure`) also as a note in the directory ``$SEMMOE_STATUS_DIR``, which
``semmoe serve`` creates, exports from its API server (:func:`export_failures`) and reads when
the server stops (its exit status, :func:`read_failures`).
"""

from __future__ import annotations

import glob
import json
import logging
import os

logger = logging.getLogger("vllm.semmoe")

_COUNTERS: dict = {}


class CounterCollector:
    """Exports ``counters`` on a Prometheus registry. vLLM's stat logger, when it starts, removes
    from the process's default registry every collector named ``vllm:*``
    (``vllm.v1.metrics.prometheus.unregister_vllm_metrics``), counters made before it included;
    this collector has no name, so counters it exports stay on a single API server's ``/metrics``.
    (With several API servers ``/metrics`` reads the counters' multiprocess files instead.)"""

    def __init__(self, counters: tuple):
        self.counters = counters

    def collect(self):
        for counter in self.counters:
            yield from counter.collect()


def prometheus_counters(key: str, specs: tuple) -> tuple:
    """The ``prometheus_client`` counters ``specs`` (``(name, help, labels)`` each), created once
    per process under ``key`` and exported on the default registry by a :class:`CounterCollector`;
    ``()`` when Prometheus is unavailable (metrics are optional)."""
    if key not in _COUNTERS:
        try:
            from prometheus_client import REGISTRY, Counter

            counters = tuple(Counter(name, doc, list(labels), registry=None) for name, doc, labels in specs)
            REGISTRY.register(CounterCollector(counters))
            _COUNTERS[key] = counters
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


#: the directory where engines leave notes of the plugin's failures (set by ``semmoe serve``)
STATUS_DIR_ENV = "SEMMOE_STATUS_DIR"
#: failure kind -> (metric name, help)
FAILURES = {
    "capture_error": ("vllm:semmoe_capture_errors",
                      "Times the routing capture or its live counters stopped on an error while the engine served"),
    "unmetered": ("vllm:semmoe_unmetered_moe_layers",
                  "MoE layers whose token exchange the plugin does not meter (bytes not counted)"),
}
_REPORTED: dict = {}  # (kind, dp_rank) -> failures this process reported


def report_failure(kind: str, dp_rank: int, reason: str, failures: dict | None = None) -> None:
    """Make a failure of the plugin's own machinery visible outside this engine process: kept in
    ``failures`` (the engine state's, first reason per kind; the live counters and the capture
    summary carry it), counted on ``/metrics`` (multiprocess Prometheus) and noted in
    ``$SEMMOE_STATUS_DIR`` when set (``semmoe serve``'s exit status and single-server ``/metrics``)."""
    if kind not in FAILURES:
        raise ValueError(f"unknown failure kind {kind!r} (one of {', '.join(FAILURES)})")
    if failures is not None:
        failures.setdefault(kind, reason)
    key = (kind, int(dp_rank))
    _REPORTED[key] = count = _REPORTED.get(key, 0) + 1
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        counters = dict(zip(FAILURES, _failure_metrics()))
        if kind in counters:
            counters[kind].labels(dp_rank=str(dp_rank)).inc()
    directory = os.environ.get(STATUS_DIR_ENV)
    if directory:
        path = os.path.join(directory, f"{kind}.dp{int(dp_rank)}.pid{os.getpid()}.json")
        try:
            with open(path + ".tmp", "w") as f:
                json.dump({"kind": kind, "dp_rank": int(dp_rank), "count": count, "reason": reason}, f)
            os.replace(path + ".tmp", path)
        except OSError as exc:
            logger.error("semmoe: could not note the failure in %s (%s)", directory, exc)


def _failure_metrics():
    return prometheus_counters("the plugin's failures", tuple((name, doc, ("dp_rank",))
                                                               for name, doc in FAILURES.values()))


def read_failures(directory: str) -> list[dict]:
    """The failure notes engines left in ``directory`` (:func:`report_failure`): ``{"kind",
    "dp_rank", "count", "reason"}`` each, one per engine process and kind."""
    notes = []
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        try:
            with open(path) as f:
                note = json.load(f)
            notes.append({"kind": str(note["kind"]), "dp_rank": int(note["dp_rank"]), "count": int(note["count"]),
                          "reason": str(note["reason"])})
        except (OSError, ValueError, KeyError, TypeError) as exc:
            kind = os.path.basename(path).split(".", 1)[0]
            notes.append({"kind": kind if kind in FAILURES else "capture_error", "dp_rank": -1, "count": 1,
                          "reason": f"unreadable failure note {path} ({exc})"})
    return notes


class FailureCollector:
    """A Prometheus collector exporting the failure notes of ``directory`` as the failure counters
    (for an API server that does not read the engines' own, multiprocess, counters)."""

    def __init__(self, directory: str):
        self.directory = directory

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        totals: dict = {}
        for note in read_failures(self.directory):
            key = (note["kind"], str(note["dp_rank"]))
            totals[key] = totals.get(key, 0) + note["count"]
        for kind, (name, doc) in FAILURES.items():
            family = CounterMetricFamily(name, doc, labels=["dp_rank"])
            for (noted, rank), value in sorted(totals.items()):
                if noted == kind:
                    family.add_metric([rank], value)
            yield family


def export_failures(directory: str) -> bool:
    """Export ``directory``'s failure notes on this process's default Prometheus registry (what
    ``/metrics`` serves with one API server); ``False`` when Prometheus is unavailable."""
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return False
    REGISTRY.register(FailureCollector(directory))
    return True


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
        for key in (k for k in counters if k.endswith("_bytes")):  # ep_dispatch.BYTE_KEYS
            self._add(moe_bytes.labels(dp_rank=self.dp_rank, op=key.removesuffix("_bytes")), counters, key)
        self._add(local.labels(dp_rank=self.dp_rank), counters, "local_activations")
        self._add(remote.labels(dp_rank=self.dp_rank), counters, "remote_activations")

    def _add(self, counter, counters: dict, key: str) -> None:
        grown = counters[key] - self._seen.get(key, 0)
        if grown > 0:
            counter.inc(grown)
            self._seen[key] = counters[key]
