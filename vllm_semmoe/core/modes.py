"""The modes Sem-MoE runs in: one definition, which every layer validates through.

Serving modes (:class:`ServingMode`), what Sem-MoE schedules besides the experts:

- ``tp`` (Attention-TP): every rank of the TP group holds every token; Sem-MoE re-assigns tokens
  to ranks at each MoE layer inside the post-attention reduce-scatter. The data unit is the token.
- ``dp`` (Attention-DP): a request lives on one data-parallel rank for all layers; Sem-MoE picks
  that rank. The data unit is the request.

Engine modes (:class:`Mode`), what the plugin does in a served engine: ``placement-only``
(apply the placement, schedule no data) or one of the serving modes. Each :class:`Mode` member
carries its facts: the serving mode it schedules (:attr:`Mode.serving`), the adapter pieces it
installs (:attr:`Mode.installs`), the parallel layouts it can serve (:meth:`Mode.check_layout`),
its default MoE dispatch (:meth:`Mode.dispatch`) and where replica slots can serve
(:meth:`Mode.replica_device`). Layouts are plain :class:`Layout` values; turning vLLM's
configuration into one is the adapter's business.

Both are ``str`` enums: their members are the strings ``"tp"`` / ``"dp"`` / ``"placement-only"``
(so they compare, print, quote in messages and serialise as those, and ``Mode.TP ==
ServingMode.TP``; ``enum.StrEnum`` would do the same but needs Python 3.11, and the package
supports 3.10). :func:`serving_mode` and :func:`engine_mode` turn user input into one with an
error that names the valid modes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class _StrEnum(str, Enum):
    """A ``str`` enum that prints, formats and quotes as its value."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __repr__(self) -> str:  # messages quote the mode as the user wrote it: 'tp'
        return repr(self.value)


class ServingMode(_StrEnum):
    """How attention is parallelised, which decides what Sem-MoE schedules (module docstring)."""

    TP = "tp"
    DP = "dp"


#: the serving modes' names, for argument choices and messages
MODES: tuple[str, ...] = tuple(m.value for m in ServingMode)


def serving_mode(value) -> ServingMode:
    """``value`` (``"tp"``, ``"dp"`` or a member) as a :class:`ServingMode`.

    Raises ``ValueError`` ("mode must be one of tp, dp, got ...") for anything else."""
    try:
        return ServingMode(value)
    except ValueError:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {value!r}") from None


class ModeError(ValueError):
    """A layout or setting the engine mode cannot serve; the message names what to change."""


#: how MoE layers exchange tokens under DP + EP: vLLM's all-gather / reduce-scatter, or only
#: to the ranks holding each token's experts (the adapter's sparse dispatch)
DISPATCHES: tuple[str, ...] = ("vllm", "sparse")

# the adapter pieces a mode installs (:attr:`Mode.installs`)
#: the expert placement of the tables (any mode with tables)
PLACEMENT = "placement"
#: the routing recorder that meters live LAR (and writes a capture when asked)
RECORDER = "recorder"
#: the per-layer token shuffle over the TP group, fused into decoder layers where recognised
TP_SHUFFLE = "tp_shuffle"
#: the API server's choice of data-parallel rank per request
DP_ROUTER = "dp_router"


@dataclass(frozen=True)
class Layout:
    """A parallel layout: sizes of tensor, data, pipeline and (prefill / decode) context
    parallelism, whether experts are spread over the ranks (``ep``) and whether vLLM's EPLB
    moves them."""

    tp: int = 1
    dp: int = 1
    ep: bool = False
    pp: int = 1
    pcp: int = 1
    dcp: int = 1
    eplb: bool = False

    def describe(self) -> str:
        """``DP d, TP t, expert parallelism on|off``, as refusals quote the running layout."""
        return f"DP {self.dp}, TP {self.tp}, expert parallelism {'on' if self.ep else 'off'}"


class Mode(_StrEnum):
    """An engine mode and its facts (module docstring). ``Mode("tp")`` or :func:`engine_mode`
    looks one up; iterating the class lists them all."""

    PLACEMENT_ONLY = ("placement-only", None, (PLACEMENT,), "")
    TP = ("tp", ServingMode.TP, (PLACEMENT, RECORDER, TP_SHUFFLE), "shuffles tokens over tensor-parallel ranks")
    DP = ("dp", ServingMode.DP, (PLACEMENT, RECORDER, DP_ROUTER), "routes requests over data-parallel ranks")

    def __new__(cls, name: str, serving: ServingMode | None, installs: tuple[str, ...], does: str):
        member = str.__new__(cls, name)
        member._value_ = name
        #: the serving mode whose data the engine schedules (``None``: none, placement only)
        member.serving = serving
        #: the adapter pieces the mode installs (:data:`PLACEMENT`, :data:`RECORDER`, ...); the
        #: placement only with tables, the TP shuffle only where there is a TP group with EP
        member.installs = installs
        member._does = does
        return member

    @property
    def schedules_data(self) -> bool:
        """Whether the engine schedules data (tokens or requests) the Sem-MoE way, and so needs
        tables solved for :attr:`serving` and meters live LAR."""
        return self.serving is not None

    def check_layout(self, layout: Layout, dispatch: str | None = None) -> None:
        """Raise :class:`ModeError` for a layout this mode cannot serve, or one the requested
        ``dispatch`` cannot run on.

        Every mode refuses pipeline and context parallelism (each pipeline stage holds only some
        MoE layers: placement tables, capture and shuffle are per whole model). ``placement-only``
        serves any TP/DP/EP combination; ``dp`` needs DP > 1 with expert parallelism; ``tp``
        needs TP > 1 with expert parallelism and DP 1 (the shuffle exchanges rows within the TP
        group, which is the EP group only when DP is 1). The ``sparse`` dispatch needs DP > 1,
        TP 1 and expert parallelism.
        """
        if layout.pp > 1:
            raise ModeError(
                f"semmoe: pipeline parallelism (pipeline_parallel_size={layout.pp}) is not supported: "
                "tables, capture and the TP shuffle cover all MoE layers of one model replica. "
                "Serve with tensor/data/expert parallelism only, or remove the semmoe settings.")
        for size, flag in ((layout.pcp, "prefill_context_parallel_size"), (layout.dcp, "decode_context_parallel_size")):
            if size > 1:
                raise ModeError(f"semmoe: context parallelism ({flag}={size}) is not supported; "
                                "remove it or the semmoe settings.")
        if self is Mode.TP and layout.tp > 1 and layout.ep and layout.dp > 1:
            raise ModeError(
                f"semmoe: mode 'tp' with data parallelism (TP {layout.tp} x DP {layout.dp} + EP) is not "
                "supported: the token shuffle exchanges rows within a TP group, but the EP group spans "
                "DP x TP. Use --data-parallel-size 1 with mode 'tp', or mode 'dp' for data-parallel serving.")
        running = f"running {layout.describe()}"
        if self.serving is not None:
            axis = {ServingMode.TP: ("tensor", layout.tp), ServingMode.DP: ("data", layout.dp)}
            kind, size = axis[self.serving]
            if size < 2 or not layout.ep:
                raise ModeError(
                    f"semmoe mode {self!r} {self._does}: add --{kind}-parallel-size N (N >= 2) and "
                    f"--enable-expert-parallel, or use --mode {Mode.PLACEMENT_ONLY} ({running})")
        if dispatch == "sparse" and (layout.dp < 2 or layout.tp != 1 or not layout.ep):
            raise ModeError(
                f"semmoe dispatch 'sparse' exchanges tokens between data-parallel ranks: it needs "
                f"--data-parallel-size N (N >= 2), --tensor-parallel-size 1 and --enable-expert-parallel "
                f"({running})")

    def dispatch(self, layout: Layout, requested: str | None = None) -> str | None:
        """The MoE dispatch an engine of this mode runs: ``requested`` if given, else the
        mode's default (``sparse`` in mode ``dp`` with TP 1, else ``vllm``); ``None`` when the
        layout has no DP + EP dispatch at all (DP 1 or no expert parallelism)."""
        if layout.dp < 2 or not layout.ep:
            return None
        if requested is not None:
            return requested
        return "sparse" if self is Mode.DP and layout.tp == 1 else "vllm"

    def layout_warning(self, layout: Layout, dispatch: str | None) -> str | None:
        """A layout this mode serves but gains little on (``None``: none): mode ``dp`` on
        vLLM's own dispatch, whose all-gather moves as many bytes whatever the ranks hold."""
        if self is Mode.DP and dispatch == "vllm":
            return ("semmoe: mode 'dp' with vLLM's own MoE dispatch: on a backend that all-gathers tokens "
                    "(allgather_reducescatter, the CPU build's) a higher local activation rate moves no fewer "
                    "bytes; serve with TP 1 and the sparse dispatch (the default in mode dp), or an all-to-all "
                    "backend (--all2all-backend deepep_low_latency, pplx, flashinfer_all2allv, ...)")
        return None

    def replica_device(self, layout: Layout, redundant: int, ep_rank: int) -> int | None:
        """The placement device whose copies this engine's routers prefer: ``ep_rank`` when the
        tables hold ``redundant`` > 0 replica slots per device, ``None`` (home copies) without.

        Replicas serve the tokens of the rank holding them, so every rank must route only tokens
        it serves: DP ranks (TP 1) route their own requests, the TP shuffle (mode ``tp``, DP 1)
        computes only its scheduled tokens. Other layouts are refused (a replica there would
        count an activation twice, or never be used), as is vLLM's EPLB (it keeps its own map).
        """
        if not redundant:
            return None
        where = f"tables solved with --redundant {redundant}"
        if layout.eplb:
            raise ModeError(f"semmoe: {where} drive the redundant expert slots themselves; "
                            "vLLM's EPLB would move them: remove --enable-eplb")
        if not layout.ep or layout.dp * layout.tp < 2:
            raise ModeError(f"semmoe: {where} give each EP rank replica slots: serve with "
                            "--enable-expert-parallel over 2 or more ranks, or solve with --redundant 0")
        if not ((layout.tp == 1 and layout.dp > 1) or (self is Mode.TP and layout.dp == 1)):
            raise ModeError(
                f"semmoe: {where} serve a token from a replica on the rank that routes it, which needs DP ranks "
                f"with TP 1 or mode 'tp' (the token shuffle) with DP 1 (running DP {layout.dp}, TP {layout.tp}, "
                f"mode {self!r}): change the layout or mode, or solve with --redundant 0")
        return int(ep_rank)

    def checks_tables_ep(self, ep_size: int) -> bool:
        """Whether tables must be solved for the engine's EP size ``ep_size``: not for
        ``placement-only`` on a single device, where the permutation is still exact (how
        losslessness is tested without EP)."""
        return self.schedules_data or ep_size != 1

    def check_tables_mode(self, tables_mode, where: str) -> None:
        """Raise :class:`ModeError` unless tables solved for ``tables_mode`` (a serving mode)
        fit this mode: a data-scheduling mode needs tables of its own serving mode;
        ``placement-only`` takes any. ``where``: the tables' directory, for the message."""
        if self.serving is not None and tables_mode != self.serving:
            raise ModeError(
                f"semmoe: tables {where} were solved for mode {tables_mode!r}, the engine runs mode "
                f"{self!r}: re-solve with `semmoe solve --mode {self}` or serve with --mode {tables_mode}")


#: the engine modes' names, for argument choices and messages
ENGINE_MODES: tuple[str, ...] = tuple(m.value for m in Mode)


def engine_mode(value) -> Mode:
    """``value`` (``"placement-only"``, ``"tp"``, ``"dp"``, or a :class:`Mode` or
    :class:`ServingMode` member) as a :class:`Mode`.

    Raises ``ValueError`` ("mode must be one of placement-only, tp, dp, got ...") for anything else."""
    try:
        return Mode(value)
    except ValueError:
        raise ValueError(f"mode must be one of {', '.join(ENGINE_MODES)}, got {value!r}") from None
