"""Run-time fixes for vLLM's CPU backend (vLLM 0.32.x): which, and when they are installed.

vLLM 0.32 on CPU crashes or fails in three situations Sem-MoE needs; each fix is a
:class:`~.patches.base.Patch` of the area it mends, in the plugin's one registry
(:mod:`.patches`):

1. **Tensor parallel + expert parallel**: ``CPUUnquantizedExperts.apply`` ignores ``expert_map``
   and indexes past this rank's experts (:data:`.patches.fused_moe.EXPERT_MAP_APPLY`);
2. **Data parallel**: ``CpuCommunicator`` does not implement ``all_gatherv`` /
   ``reduce_scatterv``, which the MoE layers of a DP engine call
   (:data:`.patches.communicator.ALL_GATHERV`, :data:`.patches.communicator.REDUCE_SCATTERV`);
3. **Data parallel, compiled**: ``MoERunner`` traces the DP gather/scatter into the compiled
   graph with one step's token counts (:data:`.patches.fused_moe.DP_OPAQUE_MOE`).

Policy: the fixes are installed only on the CPU platform and only for the vLLM versions where
the bugs were seen (:data:`AFFECTED_VERSIONS`). On other versions nothing is patched; if a
target has moved, a warning names it. If the fixes are needed (CPU and an affected version) but
a target is missing, :func:`apply_cpu_fixes` raises ``RuntimeError`` naming it, instead of
letting vLLM crash later.
"""

from __future__ import annotations

import logging
from typing import Any

from . import compat
from .patches import communicator, fused_moe
from .patches.base import Patch

logger = logging.getLogger(__name__)

#: vLLM (major, minor) versions with the bugs fixed here.
AFFECTED_VERSIONS = frozenset({(0, 32)})

#: the fixes by name (the keys of :func:`fixes_active`)
FIXES: dict[str, Patch] = {"expert_map": fused_moe.EXPERT_MAP_APPLY, "all_gatherv": communicator.ALL_GATHERV,
                           "reduce_scatterv": communicator.REDUCE_SCATTERV, "dp_opaque_moe": fused_moe.DP_OPAQUE_MOE}


def _missing(fixes) -> list[str]:
    """What is missing of each fix's target (``module.Class.attribute``)."""
    missing = []
    for patch in fixes:
        what = patch.missing()
        if what is None and not callable(getattr(patch.target(), patch.attribute, None)):
            what = f"{patch.owner.replace(':', '.')}.{patch.attribute}"
        if what is not None:
            missing.append(what)
    return missing


def apply_cpu_fixes(version: str | None = None, on_cpu: bool | None = None, fixes=None) -> None:
    """Install the CPU fixes once per process (no-op off CPU or on unaffected vLLM versions).

    ``version`` (the installed vLLM's by default), ``on_cpu`` (the current platform's by default)
    and ``fixes`` (:data:`FIXES` by default) are the guard's inputs, given by tests.
    """
    fixes = list((fixes or FIXES).values())
    if not (compat.current_platform_is_cpu() if on_cpu is None else on_cpu):
        return
    version = version or compat.vllm_version()
    if compat.major_minor(version) not in AFFECTED_VERSIONS:
        missing = _missing(fixes)
        if missing:
            logger.warning("semmoe CPU fixes: vLLM %s is not a version they were written for (%s); not applied, "
                           "and these targets no longer exist: %s", version, sorted(AFFECTED_VERSIONS),
                           "; ".join(missing))
        else:
            logger.info("semmoe CPU fixes: not applied on vLLM %s (written for %s)", version,
                        sorted(AFFECTED_VERSIONS))
        return
    missing = _missing(fixes)
    if missing:
        raise RuntimeError(f"semmoe CPU fixes for vLLM {version}: cannot find {missing[0]}. Without it, "
                           "tensor/expert/data parallel MoE runs on CPU crash; update the patch in "
                           "vllm_semmoe/vllm_adapter/patches/ for this vLLM build.")
    for patch in fixes:
        patch.install()
    logger.debug("semmoe CPU fixes installed for vLLM %s: %s", version, ", ".join(p.name for p in fixes))


def remove_cpu_fixes() -> None:
    """Put vLLM's own CPU classes back (tests)."""
    for patch in FIXES.values():
        patch.remove()


def fixes_active(_worker: Any = None) -> dict[str, bool]:
    """Which fixes are installed in this process (for tests and diagnostics).

    The ignored argument lets it be passed to ``LLM.collective_rpc``, which calls it with the
    worker, to ask each worker process.
    """
    return {name: patch.installed for name, patch in FIXES.items()}
