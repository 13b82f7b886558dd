"""``semmoe doctor [--vllm-source PATH]``: does this vLLM have what the plugin uses?

Prints the vLLM version, every vLLM internal the adapter reaches (present, signature-
compatible), how many internals each supported vLLM version needs by surface, the modes,
compilation settings and parallel layouts this installation supports, and the features this
version refuses at engine start (with the reason); exits 1 on any mismatch (2 when PATH is not
a vLLM source). ``PATH`` is an unpacked vLLM source tree or a wheel (read as a zip, nothing
installed or imported), e.g. one from ``pip download vllm==0.34.0 --no-deps``.
"""

from __future__ import annotations


def cmd_doctor(args) -> int:
    from ..vllm_adapter.doctor import run_doctor

    return run_doctor(args.vllm_source, one_line=args.one_line)


def add_parsers(sub) -> None:
    """Register ``doctor`` on the ``semmoe`` sub-parser set."""
    p = sub.add_parser("doctor", help="check a vLLM (installed, a source tree or a wheel) against the plugin",
                       description=__doc__)
    p.add_argument("--vllm-source", default=None, metavar="PATH",
                   help="an unpacked vLLM source tree or a .whl to check instead of the installed vLLM")
    p.add_argument("--one-line", action="store_true",
                   help="print the result in one line (version, supported or not, modes, what is refused or missing)")
    p.set_defaults(func=cmd_doctor)
