"""The serving modes Sem-MoE schedules for: one definition, which every layer validates through.

- ``tp`` (Attention-TP): every rank of the TP group holds every token; Sem-MoE re-assigns tokens
  to ranks at each MoE layer inside the post-attention reduce-scatter. The data unit is the token.
- ``dp`` (Attention-DP): a request lives on one data-parallel rank for all layers; Sem-MoE picks
  that rank. The data unit is the request.

:class:`ServingMode` is a ``str`` enum: its members are the strings ``"tp"`` / ``"dp"`` (so they
compare, print, quote in messages and serialise as those; ``enum.StrEnum`` would do the same
but needs Python 3.11, and the package supports 3.10), and :func:`serving_mode` turns user input
into one with an error that names the valid modes.
"""

from __future__ import annotations

from enum import Enum


class ServingMode(str, Enum):
    """How attention is parallelised, which decides what Sem-MoE schedules (module docstring)."""

    TP = "tp"
    DP = "dp"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __repr__(self) -> str:  # messages quote the mode as the user wrote it: 'tp'
        return repr(self.value)


#: the modes' names, for argument choices and messages
MODES: tuple[str, ...] = tuple(m.value for m in ServingMode)


def serving_mode(value) -> ServingMode:
    """``value`` (``"tp"``, ``"dp"`` or a member) as a :class:`ServingMode`.

    Raises ``ValueError`` ("mode must be one of tp, dp, got ...") for anything else."""
    try:
        return ServingMode(value)
    except ValueError:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {value!r}") from None
