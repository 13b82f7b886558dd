"""One :class:`SemMoEState` per engine: everything the plugin keeps between hook calls.

The plugin creates the state when vLLM builds the model (``create_model`` hook) and registers
it under that model object; every other hook reaches it from there:

- the model-runner hooks (``_model_forward``, ``shutdown``) through ``runner.get_model()``;
- the custom ops that run inside the compiled model (:mod:`.ops`) through vLLM's per-step
  forward context, where the ``_model_forward`` hook puts the state for the duration of a real
  step (warm-up, profiling and dummy runs do not pass that hook, so they see no state and take
  vLLM's own path);
- ``flush_capture`` (``LLM.collective_rpc``) through the worker's runner.

The registry is a weak map (model, MoE layer -> state): it keeps nothing alive, the state holds no
reference to the model (modules are reached through weak references), so when vLLM drops an
engine its model, its state, recorder and counters go with it, and the next engine in the
same process starts from a fresh state.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: counters of the MoE layers' exchange (TP shuffle, sparse or metered DP dispatch), summed over
#: the MoE layers of one engine; bytes as in :mod:`.ep_dispatch`
MOE_COUNTER_KEYS = ("dispatch_bytes", "combine_bytes", "metadata_bytes", "allreduce_bytes",
                    "reduce_scatter_bytes", "allgather_bytes", "local_activations",
                    "remote_activations", "tokens", "layers_run", "fused_layers_run", "schedule_s",
                    "host_sync_s", "moe_layer_s")


def new_moe_counters() -> dict:
    return {key: 0 for key in MOE_COUNTER_KEYS}


class StepContext:
    """What the MoE layers of one real forward step share.

    Attributes:
        rows: ``[B]`` int64 table row of each token of the step (``-1``: unseen token).
        experts: layer -> ``[B, K]`` logical experts of each token (TP-shuffle history).
        major: layer -> ``[B]`` EP rank holding most of each token's experts (the history of
            tables without the X table).
        recorder: the engine's routing recorder (``None``: not recording).
        counters: the engine's MoE exchange counters (a dict of :data:`MOE_COUNTER_KEYS`).
    """

    def __init__(self, tokens: np.ndarray, tables, recorder, counters: dict):
        self.rows = tables.token_rows(tokens)
        self.experts: dict[int, Any] = {}
        self.major: dict[int, Any] = {}
        self.recorder = recorder
        self.counters = counters


@dataclass
class SemMoEState:
    """The plugin's state for one engine (one model instance in one worker process).

    Attributes:
        config: the validated :class:`~.config.SemMoEConfig`.
        parallel: ``(tp_size, dp_size, dp_rank, ep_size)`` of this engine.
        tables: the loaded Sem-MoE tables (``None``: capture only).
        token_device: the placement device (EP rank) whose copies this engine's routers prefer
            for the tokens they route (:meth:`~vllm_semmoe.placement.Placement.device_map`):
            this EP rank when the tables hold replicas, ``None`` (home copies) otherwise.
        recorder: the routing recorder (``None``: this engine does not record).
        tp_layers: MoE layer name -> :class:`~.tp_shuffle.TpShuffleLayer` (``tp`` mode).
        fused: MoE layer name -> weak reference to its decoder layer, for the decoder layers that
            run the fused shuffled reduce-scatter / all-gather.
        counters: MoE exchange byte / activation / time counters of this engine, counted in its
            real steps (warm-up, profiling and the dummy batches an idle DP rank runs to stay in
            lock-step go to a scratch dict).
        dispatch: how the MoE layers exchange tokens under DP + EP: ``"sparse"`` (the project's
            EP exchange), ``"vllm"`` (vLLM's all-gather / reduce-scatter, metered) or ``None``
            (no DP + EP all-gather dispatch in this engine).
        in_step: whether a real step is running (what the counters count).
        tp_meter: the :class:`~.ep_dispatch.CollectiveMeter` counting the tensor-parallel
            group's collectives (``None``: not counted).
        metrics: the :class:`~.metrics.EngineMetrics` exporting ``counters`` on ``/metrics``
            (``None``: no API server can read this process's counters).
        step: the :class:`StepContext` of the forward step in progress (``None`` between steps).
        flushed_steps / flushed_summary: what the last :func:`~.recording.flush_capture` wrote.
        dp_router: in an API-server process, the Sem-MoE DP rank chooser (``dp`` mode).
        failures: failures of the plugin's own machinery in this engine, kind -> reason
            (``capture_error``: the capture stopped; ``unmetered``: MoE layers whose token exchange
            is not counted), reported by :func:`~.metrics.report_failure`.
    """

    config: Any
    parallel: tuple[int, int, int, int]
    tables: Any = None
    token_device: int | None = None
    recorder: Any = None
    tp_layers: dict = field(default_factory=dict)
    fused: dict = field(default_factory=dict)
    counters: dict = field(default_factory=new_moe_counters)
    dispatch: str | None = None
    in_step: bool = False
    metrics: Any = None
    tp_meter: Any = None
    step: StepContext | None = None
    flushed_steps: int = -1
    flushed_summary: dict = field(default_factory=dict)
    dp_router: Any = None
    failures: dict = field(default_factory=dict)

    @property
    def shuffles(self) -> bool:
        """Whether this engine runs the TP token shuffle."""
        return bool(self.tp_layers)

    def moe_counters(self) -> dict:
        """The dict a MoE layer adds its counts to now: the engine's during a real step."""
        return self.counters if self.in_step else new_moe_counters()

    def begin_step(self, tokens: np.ndarray | None) -> None:
        """Open the step context of a real forward step over ``tokens`` ``[B]``."""
        self.step = (StepContext(tokens, self.tables, self.recorder, self.counters)
                     if tokens is not None and self.shuffles else None)

    def end_step(self) -> None:
        self.step = None


#: vLLM object (an engine's model or one of its MoE layers, an API server's DP client) -> the
#: state of its engine. Weak keys: an entry ends with the vLLM object it is keyed by.
_BY_OWNER: "weakref.WeakKeyDictionary[Any, SemMoEState]" = weakref.WeakKeyDictionary()


def register_state(owner, state: SemMoEState) -> None:
    """Make ``state`` reachable from ``owner`` (the engine's model, a MoE layer, a DP client)."""
    _BY_OWNER[owner] = state


def state_of(owner) -> SemMoEState | None:
    """The state registered for ``owner`` (``None``: the plugin is not configured there)."""
    if owner is None:
        return None
    try:
        return _BY_OWNER.get(owner)
    except TypeError:  # not weak-referenceable: never registered
        return None


def live_states() -> int:
    """How many distinct states are alive in this process (for tests)."""
    return len({id(s) for s in list(_BY_OWNER.values())})


def runner_state(runner) -> SemMoEState | None:
    """The state of a model runner's model (``None``: no model yet or any more, or not configured)."""
    try:
        return state_of(runner.get_model())
    except (ValueError, AttributeError):  # no model (yet, or any more)
        return None
