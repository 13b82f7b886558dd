"""Shared output helpers of the ``semmoe`` commands: JSON files, progress bars, table cells.

Every command that prints a table also takes ``--json PATH`` (``-`` = stdout); :func:`add_json_argument`
declares it and :func:`write_json` writes it, so the two stay the same everywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """``--help`` shows every option's default (``(default: X)``) unless its text already says it,
    and ``(required)`` for required options."""

    def _get_help_string(self, action):
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        if action.required:
            return f"{text} (required)".strip()
        if "default" not in text and action.default is not None and action.default is not False:
            return f"{text} (default: %(default)s)".strip()
        return text


def add_json_argument(parser, what: str = "the figures") -> None:
    """Declare ``--json PATH`` on a sub-command's parser."""
    parser.add_argument("--json", help=f"also write {what} as JSON to this path ('-' = stdout)")


def add_redundant_argument(parser, several: bool = False) -> None:
    """Declare ``--redundant R`` (replica slots per device) on a sub-command's parser;
    ``several``: ``--redundant R[,R...]``, parsed to a list of ints (one run per value)."""
    help = ("replica slots per device for locality, for the methods that replicate (semmoe); "
            "vLLM EPLB's layout, num_redundant_experts = EP x R (default 0)")
    if several:
        parser.add_argument("--redundant", type=_int_list, default=[0], metavar="R[,R...]",
                            help=help + "; comma-separated: the replicating methods run once per value")
    else:
        parser.add_argument("--redundant", type=non_negative_int, default=0, metavar="R", help=help)


def add_sample_argument(parser) -> None:
    """Declare ``--sample head|spread``: which steps ``--max-batches`` keeps
    (:func:`vllm_semmoe.core.schedulers.sample_steps`)."""
    from ..core.schedulers import SAMPLES

    parser.add_argument("--sample", choices=SAMPLES, default="head",
                        help="with --max-batches: the first steps of the evaluation stream (head, default) "
                             "or steps spread evenly over the whole stream (spread)")


def int_at_least(minimum: int):
    """An argparse ``type=`` accepting integers ``>= minimum``; anything else is the sub-command's
    own usage error (``semmoe solve: error: argument --ep: expected an integer >= 1, got '0'``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


#: ``type=`` of every count or size option (``--ep``, ``--batch-tokens``, ``--num-prompts``, ...).
positive_int = int_at_least(1)
#: ``type=`` of options where 0 is meaningful (``--seed``, ``--skip``, ``--dense-layers``, ``--redundant``).
non_negative_int = int_at_least(0)


def _int_list(text: str) -> list[int]:
    try:
        values = [non_negative_int(part) for part in text.split(",") if part.strip()]
    except argparse.ArgumentTypeError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got {text!r}")
    return values


def number_list(text: str) -> list[float]:
    """``type=`` of options taking comma-separated numbers >= 0 (``--loads``, ``--dp-balance``,
    ``--dp-slack``, ``--dp-balance-curve``)."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(not value >= 0 for value in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers >= 0, got {text!r}")
    return values


def _jsonable(value):
    """``json.dump`` fallback: NumPy scalars/arrays and paths as plain values."""
    import numpy as np

    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def write_json(path: str, payload) -> None:
    """Write ``payload`` as indented JSON to ``path`` (``-`` = stdout; parent folders are created)."""
    if path == "-":
        json.dump(payload, sys.stdout, indent=2, default=_jsonable)
        print()
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=_jsonable)
        f.write("\n")
    print(f"wrote {path}", file=sys.stderr)


class Progress:
    """``progress(done, total, message)`` callback drawing tqdm bars on stderr.

    Solvers and benchmarks report ``(done, total, message)``; a new ``message`` (or ``total``)
    starts a new bar, ``done >= total`` closes it. Off a terminal the bar refreshes rarely
    (every 30 s), so logs get a start and an end line instead of one line per step.
    """

    def __init__(self, prefix: str = "semmoe", disable: bool = False):
        self.prefix = prefix
        self.disable = disable
        self._bar = None
        self._key = None

    def __call__(self, done: int, total: int, message: str) -> None:
        from tqdm import tqdm

        if self.disable:
            return
        key = (message, total)
        if key != self._key:
            self.close()
            tty = sys.stderr.isatty()
            self._bar = tqdm(total=total, desc=f"[{self.prefix}] {message}", file=sys.stderr, leave=True,
                             dynamic_ncols=True, mininterval=0.1 if tty else 30.0)
            self._key = key
        step = min(done, total) - self._bar.n
        if step > 0:
            self._bar.update(step)  # redraws at most every mininterval
        if done >= total:
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._bar, self._key = None, None


def cell(value, width: int, spec: str = ".4f") -> str:
    """One right-aligned table cell; ``None`` / missing values print as ``-``."""
    if value is None:
        return f"{'-':>{width}}"
    return f"{value:>{width}{spec}}"
