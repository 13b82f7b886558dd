"""The vLLM plugin on the shipped tiny MoE: configuration errors, capture, lossless re-placement."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from vllm_semmoe.assets import tiny_moe_path
from vllm_semmoe.policy import get_policy
from vllm_semmoe.prompts import load_prompts
from vllm_semmoe.tables import build_tables, load_tables
from vllm_semmoe.trace import load_trace
from vllm_semmoe.vllm_adapter.config import SemMoEConfig, SemMoEConfigError
from vllm_semmoe.vllm_adapter.engine import run_prompts
from shared_fixtures import DATA_DIR

MAX_TOKENS = 12
DTYPE = os.environ.get("SEMMOE_TEST_DTYPE", "float32")


@pytest.fixture(scope="module")
def prompts():
    return load_prompts(str(DATA_DIR / "text" / "sharegpt_4k.jsonl.gz"), 6, skip=3000)


@pytest.fixture(scope="module")
def baseline(prompts, tmp_path_factory):
    """Plugin only capturing (no placement): reference tokens and logical routing."""
    out = tmp_path_factory.mktemp("base") / "trace.npz"
    tokens, summary = run_prompts(tiny_moe_path(), prompts, max_tokens=MAX_TOKENS, semmoe={"capture": str(out)}, dtype=DTYPE)
    return tokens, load_trace(out), summary


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


def test_placement_is_lossless_in_process(baseline, prompts, tmp_path):
    tokens, trace, _ = baseline
    placement = get_policy("semmoe").solve(trace, 8)
    assert not np.array_equal(placement.physical_to_logical(), np.tile(np.arange(32), (4, 1)))
    build_tables(trace, placement).save(tmp_path / "tables")
    capture = tmp_path / "placed.npz"
    placed_tokens, summary = run_prompts(
        tiny_moe_path(), prompts, max_tokens=MAX_TOKENS, dtype=DTYPE,
        semmoe={"tables": str(tmp_path / "tables"), "capture": str(capture)},
    )
    assert placed_tokens == tokens
    placed = load_trace(capture)
    np.testing.assert_array_equal(placed.tokens, trace.tokens)
    # physical ids captured under the placement map back to the plugin-off logical ids
    np.testing.assert_array_equal(placed.experts, trace.experts)
    assert "replayed" in summary and 0.0 <= summary["replayed"]["lar"] <= 1.0


def test_placement_is_lossless_multi_process(baseline, prompts, tmp_path):
    tokens, trace, _ = baseline
    placement = get_policy("eplb").solve(trace, 4)
    build_tables(trace, placement).save(tmp_path / "tables")
    script = (
        "import json, sys\n"
        "from vllm_semmoe.vllm_adapter.engine import run_prompts\n"
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
    assert json.loads(line[len("TOKENS="):]) == tokens


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
