"""The plugin's one seam to vLLM (``vllm_adapter/patches``): every patch names an internal of
``compat.INTERNALS``, installs once, and its removal gives vLLM back its own attributes; the CPU
fixes' version/platform guard; the DP + EP stages are vLLM's stage class. No engine."""

from __future__ import annotations

import importlib
import logging
import sys
import types

import pytest

pytest.importorskip("vllm")

from vllm_semmoe.vllm_adapter import compat, cpu_fixes, patches  # noqa: E402
from vllm_semmoe.vllm_adapter.patches.base import MARKER, Patch, installed_patch  # noqa: E402

_ABSENT = object()


def _own(patch: Patch):
    """What the patch's owner holds in its own namespace (``_ABSENT``: nothing)."""
    return vars(patch.target()).get(patch.attribute, _ABSENT)


@pytest.fixture()
def restored():
    """Leave vLLM patched exactly as the test found it (this process may serve engines later)."""
    before = patches.installed()
    yield
    patches.remove_all()
    if before:
        patches.install_all()
        assert patches.installed() == before


def test_every_patch_names_an_internal_and_says_why() -> None:
    names = {internal.name for internal in compat.INTERNALS}
    assert patches.PATCHES, "the registry is empty"
    for patch in patches.PATCHES:
        assert patch.internal in names, patch.internal
        assert patch.entry().name == patch.internal
        assert len(patch.why) > 20 and "\n" not in patch.why, patch.name
    assert len({(p.owner, p.attribute) for p in patches.PATCHES}) == len(patches.PATCHES), "a target patched twice"
    for hook in patches.LAYER_HOOKS:
        assert hook.internal in names, hook.internal
        module, _, function = hook.installed_by.partition(":")
        owner = importlib.import_module(f"vllm_semmoe.vllm_adapter.{module}")
        assert callable(getattr(owner, function, None)), hook.installed_by


def test_a_patch_without_its_internal_is_refused() -> None:
    with pytest.raises(LookupError, match="not in compat.INTERNALS"):
        Patch("vllm.no_such_module.Thing.method", "a patch of something vLLM never had", lambda original: original)


def test_install_and_remove_all_restore_vllm(restored) -> None:
    patches.remove_all()
    needed = patches.needed()
    assert needed, "this vLLM needs no patch?"
    originals = {patch.name: _own(patch) for patch in patches.PATCHES}
    hook = sys.excepthook

    patches.install_all()
    for patch in needed:
        assert patch.installed, patch.name
        assert installed_patch(_own(patch)) is patch, patch.name
        assert getattr(patch.target(), patch.attribute) is not originals[patch.name]
    if compat.current_platform_is_cpu() and compat.major_minor(compat.vllm_version()) in cpu_fixes.AFFECTED_VERSIONS:
        assert all(cpu_fixes.fixes_active().values()), cpu_fixes.fixes_active()
    first = {patch.name: _own(patch) for patch in patches.PATCHES}
    patches.install_all()  # a second install changes nothing
    assert {patch.name: _own(patch) for patch in patches.PATCHES} == first
    assert sys.excepthook is hook

    patches.remove_all()
    assert patches.installed() == []
    assert not any(cpu_fixes.fixes_active().values())
    for patch in patches.PATCHES:
        assert _own(patch) is originals[patch.name], patch.name
    assert all(installed_patch(getattr(p.target(), p.attribute, None)) is None for p in patches.PATCHES)
    patches.remove_all()  # twice: nothing to restore
    assert sys.excepthook is hook


def test_register_installs_the_registry(restored) -> None:
    from vllm_semmoe.vllm_adapter import plugin

    patches.remove_all()
    plugin.register()
    assert set(patches.installed()) >= {patch.name for patch in patches.needed()}


def test_a_staticmethod_stays_one() -> None:
    """vLLM's DP client's output handler is a staticmethod: patched and restored as one."""
    from vllm_semmoe.vllm_adapter.patches.dp_client import PROCESS_ENGINE_OUTPUTS as patch

    was = patch.installed
    patch.remove()
    original = _own(patch)
    try:
        patch.install()
        assert isinstance(_own(patch), staticmethod) and isinstance(original, staticmethod)
        assert getattr(_own(patch).__func__, MARKER) is patch
        patch.remove()
        assert _own(patch) is original
    finally:
        if was:
            patch.install()


# ---- the CPU fixes' guard, on throw-away classes -------------------------------------------------
@pytest.fixture()
def fake_fixes(monkeypatch: pytest.MonkeyPatch):
    """CPU-fix patches pointed at throw-away classes, to test the guard without touching vLLM."""
    from vllm_semmoe.vllm_adapter.patches import communicator, fused_moe

    def orig_apply(self, *args):
        return "orig"

    def not_implemented(self, *args, **kwargs):
        raise NotImplementedError

    moe = types.ModuleType("semmoe_fake_cpu_moe")
    moe.Experts = type("Experts", (), {"apply": orig_apply})
    comm = types.ModuleType("semmoe_fake_comm")
    comm.Comm = type("Comm", (), {"all_gatherv": not_implemented, "reduce_scatterv": not_implemented})
    monkeypatch.setitem(sys.modules, moe.__name__, moe)
    monkeypatch.setitem(sys.modules, comm.__name__, comm)

    def fake(real: Patch, owner: str) -> Patch:
        return Patch(real.internal, real.why, real.make, owner=owner, attribute=real.attribute)

    fixes = {"expert_map": fake(fused_moe.EXPERT_MAP_APPLY, f"{moe.__name__}:Experts"),
             "all_gatherv": fake(communicator.ALL_GATHERV, f"{comm.__name__}:Comm"),
             "reduce_scatterv": fake(communicator.REDUCE_SCATTERV, f"{comm.__name__}:Comm")}
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    cpu_fixes.logger.addHandler(handler)
    old_level = cpu_fixes.logger.level
    cpu_fixes.logger.setLevel(logging.DEBUG)
    yield types.SimpleNamespace(fixes=fixes, moe=moe, comm=comm, records=records, orig_apply=orig_apply,
                                gatherv=communicator.cpu_all_gatherv, scatterv=communicator.cpu_reduce_scatterv)
    cpu_fixes.logger.removeHandler(handler)
    cpu_fixes.logger.setLevel(old_level)


def test_cpu_guard_patches_only_cpu_032(fake_fixes) -> None:
    """0.32.x on CPU patches; another version or another platform leaves the targets alone."""
    f = fake_fixes
    cpu_fixes.apply_cpu_fixes("0.33.0", on_cpu=True, fixes=f.fixes)
    assert f.moe.Experts.__dict__["apply"] is f.orig_apply
    assert installed_patch(f.comm.Comm.__dict__["all_gatherv"]) is None
    assert any("not applied on vLLM 0.33.0" in r.getMessage() for r in f.records)

    cpu_fixes.apply_cpu_fixes("0.32.3+cpu", on_cpu=False, fixes=f.fixes)
    assert f.moe.Experts.__dict__["apply"] is f.orig_apply

    cpu_fixes.apply_cpu_fixes("0.32.3+cpu", on_cpu=True, fixes=f.fixes)
    assert f.moe.Experts.__dict__["apply"].__semmoe_original__ is f.orig_apply
    assert f.comm.Comm.__dict__["all_gatherv"] is f.gatherv
    assert f.comm.Comm.__dict__["reduce_scatterv"] is f.scatterv
    wrapped = f.moe.Experts.__dict__["apply"]
    cpu_fixes.apply_cpu_fixes("0.32.3+cpu", on_cpu=True, fixes=f.fixes)  # again: nothing re-wrapped
    assert f.moe.Experts.__dict__["apply"] is wrapped
    for patch in f.fixes.values():
        patch.remove()
    assert f.moe.Experts.__dict__["apply"] is f.orig_apply


def test_cpu_guard_missing_target(fake_fixes) -> None:
    """A missing target: a warning naming it on other versions, a RuntimeError on 0.32."""
    f = fake_fixes
    del f.comm.Comm.reduce_scatterv
    cpu_fixes.apply_cpu_fixes("0.40.1", on_cpu=True, fixes=f.fixes)  # must not raise
    warnings = [r.getMessage() for r in f.records if r.levelno == logging.WARNING]
    assert any("semmoe_fake_comm.Comm.reduce_scatterv" in w for w in warnings), warnings
    assert f.moe.Experts.__dict__["apply"] is f.orig_apply

    with pytest.raises(RuntimeError, match=r"semmoe_fake_comm\.Comm\.reduce_scatterv"):
        cpu_fixes.apply_cpu_fixes("0.32.0", on_cpu=True, fixes=f.fixes)
    assert f.moe.Experts.__dict__["apply"] is f.orig_apply  # nothing installed when one is missing

    gone = dict(f.fixes, expert_map=Patch(f.fixes["expert_map"].internal, "a fix of a module that is gone",
                                          f.fixes["expert_map"].make, owner="semmoe_no_such_module:X",
                                          attribute="apply"))
    with pytest.raises(RuntimeError, match="semmoe_no_such_module"):
        cpu_fixes.apply_cpu_fixes("0.32.0", on_cpu=True, fixes=gone)


# ---- DP + EP: the stages are vLLM's stage class ------------------------------------------------
def test_sparse_and_metered_stages_are_vllms_allgather_stage() -> None:
    from vllm_semmoe.vllm_adapter.patches.prepare_finalize import MeteredPrepareAndFinalize, SparsePrepareAndFinalize

    base = compat.allgather_stage_class()
    stage = base(is_sequence_parallel=True, num_dispatchers=3)
    for cls in (SparsePrepareAndFinalize, MeteredPrepareAndFinalize):
        replacement = cls(stage, dict)
        assert isinstance(replacement, base) and not compat.is_allgather_stage(replacement)
        assert replacement.is_sequence_parallel and replacement.num_dispatchers() == 3
        assert replacement.activation_format == stage.activation_format
        assert replacement.output_is_reduced() == stage.output_is_reduced()
