"""The shipped tiny Qwen3-MoE checkpoint: its shape, its tokenizer, and vLLM serving it.

The vLLM test runs the engine in-process (no worker processes, eager mode, 1 GiB KV cache)
and takes about 15-25 s on a 2-core CPU machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_semmoe.assets import tiny_moe_path
from vllm_semmoe.testing.processes import fresh_cache_root

MAX_CHECKPOINT_BYTES = 20 * 1024 * 1024


@pytest.fixture(scope="module")
def model_dir() -> Path:
    """The checkpoint directory (fails clearly if it has not been trained)."""
    return Path(tiny_moe_path())


@pytest.fixture(scope="module")
def config(model_dir: Path) -> dict:
    """The checkpoint's raw config.json."""
    return json.loads((model_dir / "config.json").read_text())


def test_config_shape(config: dict) -> None:
    """Qwen3-MoE, >= 4 layers all MoE, >= 32 routed experts, top-k >= 2, Qwen3 routing."""
    assert config["model_type"] == "qwen3_moe"
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    n_layers = config["num_hidden_layers"]
    assert n_layers >= 4
    assert config.get("decoder_sparse_step", 1) == 1
    assert not config.get("mlp_only_layers")
    n_experts = config.get("num_experts", config.get("num_local_experts"))
    assert n_experts >= 32
    assert config.get("num_local_experts", n_experts) == n_experts
    assert config["num_experts_per_tok"] >= 2
    assert config["norm_topk_prob"] is True


def test_transformers_config_and_weights(model_dir: Path, config: dict) -> None:
    """transformers reads the config, and the safetensors hold every expert of every layer."""
    from safetensors import safe_open
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    assert cfg.num_experts == config["num_experts"]
    assert cfg.num_hidden_layers == config["num_hidden_layers"]
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    for layer in range(cfg.num_hidden_layers):
        gate = f"model.layers.{layer}.mlp.gate.weight"
        assert gate in keys
        experts = {k for k in keys if k.startswith(f"model.layers.{layer}.mlp.experts.")}
        assert len(experts) == 3 * cfg.num_experts  # gate/up/down per expert


def test_checkpoint_size_and_training_log(model_dir: Path) -> None:
    """The asset stays small, and its recorded loss curve went clearly down."""
    total = sum(p.stat().st_size for p in model_dir.rglob("*") if p.is_file())
    assert total <= MAX_CHECKPOINT_BYTES
    log = json.loads((model_dir / "training_log.json").read_text())
    assert "train_tiny_moe.py" in log["command"]
    curve = log["curve"]
    assert {"step", "loss", "lb_loss"} <= set(curve[0])
    assert curve[-1]["loss"] < curve[0]["loss"] - 2.0
    final = log["final_eval"]
    assert min(final["expert_share_min"]) > 0.0  # no dead expert on held-out text


def test_tokenizer(model_dir: Path) -> None:
    """AutoTokenizer loads it with bos/eos/pad tokens and a working chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.bos_token and tok.eos_token and tok.pad_token
    text = "Hello world, this is a test."
    ids = tok(text).input_ids
    assert ids and tok.decode(ids) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                     tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_vllm_greedy_generation(model_dir: Path, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM (CPU, in-process) loads the checkpoint and greedy-decodes tokens."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_CACHE_ROOT", fresh_cache_root(tmp_path / "vllm_cache"))
    monkeypatch.setenv("VLLM_PLUGINS", "")  # the asset on its own, without project plugins
    # ...but this process has imported Numba (llvmlite) in earlier tests, whose ctypes wrappers
    # crash vLLM 0.32's Triton re-binding scan; the plugin normally installs this workaround.
    from vllm_semmoe.vllm_adapter.patches.triton import REBIND_SCAN

    REBIND_SCAN.install()
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype="bfloat16", max_model_len=256, enforce_eager=True,
              distributed_executor_backend="uni", seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = ["The history of the city", "<|im_start|>user\nWhat is Python?<|im_end|>\n"
               "<|im_start|>assistant\n"]
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(first, again):
        out = a.outputs[0]
        assert len(out.token_ids) == 16
        assert out.text.strip()
        assert list(out.token_ids) == list(b.outputs[0].token_ids)  # greedy is repeatable
