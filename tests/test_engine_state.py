"""One Sem-MoE state per engine: engines created one after another in one process start clean
and are freed when dropped; layouts a mode cannot serve are refused at start."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_semmoe.assets import tiny_moe_path
from vllm_semmoe.vllm_adapter.config import SemMoEConfig, SemMoEConfigError
from vllm_semmoe.testing.processes import fresh_cache_root

REPO = Path(__file__).resolve().parents[1]

SEQUENTIAL_SCRIPT = r"""
import gc, json, sys, weakref

def main():
    cfg = json.loads(sys.argv[1])
    from vllm_semmoe.tools.engine import fit_prompts, flush, generate, make_llm
    from vllm_semmoe.vllm_adapter import state as state_module
    out = {"runs": []}
    refs = []
    for run in range(2):
        llm = make_llm(cfg["model"], {"capture": cfg["capture"] + f".{run}.npz"}, max_model_len=256)
        generate(llm, fit_prompts(llm, cfg["prompts"], 256, 6), 6)
        states = {id(s): s for s in list(state_module._BY_OWNER.values())}
        refs.extend(weakref.ref(s) for s in states.values())
        summary = flush(llm)
        out["runs"].append({"live_states": len(states), "steps": summary["steps"],
                            "recorded_steps": [s.recorder.num_steps for s in states.values()]})
        del states, llm
        gc.collect()
        out["runs"][-1]["after_drop"] = state_module.live_states()
    out["alive_refs"] = sum(r() is not None for r in refs)
    print("RESULT=" + json.dumps(out))

if __name__ == "__main__":
    main()
"""


def test_engines_one_after_another_start_clean_and_are_freed(tmp_path: Path) -> None:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CACHE_ROOT=fresh_cache_root(tmp_path / "vc"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("VLLM_PLUGINS", None)
    cfg = {"model": str(tiny_moe_path()), "capture": str(tmp_path / "cap"),
           "prompts": ["The history of the city", "The game was released on"]}
    run = subprocess.run([sys.executable, "-c", SEQUENTIAL_SCRIPT, json.dumps(cfg)], capture_output=True,
                         text=True, env=env, timeout=600)
    line = next((l for l in run.stdout.splitlines() if l.startswith("RESULT=")), None)
    assert run.returncode == 0 and line, run.stdout[-2000:] + run.stderr[-4000:]
    out = json.loads(line[len("RESULT="):])
    first, second = out["runs"]
    # each engine has exactly one state while it runs, recording only its own steps
    assert first["live_states"] == second["live_states"] == 1
    assert first["steps"] == second["steps"] == first["recorded_steps"][0] == second["recorded_steps"][0] > 0
    # dropping the engine frees its state (nothing keeps runners, models or recorders alive)
    assert first["after_drop"] == second["after_drop"] == 0
    assert out["alive_refs"] == 0


def _vllm_config(tp=1, dp=1, pp=1, ep=True, graphs="NONE", eager=False):
    parallel = SimpleNamespace(tensor_parallel_size=tp, data_parallel_size=dp, pipeline_parallel_size=pp,
                               enable_expert_parallel=ep, data_parallel_rank=0, prefill_context_parallel_size=1,
                               decode_context_parallel_size=1)
    compilation = SimpleNamespace(mode=2, cudagraph_mode=SimpleNamespace(name=graphs), splitting_ops=[])
    return SimpleNamespace(parallel_config=parallel, compilation_config=compilation,
                           model_config=SimpleNamespace(enforce_eager=eager))


@pytest.fixture()
def configs(tmp_path):
    (tmp_path / "tables").mkdir()
    def make(**kw):
        return SemMoEConfig.from_additional_config({"semmoe": {"tables": str(tmp_path / "tables"), **kw}})

    return SimpleNamespace(tp=make(mode="tp"), dp=make(mode="dp"), placement=make(),
                           capture=SemMoEConfig.from_additional_config({"semmoe": {"capture": str(tmp_path / "c.npz")}}))


def test_layouts_a_mode_cannot_serve_are_refused(configs, caplog) -> None:
    from vllm_semmoe.vllm_adapter.checks import check_layout

    with pytest.raises(SemMoEConfigError, match=r"mode 'tp' with data parallelism \(TP 2 x DP 2 \+ EP\)"):
        check_layout(configs.tp, _vllm_config(tp=2, dp=2))
    for config in (configs.tp, configs.dp, configs.placement, configs.capture):
        with pytest.raises(SemMoEConfigError, match=r"pipeline parallelism \(pipeline_parallel_size=2\)"):
            check_layout(config, _vllm_config(tp=2, pp=2))
    # supported layouts pass; mode dp on vLLM's own dispatch (TP 2) with a warning
    check_layout(configs.tp, _vllm_config(tp=2, dp=1))
    check_layout(configs.placement, _vllm_config(tp=2, dp=2))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.semmoe"):
        check_layout(configs.dp, _vllm_config(tp=2, dp=2))
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and warnings[0].startswith("semmoe: mode 'dp' with vLLM's own MoE dispatch"), warnings


def test_full_cuda_graphs_are_refused_and_piecewise_graphs_split_at_the_ops(configs) -> None:
    from vllm_semmoe.vllm_adapter.ops import SPLITTING_OPS
    from vllm_semmoe.vllm_adapter.checks import check_compilation

    with pytest.raises(SemMoEConfigError, match=r"full CUDA graphs \(cudagraph_mode=FULL_AND_PIECEWISE\)"):
        check_compilation(configs.capture, _vllm_config(graphs="FULL_AND_PIECEWISE"))
    piecewise = _vllm_config(graphs="PIECEWISE")
    check_compilation(configs.tp, piecewise)
    assert set(SPLITTING_OPS) | {"vllm::moe_forward"} <= set(piecewise.compilation_config.splitting_ops)
    # placement only runs nothing per step: any graph mode serves it; eager needs nothing
    check_compilation(configs.placement, _vllm_config(graphs="FULL_AND_PIECEWISE"))
    check_compilation(configs.capture, _vllm_config(graphs="FULL", eager=True))


def test_engine_and_api_server_states_have_real_types() -> None:
    """Every field of the two states names a real type (no ``Any``, no tuple read by position)."""
    import dataclasses
    import typing
    import weakref

    import numpy as np
    import torch

    from vllm_semmoe.core.modes import Layout
    from vllm_semmoe.core.tables import SemMoETables
    from vllm_semmoe.vllm_adapter import state
    from vllm_semmoe.vllm_adapter.capture import RoutingRecorder
    from vllm_semmoe.vllm_adapter.dp_routing import DpRouter
    from vllm_semmoe.vllm_adapter.ep_dispatch import CollectiveMeter
    from vllm_semmoe.vllm_adapter.metrics import EngineMetrics
    from vllm_semmoe.vllm_adapter.tp_shuffle import StepContext, TpShuffleLayer

    names = dict(vars(state), torch=torch, weakref=weakref, np=np, Layout=Layout, SemMoETables=SemMoETables,
                 SemMoEConfig=SemMoEConfig, RoutingRecorder=RoutingRecorder, DpRouter=DpRouter,
                 CollectiveMeter=CollectiveMeter, EngineMetrics=EngineMetrics, StepContext=StepContext,
                 TpShuffleLayer=TpShuffleLayer)
    for cls in (state.EngineState, state.ApiServerState):
        hints = typing.get_type_hints(cls, globalns=names)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            assert hint is not typing.Any and typing.get_origin(hint) is not tuple, (cls.__name__, f.name, hint)
    assert typing.get_type_hints(state.EngineState, globalns=names)["layout"] is Layout
    assert {f.name for f in dataclasses.fields(state.ApiServerState)} == {"config", "tables", "dp_router"}


def _dp_tables(directory: Path) -> None:
    from vllm_semmoe.core.policy import get_policy
    from vllm_semmoe.core.synthetic import synthetic_trace
    from vllm_semmoe.core.tables import build_tables

    trace = synthetic_trace(num_layers=2, num_experts=8, top_k=2, vocab_size=256, num_requests=12)
    build_tables(trace, get_policy("semmoe").solve(trace, 2, mode="dp"), mode="dp").save(directory)


class _Client:
    """Stands for vLLM's DP client, which the state registry keys weakly."""


def test_api_server_state_reads_tables_through_the_config(tmp_path: Path) -> None:
    """The API server's state holds the config, the tables and the DP router; its tables are read
    by :meth:`SemMoEConfig.read_tables`, so a damaged directory is refused as the engine refuses it."""
    from vllm_semmoe.vllm_adapter.plugin import make_api_server_state
    from vllm_semmoe.vllm_adapter.state import api_server_state

    def vllm_config(semmoe):
        return SimpleNamespace(additional_config={"semmoe": semmoe} if semmoe else {},
                               parallel_config=SimpleNamespace(data_parallel_size=2))

    assert make_api_server_state(vllm_config(None), [0, 1]) is None  # not configured
    (tmp_path / "t").mkdir()
    assert make_api_server_state(vllm_config({"tables": str(tmp_path / "t")}), [0, 1]) is None  # not dp mode
    with pytest.raises(SemMoEConfigError, match=r"^semmoe: .*no manifest\.json"):
        make_api_server_state(vllm_config({"tables": str(tmp_path / "t"), "mode": "dp"}), [0, 1])
    _dp_tables(tmp_path / "t")
    state = make_api_server_state(vllm_config({"tables": str(tmp_path / "t"), "mode": "dp"}), [0, 1])
    assert state.config.mode == "dp" and state.dp_router.num_ranks == 2
    one_node = make_api_server_state(vllm_config({"tables": str(tmp_path / "t"), "mode": "dp"}), [1])
    assert one_node.dp_router.ranks.tolist() == [1] and one_node.dp_router.scheduler.ranks_per_dp == 1
    assert state.dp_router.tables is state.tables and state.tables.mode == "dp"
    # made once per DP client, by its first caller; a client Sem-MoE does not route keeps None
    client, plain = _Client(), _Client()
    made = []
    assert api_server_state(client) is None
    assert api_server_state(client, lambda: made.append(1) or state) is state
    assert api_server_state(client, lambda: made.append(1) or None) is state and made == [1]
    assert api_server_state(plain, lambda: None) is None and api_server_state(plain, lambda: state) is None


def test_api_server_state_is_made_and_warmed_when_the_client_is_built(tmp_path: Path) -> None:
    """The plugin's ``DPLBAsyncMPClient.__init__`` hook builds the API server's state right after
    vLLM's own constructor, so the first request pays neither the tables nor the router's
    compilation; the warm-up decides nothing (no request counted, prices unchanged); tables the
    router cannot use stop the constructor."""
    from vllm_semmoe.vllm_adapter.patches.dp_client import _init
    from vllm_semmoe.vllm_adapter.state import api_server_state

    _dp_tables(tmp_path / "t")

    def construct(semmoe):
        def original(self, vllm_config):
            self.vllm_config, self.engine_ranks_managed = vllm_config, [0, 1]

        client = _Client()
        _init(original)(client, SimpleNamespace(additional_config={"semmoe": semmoe},
                                                parallel_config=SimpleNamespace(data_parallel_size=2)))
        return client

    client = construct({"tables": str(tmp_path / "t"), "mode": "dp"})
    state = api_server_state(client)  # no builder: made already
    assert state is not None and state.dp_router.num_ranks == 2
    assert state.dp_router.requests.tolist() == [0, 0] and not state.dp_router.in_flight
    assert state.dp_router.price.tolist() == [0.0, 0.0]
    assert api_server_state(construct({"tables": str(tmp_path / "t")})) is None  # not dp mode
    (tmp_path / "empty").mkdir()
    with pytest.raises(SemMoEConfigError, match="no manifest"):
        construct({"tables": str(tmp_path / "empty"), "mode": "dp"})
