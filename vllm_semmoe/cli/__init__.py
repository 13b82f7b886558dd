"""The ``semmoe`` command line, one module per concern.

- :mod:`.offline` — ``analyze``, ``solve``, ``eval`` (no vLLM);
- :mod:`.costs` — ``cost`` (the MoE-layer cost model on real routing, no vLLM);
- :mod:`.serving` — ``profile``, ``serve``, ``bench-serve``, ``bench-ep``, ``demo`` (vLLM);
- :mod:`.interop` — ``import`` (vLLM / SGLang routing), ``export`` (SGLang / vLLM placement files),
  ``report`` (HTML page with figures);
- :mod:`.doctor` — ``doctor`` (this vLLM against every internal the plugin uses);
- :mod:`.route` — ``route`` (Sem-MoE's DP rank choice for one request, for an outside router; no vLLM);
- :mod:`.output` — JSON writing, progress bars, table cells shared by all commands.

Each concern module has ``add_parsers(sub)``; a new command is added in its module and, for a new
module, in :data:`COMMAND_MODULES`. The accepted placement methods are the policy registry's
(:data:`vllm_semmoe.core.policy.POLICIES`).
"""

from __future__ import annotations

import argparse
import sys

from . import costs, doctor, interop, offline, route, serving
from .offline import (COLUMNS, DEFAULT_TRACE_HINT, format_affinity_comparison, format_affinity_table,
                      format_eval_table, method_names)
from .output import DefaultsHelpFormatter, write_json
from .serving import DEFAULT_SHAREGPT, serve_command

#: The modules whose ``add_parsers(sub)`` make up ``semmoe``'s sub-commands, in help order.
COMMAND_MODULES = (offline, costs, serving, interop, doctor, route)


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(prog="semmoe", description="Sem-MoE expert placement and scheduling for vLLM.")
    parser.add_argument("--version", action="version", version=f"vllm-semmoe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMAND_MODULES:
        module.add_parsers(sub)
    for command in sub.choices.values():  # every sub-command's --help shows the defaults
        command.formatter_class = DefaultsHelpFormatter
    return parser


def main(argv: list[str] | None = None) -> int:
    from ..core.placement import PlacementError
    from ..core.tables import TablesError
    from ..core.trace import TraceError
    from ..vllm_adapter.config import SemMoEConfigError

    argv = sys.argv[1:] if argv is None else argv
    for module in COMMAND_MODULES:
        passthrough = getattr(module, "PASSTHROUGH", {})
        if argv[:1] and argv[0] in passthrough:
            return passthrough[argv[0]](argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (TraceError, TablesError, PlacementError, SemMoEConfigError, FileNotFoundError, ValueError) as exc:
        print(f"semmoe: error: {exc}", file=sys.stderr)
        return 2


__all__ = ["COLUMNS", "DEFAULT_SHAREGPT", "DEFAULT_TRACE_HINT", "build_parser", "format_affinity_comparison",
           "format_affinity_table", "format_eval_table", "main", "method_names", "serve_command", "write_json"]
