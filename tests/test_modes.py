"""The engine modes as objects: each mode's layout rules, default dispatch, replica rule and
installed pieces live in :mod:`vllm_semmoe.core.modes`, and policies declare whether they schedule
data. No vLLM needed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from vllm_semmoe.core.modes import (DP_ROUTER, ENGINE_MODES, MODES, PLACEMENT, RECORDER, TP_SHUFFLE, Layout, Mode,
                               ModeError, ServingMode, engine_mode)

REPO = Path(__file__).resolve().parents[1]


def test_modes_are_looked_up_by_name_and_compare_as_their_names():
    assert ENGINE_MODES == ("placement-only", "tp", "dp") and MODES == ("tp", "dp")
    assert [engine_mode(name) for name in ENGINE_MODES] == list(Mode)
    assert engine_mode(ServingMode.DP) is Mode.DP and engine_mode(Mode.TP) is Mode.TP
    assert Mode.TP == ServingMode.TP == "tp" and f"{Mode.PLACEMENT_ONLY}" == "placement-only"
    assert repr(Mode.DP) == "'dp'"
    with pytest.raises(ValueError, match=r"^mode must be one of placement-only, tp, dp, got 'ep'$"):
        engine_mode("ep")


def test_each_mode_declares_what_it_schedules_and_installs():
    assert Mode.PLACEMENT_ONLY.serving is None and not Mode.PLACEMENT_ONLY.schedules_data
    assert Mode.TP.serving is ServingMode.TP and Mode.DP.serving is ServingMode.DP
    assert Mode.PLACEMENT_ONLY.installs == (PLACEMENT,)
    assert set(Mode.TP.installs) == {PLACEMENT, RECORDER, TP_SHUFFLE}
    assert set(Mode.DP.installs) == {PLACEMENT, RECORDER, DP_ROUTER}


# (mode, layout, requested dispatch) -> None (served) or a fragment of the refusal
LAYOUTS = [
    (Mode.PLACEMENT_ONLY, Layout(), None, None),
    (Mode.PLACEMENT_ONLY, Layout(tp=2, dp=2, ep=True), None, None),
    (Mode.TP, Layout(tp=2, ep=True), None, None),
    (Mode.TP, Layout(tp=2, dp=2, ep=True), None, r"mode 'tp' with data parallelism \(TP 2 x DP 2 \+ EP\)"),
    (Mode.TP, Layout(tp=2), None, r"^semmoe mode 'tp' shuffles tokens over tensor-parallel ranks: add "
                                  r"--tensor-parallel-size N \(N >= 2\) and --enable-expert-parallel, or use "
                                  r"--mode placement-only \(running DP 1, TP 2, expert parallelism off\)$"),
    (Mode.DP, Layout(dp=2, ep=True), None, None),
    (Mode.DP, Layout(tp=2, dp=2, ep=True), None, None),
    (Mode.DP, Layout(tp=4, ep=True), None, r"^semmoe mode 'dp' routes requests over data-parallel ranks: add "
                                           r"--data-parallel-size N \(N >= 2\) and --enable-expert-parallel"),
    (Mode.DP, Layout(dp=2, ep=True), "sparse", None),
    (Mode.PLACEMENT_ONLY, Layout(tp=2, dp=2, ep=True), "sparse",
     r"dispatch 'sparse' exchanges tokens between data-parallel ranks: it needs .* \(running DP 2, TP 2"),
    (Mode.DP, Layout(dp=2, ep=True, pp=2), None, r"pipeline parallelism \(pipeline_parallel_size=2\)"),
    (Mode.PLACEMENT_ONLY, Layout(dcp=2), None, r"context parallelism \(decode_context_parallel_size=2\)"),
]


@pytest.mark.parametrize("mode, layout, dispatch, refusal", LAYOUTS)
def test_each_mode_refuses_the_layouts_it_cannot_serve(mode, layout, dispatch, refusal):
    if refusal is None:
        mode.check_layout(layout, dispatch)
    else:
        with pytest.raises(ModeError, match=refusal):
            mode.check_layout(layout, dispatch)


def test_dispatch_default_is_the_modes():
    dp_ep = Layout(dp=2, ep=True)
    assert Mode.DP.dispatch(dp_ep) == "sparse"
    assert Mode.DP.dispatch(Layout(dp=2, tp=2, ep=True)) == "vllm"
    assert Mode.PLACEMENT_ONLY.dispatch(dp_ep) == "vllm" and Mode.TP.dispatch(dp_ep) == "vllm"
    assert Mode.PLACEMENT_ONLY.dispatch(dp_ep, "sparse") == "sparse" and Mode.DP.dispatch(dp_ep, "vllm") == "vllm"
    assert Mode.DP.dispatch(Layout(dp=2), "sparse") is None  # no expert parallelism: no DP + EP dispatch
    assert Mode.DP.dispatch(Layout(tp=2, ep=True)) is None
    assert Mode.DP.layout_warning(Layout(dp=2, tp=2, ep=True), "vllm").startswith("semmoe: mode 'dp' with vLLM's own")
    assert Mode.DP.layout_warning(dp_ep, "sparse") is None and Mode.TP.layout_warning(dp_ep, "vllm") is None


def test_replicas_serve_where_the_mode_routes_each_token_once():
    assert Mode.PLACEMENT_ONLY.replica_device(Layout(tp=2, ep=True), 0, 1) is None  # no replicas: home copies
    assert Mode.PLACEMENT_ONLY.replica_device(Layout(dp=2, ep=True), 1, 1) == 1
    assert Mode.TP.replica_device(Layout(tp=2, ep=True), 1, 0) == 0  # only the shuffle serves them under TP
    with pytest.raises(ModeError, match=r"running DP 1, TP 2, mode 'placement-only'"):
        Mode.PLACEMENT_ONLY.replica_device(Layout(tp=2, ep=True), 1, 0)
    with pytest.raises(ModeError, match=r"remove --enable-eplb"):
        Mode.DP.replica_device(Layout(dp=2, ep=True, eplb=True), 2, 0)


def test_tables_must_fit_a_data_scheduling_mode():
    Mode.PLACEMENT_ONLY.check_tables_mode(ServingMode.DP, "/t")
    Mode.DP.check_tables_mode(ServingMode.DP, "/t")
    with pytest.raises(ModeError, match=r"tables /t were solved for mode 'tp', the engine runs mode 'dp': "
                                        r"re-solve with `semmoe solve --mode dp` or serve with --mode tp"):
        Mode.DP.check_tables_mode(ServingMode.TP, "/t")
    assert not Mode.PLACEMENT_ONLY.checks_tables_ep(1)  # one device: tables of any EP size
    assert Mode.PLACEMENT_ONLY.checks_tables_ep(2) and Mode.TP.checks_tables_ep(1)


def test_the_plugin_config_holds_a_mode_and_refuses_as_its_own_error():
    from vllm_semmoe.vllm_adapter.config import SemMoEConfig, SemMoEConfigError

    assert SemMoEConfig(tables="/t", mode="dp").mode is Mode.DP
    assert SemMoEConfig().mode is Mode.PLACEMENT_ONLY and not SemMoEConfig().records
    assert SemMoEConfig(tables="/t", mode="tp").records  # a data-scheduling mode meters live LAR
    with pytest.raises(SemMoEConfigError, match=r"^semmoe mode must be one of placement-only, tp, dp, got 'ep'$"):
        SemMoEConfig(mode="ep")


def test_only_semmoe_schedules_data():
    from vllm_semmoe.core.policy import POLICIES

    assert {name for name, policy in POLICIES.items() if policy.schedules_data} == {"semmoe"}


def test_modes_module_imports_nothing_of_the_project_or_vllm():
    tree = ast.parse((REPO / "vllm_semmoe" / "core" / "modes.py").read_text(encoding="utf-8"))
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] if node.module and not node.level else "." for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "dataclasses", "enum"}, imported
