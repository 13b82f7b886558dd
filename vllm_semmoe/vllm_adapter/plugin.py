"""The ``semmoe`` entry point of the ``vllm.general_plugins`` group.

vLLM calls :func:`register` in every process it starts (API server, engine core, workers), so
it is idempotent and changes no model unless ``additional_config={"semmoe": {...}}`` is set.
It first checks that this vLLM has every internal the plugin uses on its version
(:mod:`.compat`); on a mismatch it fails loudly, naming what is missing (exclude the plugin with
``VLLM_PLUGINS`` to run without it; ``semmoe doctor`` prints the full check). A feature a vLLM
version cannot serve (:data:`.compat.REFUSED_FEATURES`) is refused at engine start, named with
the reason; its hooks are not installed there.

Then it defines the plugin's custom ops (:mod:`.ops`) and installs the patches of vLLM, every one
of which is declared in :mod:`.patches` (one module per patched area of vLLM, each patch naming
its internal and why; all pass through untouched when ``semmoe`` is not configured):

- engine start: validate the settings, tables, layout and compilation (:mod:`.patches.engine_args`);
- model build: the placement before the weights load and the engine's
  :class:`~.state.EngineState` (:mod:`.patches.model_loader`);
- model runner v1 (vLLM 0.32-0.33): the step context of real forward steps, the dummy batches of
  an idle DP rank, the capture at shutdown (:mod:`.patches.model_runner`);
- API server, mode ``dp``: each request's DP rank chosen by Sem-MoE (:mod:`.patches.dp_client`);
- the Triton re-binding scan and, on vLLM's CPU build, the CPU fixes (:mod:`.cpu_fixes`).

``flush_capture`` (for ``LLM.collective_rpc``) and ``make_api_server_state`` are importable from
here too. The plugin leaves process-global hooks such as ``sys.excepthook`` alone.
"""

from __future__ import annotations

from . import compat, ops, patches
from .patches.dp_client import make_api_server_state
from .recording import flush_capture

#: every vLLM internal the plugin touches (see :mod:`.compat`)
REQUIRED_INTERNALS = compat.INTERNALS
check_vllm = compat.check_vllm

__all__ = ["register", "check_vllm", "flush_capture", "make_api_server_state", "REQUIRED_INTERNALS"]


def register() -> None:
    """Check this vLLM, define the plugin's ops and install its patches (once per process)."""
    compat.check_vllm()
    ops.register_ops()
    patches.install_all()
