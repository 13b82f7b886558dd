"""Request workloads: prompts from ShareGPT, MMLU or plain text files (plain or ``.gz``)."""

from __future__ import annotations

import gzip
import json
import os


def load_prompts(path: str, num_prompts: int, *, skip: int = 0) -> list[str]:
    """Up to ``num_prompts`` prompts after the first ``skip`` of the dataset at ``path``.

    - ShareGPT ``.jsonl`` (``{"conversations": [{"from": "human", "value"}, ...]}``): the first
      human turn of each conversation;
    - MMLU ``.jsonl`` (``{"question", "choices", ...}``): question and lettered choices;
    - anything else: plain text, one prompt per blank-line-separated paragraph.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"dataset not found: {path}")
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    opener = gzip.open if path.endswith(".gz") else open
    prompts: list[str] = []
    with opener(path, "rt", encoding="utf-8") as f:
        if ".jsonl" in os.path.basename(path):
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{line_no}: not JSON ({exc})") from None
                prompt = _prompt_of(record)
                if prompt:
                    prompts.append(prompt)
                if len(prompts) >= skip + num_prompts:
                    break
        else:
            paragraph: list[str] = []
            for line in f:
                if line.strip():
                    paragraph.append(line.strip())
                elif paragraph:
                    prompts.append(" ".join(paragraph))
                    paragraph = []
                if len(prompts) >= skip + num_prompts:
                    break
            if paragraph and len(prompts) < skip + num_prompts:
                prompts.append(" ".join(paragraph))
    selected = prompts[skip : skip + num_prompts]
    if not selected:
        raise ValueError(f"{path}: no prompts after skipping {skip}")
    return selected


def _prompt_of(record: dict) -> str | None:
    if "conversations" in record:
        for turn in record["conversations"]:
            if turn.get("from") in ("human", "user") and turn.get("value", "").strip():
                return turn["value"].strip()
        return None
    if "question" in record and "choices" in record:
        letters = "ABCDEFGH"
        choices = "\n".join(f"{letters[i]}. {c}" for i, c in enumerate(record["choices"]))
        return f"{record['question'].strip()}\n{choices}\nAnswer:"
    if "text" in record:
        return str(record["text"]).strip() or None
    raise ValueError(f"unrecognised record (keys {sorted(record)}); expected ShareGPT, MMLU or 'text'")
