"""``additional_config["semmoe"]``: the plugin's settings, validated at engine start."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass

from ..core import scheduling
from ..core.modes import DISPATCHES, Layout, Mode, ModeError, engine_mode
from ..core.tables import SemMoETables, TablesError, load_tables

#: the engine mode that applies the placement and schedules no data (the engine modes, the MoE
#: dispatches and their rules: :mod:`vllm_semmoe.core.modes`)
PLACEMENT_ONLY = Mode.PLACEMENT_ONLY
KEYS = ("tables", "capture", "mode", "dispatch", "dp_balance", "dp_price_step", "dp_decode_weight", "dp_slack")
#: keys of earlier versions -> what replaced them
RENAMED: dict[str, str] = {}  # none at present


class SemMoEConfigError(ValueError):
    """The ``semmoe`` settings are invalid or do not fit the model being served."""


@dataclass(frozen=True)
class SemMoEConfig:
    """Validated plugin settings.

    Attributes:
        tables: directory written by ``semmoe solve`` (``None``: no re-placement).
        capture: path ``X.npz`` of the routing capture (``None``: no capture). Engines append
            every step to ``X.npz.parts/`` as it ends (:mod:`vllm_semmoe.core.capture_store`);
            :func:`vllm_semmoe.core.capture_store.load_trace` reads it as one trace.
        mode: the engine mode, a :class:`~vllm_semmoe.core.modes.Mode` (a name given is looked up):
            ``placement-only`` (apply the placement), ``tp`` or ``dp`` (also schedule data the
            Sem-MoE way and meter live LAR accordingly).
        dispatch: ``sparse`` or ``vllm`` (see :data:`DISPATCHES`); ``None``: ``sparse`` in mode
            ``dp`` where the layout allows it (DP > 1, TP 1, expert parallelism), else ``vllm``.
        dp_balance: ``dp`` mode proportional balance knob (``scheduling.dp_choose_balanced``):
            votes per unit of work a request pays per mean request of in-flight work a rank
            carries beyond the least-loaded one.
        dp_price_step: ``dp`` mode step of the per-rank prices the router learns from the work it
            sends each rank (same function).
        dp_decode_weight: ``dp`` mode work of a request beyond its prompt tokens (its expected
            output length; ``scheduling.request_work``).
        dp_slack: ``dp`` mode hard guard: never choose a rank whose queue score (vLLM's:
            in-flight plus queued requests) exceeds the least-loaded rank's by more than this.
    """

    tables: str | None = None
    capture: str | None = None
    mode: Mode = Mode.PLACEMENT_ONLY
    dispatch: str | None = None
    dp_balance: float = scheduling.DEFAULT_DP_BALANCE
    dp_price_step: float = scheduling.DEFAULT_DP_PRICE_STEP
    dp_decode_weight: float = scheduling.DEFAULT_DECODE_WEIGHT
    dp_slack: float = 8.0

    def __post_init__(self):
        try:
            object.__setattr__(self, "mode", engine_mode(self.mode))
        except ValueError as exc:
            raise SemMoEConfigError(f"semmoe {exc}") from None

    @classmethod
    def from_additional_config(cls, additional_config) -> "SemMoEConfig | None":
        """Parse ``vllm_config.additional_config``; ``None`` when the plugin is not configured."""
        if not additional_config:
            return None
        if not isinstance(additional_config, dict):
            raise SemMoEConfigError(f"additional_config must be a JSON object, got {type(additional_config).__name__}")
        if "semmoe" not in additional_config:
            return None
        raw = additional_config["semmoe"]
        if not isinstance(raw, dict):
            raise SemMoEConfigError(f"additional_config['semmoe'] must be a JSON object, got {type(raw).__name__}")
        renamed = [f"{k!r} (now {RENAMED[k]})" for k in sorted(set(raw) & set(RENAMED))]
        if renamed:
            raise SemMoEConfigError(f"additional_config['semmoe']: key(s) {', '.join(renamed)} no longer exist")
        unknown = sorted(repr(k) for k in set(raw) - set(KEYS))
        if unknown:
            raise SemMoEConfigError(
                f"unknown key(s) {', '.join(unknown)} in additional_config['semmoe'] "
                f"(valid keys: {', '.join(KEYS)})"
            )
        for key in ("mode", "tables", "capture", "dispatch"):
            if raw.get(key) is not None and not isinstance(raw[key], str):
                raise SemMoEConfigError(f"semmoe {key} must be a string, got {raw[key]!r}")
        try:
            mode = engine_mode(raw.get("mode", Mode.PLACEMENT_ONLY))
        except ValueError as exc:
            raise SemMoEConfigError(f"semmoe {exc}") from None
        dispatch = raw.get("dispatch")
        if dispatch is not None and dispatch not in DISPATCHES:
            raise SemMoEConfigError(f"semmoe dispatch must be one of {', '.join(DISPATCHES)}, got {dispatch!r}")
        tables = raw.get("tables")
        if tables is not None and not os.path.isdir(tables):
            raise SemMoEConfigError(f"semmoe tables directory not found: {tables}")
        if mode.schedules_data and tables is None:
            raise SemMoEConfigError(f"semmoe mode {mode!r} needs 'tables' (a directory from `semmoe solve`)")
        capture = raw.get("capture")
        if capture is not None:
            parent = os.path.dirname(os.path.abspath(capture))
            if not capture or os.path.isdir(capture):
                raise SemMoEConfigError(f"semmoe capture must be a file path like routing.npz, got {capture!r}")
            if not os.path.isdir(parent):
                raise SemMoEConfigError(f"semmoe capture path's directory does not exist: {parent}")
        if tables is None and capture is None and dispatch is None:
            raise SemMoEConfigError("additional_config['semmoe'] sets none of 'tables', 'capture', 'dispatch'")
        numbers = {}
        for key in ("dp_balance", "dp_price_step", "dp_decode_weight", "dp_slack"):
            if key in raw:
                value = raw[key]
                if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < float("inf"):
                    raise SemMoEConfigError(f"semmoe {key} must be a number >= 0, got {value!r}")
                numbers[key] = float(value)
        return cls(tables=tables, capture=capture, mode=mode, dispatch=dispatch, **numbers)

    @property
    def records(self) -> bool:
        """Whether engines keep a routing recorder (for the capture file or live metering)."""
        return self.capture is not None or self.mode.schedules_data

    def resolved_dispatch(self, parallel_config) -> str | None:
        """The dispatch the engine runs: ``sparse``, ``vllm``, or ``None`` when the layout has no
        DP + EP dispatch at all (DP 1 or no expert parallelism); :meth:`~vllm_semmoe.core.modes.Mode.dispatch`."""
        return self.mode.dispatch(layout_of(parallel_config), self.dispatch)

    def read_tables(self) -> SemMoETables | None:
        """The tables ``self.tables`` names, read from disk (``None``: no tables configured); a
        damaged directory raises :class:`SemMoEConfigError`. The one place the plugin reads
        tables: the engine-start check, the engine's model build and the API server's DP router."""
        if self.tables is None:
            return None
        try:
            return load_tables(self.tables)
        except TablesError as exc:
            raise _tables_error(exc) from None

    def load_tables(self, *, num_layers: int | None, num_experts: int, ep_size: int,
                    tables: SemMoETables | None = None) -> SemMoETables | None:
        """Load the tables (``tables``: already read by :meth:`read_tables`) and check them
        against the running model, EP size and mode (``num_layers=None``: layer count not known
        yet, not checked).

        ``placement-only`` on a single device (``ep_size == 1``) accepts tables of any EP size:
        the permutation is still exact, which is how losslessness is tested without EP. ``tp``
        and ``dp`` need tables solved for that mode (``semmoe solve --mode``).
        """
        tables = self.read_tables() if tables is None else tables
        if tables is None:
            return None
        try:
            tables.check_compatible(num_layers=tables.num_layers if num_layers is None else num_layers,
                                    num_experts=num_experts,
                                    ep_size=ep_size if self.mode.checks_tables_ep(ep_size) else None)
        except TablesError as exc:
            raise _tables_error(exc) from None
        with refusals():
            self.mode.check_tables_mode(tables.mode, self.tables)
        return tables


def _tables_error(exc: TablesError) -> SemMoEConfigError:
    """A tables problem as the plugin reports it (with the fix for tables of another shape)."""
    hint = "; solve tables for this model and EP size (semmoe solve --ep)" if "configuration" in str(exc) else ""
    return SemMoEConfigError(f"semmoe: {exc}{hint}")


@contextlib.contextmanager
def refusals():
    """Raise a :class:`~vllm_semmoe.core.modes.ModeError` from the mode rules as the plugin's
    :class:`SemMoEConfigError` (same message)."""
    try:
        yield
    except ModeError as exc:
        raise SemMoEConfigError(str(exc)) from None


def layout_of(parallel_config) -> Layout:
    """The :class:`~vllm_semmoe.core.modes.Layout` vLLM's ``ParallelConfig`` (or any object with its
    attribute names; absent optional ones read as off / 1) states."""
    p = parallel_config
    return Layout(tp=int(p.tensor_parallel_size), dp=int(p.data_parallel_size),
                  ep=bool(getattr(p, "enable_expert_parallel", False)),
                  pp=int(getattr(p, "pipeline_parallel_size", 1)),
                  pcp=int(getattr(p, "prefill_context_parallel_size", 1)),
                  dcp=int(getattr(p, "decode_context_parallel_size", 1)),
                  eplb=bool(getattr(p, "enable_eplb", False)))


def replica_token_device(tables: SemMoETables | None, mode, parallel_config, ep_rank: int) -> int | None:
    """The placement device whose copies this engine's routers prefer: its EP rank when the
    tables hold replica slots, ``None`` (home copies) without them; refuses (as
    :class:`SemMoEConfigError`) the layouts where replicas cannot serve:
    :meth:`~vllm_semmoe.core.modes.Mode.replica_device`."""
    R = tables.placement.redundant if tables is not None else 0
    with refusals():
        return engine_mode(mode).replica_device(layout_of(parallel_config), R, ep_rank)


def moe_layer_count(hf_config) -> int | None:
    """MoE layers of a model from its Hugging Face config, as vLLM 0.32 builds them, for the
    families whose layout rule is known (Qwen2/3-MoE, DeepSeek-V2/V3, Mixtral, OLMoE); ``None``
    otherwise (then the count is checked once the model is built)."""
    kind = getattr(hf_config, "model_type", "")
    layers = getattr(hf_config, "num_hidden_layers", None)
    if not isinstance(layers, int):
        return None
    if kind in ("qwen2_moe", "qwen3_moe"):
        step = getattr(hf_config, "decoder_sparse_step", 1) or 1
        dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
        return sum(1 for layer in range(layers) if layer not in dense and (layer + 1) % step == 0)
    if kind in ("deepseek_v2", "deepseek_v3"):
        first = getattr(hf_config, "first_k_dense_replace", 0) or 0
        freq = getattr(hf_config, "moe_layer_freq", 1) or 1
        return sum(1 for layer in range(first, layers) if layer % freq == 0)
    if kind in ("mixtral", "olmoe"):
        return layers
    return None


def expert_parallel_size(parallel_config) -> int:
    """EP size vLLM will use: TP × DP (× PCP) with ``--enable-expert-parallel``, else 1."""
    if not getattr(parallel_config, "enable_expert_parallel", False):
        return 1
    size = parallel_config.tensor_parallel_size * parallel_config.data_parallel_size
    return size * getattr(parallel_config, "prefill_context_parallel_size", 1)


def install_one_line_refusals() -> None:
    """Make an uncaught :class:`SemMoEConfigError` (a refused start) print one line instead of
    vLLM's call stack; the traceback goes to the debug log. Other exceptions keep the previous
    hook. Idempotent. Installed by ``semmoe serve`` in its own process only: the plugin itself
    leaves a host program's ``sys.excepthook`` alone."""
    previous = sys.excepthook
    if getattr(previous, "_semmoe", False):
        return

    def hook(kind, value, traceback):
        if isinstance(value, SemMoEConfigError):
            logging.getLogger("vllm.semmoe").debug("semmoe: start refused", exc_info=(kind, value, traceback))
            message = str(value).removeprefix("semmoe: ")
            print(f"semmoe: error: {message}", file=sys.stderr, flush=True)
            return
        previous(kind, value, traceback)

    hook._semmoe = True
    sys.excepthook = hook
