"""Data files shipped with vllm-semmoe.

``tiny_moe/`` is a small Qwen3-MoE causal LM (4 MoE layers, 32 routed experts, top-4,
byte-level BPE tokenizer with a ChatML chat template) trained by
``scripts/train_tiny_moe.py``. It is the project's embedded default model: an HF-format
checkpoint that vLLM and transformers load directly.
"""

from __future__ import annotations

from pathlib import Path

TRAIN_COMMAND = "python scripts/train_tiny_moe.py --threads 1 --max-minutes 25"

_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def tiny_moe_path() -> str:
    """Return the directory of the shipped tiny Qwen3-MoE checkpoint.

    Raises:
        FileNotFoundError: the checkpoint (or one of its files) is missing, e.g. in a
            source checkout where it has not been trained yet.
    """
    path = Path(__file__).resolve().parent / "tiny_moe"
    missing = [name for name in _REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"tiny MoE checkpoint not found at {path} (missing: {', '.join(missing)}); "
            f"create it from the repository root with: {TRAIN_COMMAND}")
    return str(path)


__all__ = ["tiny_moe_path", "TRAIN_COMMAND"]
