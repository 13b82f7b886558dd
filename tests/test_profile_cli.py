"""``semmoe profile`` hands vLLM engine arguments through to the engine, as ``semmoe serve`` does."""

import pytest

from vllm_semmoe.cli import main
from vllm_semmoe.core.capture_store import load_trace
from shared_fixtures import DATA_DIR

pytest.importorskip("vllm")


def test_engine_args_parsed_by_vllm():
    from vllm_semmoe.cli.serving import profile_engine_args

    got = profile_engine_args(["--dtype", "float32", "-tp", "2", "--data-parallel-size", "2",
                               "--enable-expert-parallel", "--trust-remote-code"])
    assert got == {"dtype": "float32", "tensor_parallel_size": 2, "data_parallel_size": 2,
                   "enable_expert_parallel": True, "trust_remote_code": True}
    assert profile_engine_args([]) == {}
    with pytest.raises(SystemExit):  # not an engine argument: refused, as by `vllm serve`
        profile_engine_args(["--no-such-option", "1"])


def test_profile_with_dtype_runs(tmp_path, capsys):
    out = tmp_path / "trace.npz"
    rc = main(["profile", "--dataset", str(DATA_DIR / "text" / "sharegpt_4k.jsonl.gz"), "--num-prompts", "2",
               "--skip", "3000", "--max-tokens", "2", "--max-model-len", "256", "--out", str(out),
               "--dtype", "float32", "--seed", "1"])
    assert rc == 0
    trace = load_trace(out)
    assert trace.num_requests == 2 and trace.num_layers == 4
