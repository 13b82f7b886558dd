"""The plugin's state in its two kinds of process: one :class:`EngineState` per engine, one
:class:`ApiServerState` per DP client of an API server that routes requests the Sem-MoE way.

An engine's state is created when vLLM builds the model (``create_model`` hook) and registered
under that model object; every other engine hook reaches it from there:

- the model-runner hooks (``_model_forward``, ``shutdown``) through ``runner.get_model()``;
- the custom ops that run inside the compiled model (:mod:`.ops`) through vLLM's per-step
  forward context, where the ``_model_forward`` hook puts the state for the duration of a real
  step (warm-up, profiling and dummy runs do not pass that hook, so they see no state and take
  vLLM's own path);
- ``flush_capture`` (``LLM.collective_rpc``) through the worker's runner.

An API server's state is created when vLLM builds its DP client (at the server's start; a client
made without vLLM's constructor: at the first request it places), and registered under that
client (:func:`api_server_state`).

The registries are weak maps (vLLM object -> state): they keep nothing alive, an engine state holds
no reference to the model (modules are reached through weak references), so when vLLM drops an
engine its model, its state, recorder and counters go with it, and the next engine in the
same process starts from a fresh state.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # for the annotations: at run time the state needs none of these modules
    import torch

    from ..core.modes import Layout
    from ..core.tables import SemMoETables
    from .capture import RoutingRecorder
    from .config import SemMoEConfig
    from .dp_routing import DpRouter
    from .ep_dispatch import CollectiveMeter
    from .metrics import EngineMetrics
    from .tp_shuffle import StepContext, TpShuffleLayer

#: counters of the MoE layers' exchange (TP shuffle, sparse or metered DP dispatch), summed over
#: the MoE layers of one engine; bytes as in :mod:`.ep_dispatch`
MOE_COUNTER_KEYS = ("dispatch_bytes", "combine_bytes", "metadata_bytes", "allreduce_bytes",
                    "reduce_scatter_bytes", "allgather_bytes", "local_activations",
                    "remote_activations", "tokens", "layers_run", "fused_layers_run", "schedule_s",
                    "host_sync_s", "moe_layer_s")


def new_moe_counters() -> dict[str, float]:
    return {key: 0 for key in MOE_COUNTER_KEYS}


@dataclass
class EngineState:
    """The plugin's state for one engine (one model instance in one worker process).

    Attributes:
        config: the validated :class:`~.config.SemMoEConfig`.
        layout: the engine's parallel layout (:class:`~vllm_semmoe.core.modes.Layout`).
        dp_rank: this engine's data-parallel rank.
        ep_size: the number of expert-parallel ranks (1: no expert parallelism).
        tables: the loaded Sem-MoE tables (``None``: capture only).
        token_device: the placement device (EP rank) whose copies this engine's routers prefer
            for the tokens they route (:meth:`~vllm_semmoe.core.placement.Placement.device_map`):
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
        step: the :class:`~.tp_shuffle.StepContext` of the forward step in progress (``None``
            between steps and in engines that do not shuffle).
        flushed_steps / flushed_summary: what the last :func:`~.recording.flush_capture` wrote.
        failures: failures of the plugin's own machinery in this engine, kind -> reason
            (``capture_error``: the capture stopped; ``unmetered``: MoE layers whose token exchange
            is not counted), reported by :func:`~.metrics.report_failure`.
    """

    config: SemMoEConfig
    layout: Layout
    dp_rank: int = 0
    ep_size: int = 1
    tables: SemMoETables | None = None
    token_device: int | None = None
    recorder: RoutingRecorder | None = None
    tp_layers: dict[str, TpShuffleLayer] = field(default_factory=dict)
    fused: dict[str, weakref.ref[torch.nn.Module]] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=new_moe_counters)
    dispatch: str | None = None
    in_step: bool = False
    metrics: EngineMetrics | None = None
    tp_meter: CollectiveMeter | None = None
    step: StepContext | None = None
    flushed_steps: int = -1
    flushed_summary: dict[str, Any] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)

    @property
    def shuffles(self) -> bool:
        """Whether this engine runs the TP token shuffle."""
        return bool(self.tp_layers)

    def moe_counters(self) -> dict[str, float]:
        """The dict a MoE layer adds its counts to now: the engine's during a real step."""
        return self.counters if self.in_step else new_moe_counters()

    def begin_step(self, tokens: np.ndarray | None) -> None:
        """Open the step context of a real forward step over ``tokens`` ``[B]`` (engines that
        shuffle only: the context is the TP shuffle's)."""
        if tokens is None or not self.shuffles:
            self.step = None
            return
        from .tp_shuffle import StepContext

        self.step = StepContext(tokens, self.tables, self.recorder, self.counters)

    def end_step(self) -> None:
        self.step = None


@dataclass
class ApiServerState:
    """The plugin's state in an API server whose DP client routes requests the Sem-MoE way
    (``dp`` mode).

    Attributes:
        config: the validated :class:`~.config.SemMoEConfig`.
        tables: the Sem-MoE tables the router scores prompts with.
        dp_router: the :class:`~.dp_routing.DpRouter` choosing each request's DP rank.
    """

    config: SemMoEConfig
    tables: SemMoETables
    dp_router: DpRouter


#: vLLM object (an engine's model or one of its MoE layers) -> the state of its engine. Weak
#: keys: an entry ends with the vLLM object it is keyed by.
_BY_OWNER: weakref.WeakKeyDictionary[Any, EngineState] = weakref.WeakKeyDictionary()

#: an API server's DP client -> its state (``None``: Sem-MoE does not route its requests)
_BY_CLIENT: weakref.WeakKeyDictionary[Any, ApiServerState | None] = weakref.WeakKeyDictionary()


def register_state(owner, state: EngineState) -> None:
    """Make ``state`` reachable from ``owner`` (the engine's model or one of its MoE layers)."""
    _BY_OWNER[owner] = state


def api_server_state(client, build: Callable[[], ApiServerState | None] | None = None) -> ApiServerState | None:
    """The state of an API server's DP ``client``, made by ``build`` on its first call (``None``:
    Sem-MoE does not route the client's requests, or not built yet and no ``build`` given)."""
    try:
        return _BY_CLIENT[client]
    except KeyError:
        if build is None:
            return None
    state = _BY_CLIENT[client] = build()
    return state


def state_of(owner) -> EngineState | None:
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


def runner_state(runner) -> EngineState | None:
    """The state of a model runner's model (``None``: no model yet or any more, or not configured)."""
    try:
        return state_of(runner.get_model())
    except (ValueError, AttributeError):  # no model (yet, or any more)
        return None
