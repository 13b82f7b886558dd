"""The vLLM plugin on the shipped tiny MoE: configuration errors, capture, lossless re-placement.

Exactness is shown against vLLM with the plugin not loaded (``VLLM_PLUGINS=""``,
:mod:`vllm_semmoe.testing.plugin_free`): its greedy tokens, and the logical routing its routers
chose for every token, read by the test's own hooks.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from vllm_semmoe.assets import tiny_moe_path
from vllm_semmoe.core.policy import get_policy
from vllm_semmoe.tools.prompts import load_prompts
from vllm_semmoe.core.tables import build_tables, load_tables
from vllm_semmoe.testing.plugin_free import plugin_free_runs
from vllm_semmoe.core.capture_store import load_trace
from vllm_semmoe.vllm_adapter.config import SemMoEConfig, SemMoEConfigError
from vllm_semmoe.tools.engine import run_prompts
from shared_fixtures import DATA_DIR

MAX_TOKENS = 12
DTYPE = os.environ.get("SEMMOE_TEST_DTYPE", "float32")


@pytest.fixture(scope="module")
def prompts():
    return load_prompts(str(DATA_DIR / "text" / "sharegpt_4k.jsonl.gz"), 6, skip=3000)


@pytest.fixture(scope="module")
def plugin_free(prompts, tmp_path_factory):
    """The prompts through vLLM with the plugin not loaded: greedy tokens and logical routing."""
    return plugin_free_runs({"batched": {"model": tiny_moe_path(), "prompts": prompts, "max_tokens": MAX_TOKENS,
                                         "max_model_len": 512, "dtype": DTYPE}},
                            tmp_path_factory.mktemp("plugin_free"))["batched"]


@pytest.fixture(scope="module")
def baseline(prompts, tmp_path_factory):
    """Plugin only capturing (no placement): tokens, logical routing (requests in id order), summary."""
    out = tmp_path_factory.mktemp("base") / "trace.npz"
    tokens, summary = run_prompts(tiny_moe_path(), prompts, max_tokens=MAX_TOKENS, semmoe={"capture": str(out)}, dtype=DTYPE)
    return tokens, by_request_id(load_trace(out)), summary


def by_request_id(trace):
    """The trace's requests in request-id order (a capture numbers them by first appearance)."""
    return trace.select_requests(np.argsort(trace.request_ids, kind="stable"))


def assert_same_routing(got, want, what: str) -> None:
    """Same tokens, same logical experts for every token and MoE layer."""
    np.testing.assert_array_equal(got.offsets, want.offsets)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.is_decode, want.is_decode)
    differ = (got.experts != want.experts).any(axis=2)  # [T, L]
    assert not differ.any(), (f"{what}: logical routing differs for {int(differ.any(axis=1).sum())} of "
                              f"{len(differ)} tokens (per MoE layer: {differ.sum(axis=0).tolist()})")


def test_capture_only_changes_nothing(baseline, plugin_free):
    """The plugin loaded and capturing (no tables) serves what vLLM without it serves, and its
    capture holds the logical experts vLLM's routers chose for every token."""
    tokens, trace, _ = baseline
    assert tokens == plugin_free.outputs
    assert_same_routing(trace, plugin_free.trace, "capture only")


def test_capture_writes_a_valid_trace(baseline, prompts):
    tokens, trace, summary = baseline
    assert trace.num_requests == len(prompts)
    assert trace.num_layers == 4 and trace.num_experts == 32 and trace.top_k == 4
    assert len(trace.vocab) == trace.vocab_size
    # every prompt token is captured once, plus every generated token that was fed back
    decode = trace.is_decode.reshape(-1)
    assert decode.sum() == sum(len(t) - 1 for t in tokens)
    for r in range(trace.num_requests):
        rows = slice(trace.offsets[r], trace.offsets[r + 1])
        generated = trace.tokens[rows][trace.is_decode[rows]]
        assert list(generated) == tokens[r][:-1]
    assert summary["steps"] > 0


def test_placement_is_lossless_in_process(baseline, plugin_free, prompts, tmp_path):
    _, trace, _ = baseline
    placement = get_policy("semmoe").solve(trace, 8)
    assert not np.array_equal(placement.physical_to_logical(), np.tile(np.arange(32), (4, 1)))
    build_tables(trace, placement).save(tmp_path / "tables")
    capture = tmp_path / "placed.npz"
    placed_tokens, summary = run_prompts(
        tiny_moe_path(), prompts, max_tokens=MAX_TOKENS, dtype=DTYPE,
        semmoe={"tables": str(tmp_path / "tables"), "capture": str(capture)},
    )
    assert placed_tokens == plugin_free.outputs
    # physical ids captured under the placement map back to the logical ids vLLM chose without the plugin
    assert_same_routing(by_request_id(load_trace(capture)), plugin_free.trace, "placement-only EP 8")
    assert "replayed" in summary and 0.0 <= summary["replayed"]["lar"] <= 1.0


def test_placement_is_lossless_multi_process(baseline, plugin_free, prompts, tmp_path):
    _, trace, _ = baseline
    placement = get_policy("eplb").solve(trace, 4)
    build_tables(trace, placement).save(tmp_path / "tables")
    script = (
        "import json, sys\n"
        "from vllm_semmoe.tools.engine import run_prompts\n"
        "if __name__ == '__main__':\n"
        "    prompts = json.loads(sys.argv[1])\n"
        f"    out, _ = run_prompts({tiny_moe_path()!r}, prompts, max_tokens={MAX_TOKENS}, in_process=False, dtype={DTYPE!r},\n"
        f"                         semmoe={{'tables': {str(tmp_path / 'tables')!r}}})\n"
        "    print('TOKENS=' + json.dumps(out))\n"
    )
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    result = subprocess.run([sys.executable, "-c", script, json.dumps(prompts)], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(l for l in result.stdout.splitlines() if l.startswith("TOKENS="))
    assert json.loads(line[len("TOKENS="):]) == plugin_free.outputs


def test_config_validation():
    assert SemMoEConfig.from_additional_config({}) is None
    with pytest.raises(SemMoEConfigError, match=r"unknown key\(s\) 'tabels'.*valid keys: tables, capture, mode"):
        SemMoEConfig.from_additional_config({"semmoe": {"tabels": "x"}})
    with pytest.raises(SemMoEConfigError, match="tables directory not found: /nope"):
        SemMoEConfig.from_additional_config({"semmoe": {"tables": "/nope"}})
    with pytest.raises(SemMoEConfigError, match="mode must be one of"):
        SemMoEConfig.from_additional_config({"semmoe": {"capture": "/tmp/x.npz", "mode": "ep"}})
    with pytest.raises(SemMoEConfigError, match="needs 'tables'"):
        SemMoEConfig.from_additional_config({"semmoe": {"mode": "tp", "capture": "/tmp/x.npz"}})
    with pytest.raises(SemMoEConfigError, match="dispatch must be one of vllm, sparse, got 'all2all'"):
        SemMoEConfig.from_additional_config({"semmoe": {"dispatch": "all2all"}})


def test_dispatch_defaults_to_sparse_only_in_dp_mode_with_tp1():
    from types import SimpleNamespace

    layout = lambda dp, tp, ep: SimpleNamespace(data_parallel_size=dp, tensor_parallel_size=tp,  # noqa: E731
                                                enable_expert_parallel=ep)
    config = lambda **kw: SemMoEConfig.from_additional_config({"semmoe": {"capture": "/tmp/x.npz", **kw}})  # noqa: E731
    assert config().resolved_dispatch(layout(2, 1, True)) == "vllm"  # stock dispatch, metered
    assert config(dispatch="sparse").resolved_dispatch(layout(2, 1, True)) == "sparse"
    assert config(dispatch="sparse").resolved_dispatch(layout(1, 2, True)) is None  # no DP dispatch at all
    assert config().resolved_dispatch(layout(2, 1, False)) is None
    dp_mode = SemMoEConfig(tables="/t", mode="dp")
    assert dp_mode.resolved_dispatch(layout(2, 1, True)) == "sparse"
    assert dp_mode.resolved_dispatch(layout(2, 2, True)) == "vllm"


def test_engine_refuses_tables_of_another_model(dev_trace, tmp_path, prompts):
    small = dev_trace.select_requests(np.arange(20))
    build_tables(small, get_policy("vanilla").solve(small, 8)).save(tmp_path / "dsv2")
    with pytest.raises(SemMoEConfigError, match=r"experts per layer 64 \(model has 32\)"):
        run_prompts(tiny_moe_path(), prompts[:1], max_tokens=2, semmoe={"tables": str(tmp_path / "dsv2")})


def test_tables_for_another_ep_size_need_placement_only(baseline, tmp_path, prompts):
    _, trace, _ = baseline
    build_tables(trace, get_policy("vanilla").solve(trace, 8)).save(tmp_path / "ep8")
    assert load_tables(tmp_path / "ep8").ep_size == 8
    # mode tp on one device is refused for the mode first (the EP-size refusal: tests/test_errors.py)
    with pytest.raises(SemMoEConfigError, match=r"mode 'tp' shuffles tokens over tensor-parallel ranks: add "
                                                r"--tensor-parallel-size N \(N >= 2\) and --enable-expert-parallel"):
        run_prompts(tiny_moe_path(), prompts[:1], max_tokens=2, semmoe={"tables": str(tmp_path / "ep8"), "mode": "tp"})
