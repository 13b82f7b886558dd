#!/usr/bin/env python3
"""Train the tiny Qwen3-MoE causal LM that vllm-semmoe ships as its embedded default model.

The model is HF transformers' ``Qwen3MoeForCausalLM`` (every decoder layer is a MoE layer),
trained from scratch on CPU with a byte-level BPE tokenizer that is itself trained here on
the same text. The checkpoint is written in HF format (config.json, model.safetensors,
tokenizer files, generation_config.json) so vLLM loads it directly, plus a
``training_log.json`` holding the loss curve and the held-out routing balance.

Training text (read from ``--data-dir``, default ``../shared/data/text`` next to the repo):

* ShareGPT conversations (``sharegpt_4k.jsonl.gz``) rendered with the ChatML chat template
  that the tokenizer ships; the last ``--holdout-conversations`` conversations (by index)
  are held out from training and used only for evaluation (routing is later profiled on
  ShareGPT prompts);
* WikiText-2 test and valid (``wikitext2_{test,valid}.txt.gz``), split into articles;
* optionally MMLU test questions (``--include-mmlu``).

The loss is next-token cross-entropy plus ``--lb-coef`` times a Switch/Qwen style
load-balancing loss ``N * sum_i f_i * P_i`` computed per MoE layer and averaged over layers
(f_i: share of top-k assignments routed to expert i, P_i: mean router probability of
expert i; it equals 1.0 for perfectly balanced routing).

Example (the command used for the shipped checkpoint)::

    python scripts/train_tiny_moe.py --threads 1 --max-minutes 25
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import random
import re
import shlex
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data" / "text"
DEFAULT_OUT = REPO_ROOT / "vllm_semmoe" / "assets" / "tiny_moe"

EOT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END, PAD]  # ids 0..3 in this order

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                  "bing": "assistant", "bard": "assistant", "system": "system"}

MAX_CHECKPOINT_BYTES = 20 * 1024 * 1024


def log(msg: str) -> None:
    """Print a progress message to stderr, flushed."""
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse command-line arguments."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    io = p.add_argument_group("input/output")
    io.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR,
                    help="folder holding sharegpt_4k.jsonl.gz and wikitext2_*.txt.gz")
    io.add_argument("--out", type=Path, default=DEFAULT_OUT, help="checkpoint folder to write")
    io.add_argument("--holdout-conversations", type=int, default=1000,
                    help="last N ShareGPT conversations (by index) are never trained on")
    io.add_argument("--include-mmlu", action="store_true",
                    help="also train on MMLU test questions")
    io.add_argument("--tokenizer-chars", type=int, default=12_000_000,
                    help="characters of training text sampled to train the BPE tokenizer")

    run = p.add_argument_group("run")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--threads", type=int, default=1, help="torch / tokenizers CPU threads")
    run.add_argument("--max-minutes", type=float, default=25.0,
                     help="wall-time budget for the whole run (data prep included); "
                          "training stops early enough to evaluate and save within it")
    run.add_argument("--max-steps", type=int, default=100_000, help="optimizer step cap")
    run.add_argument("--log-every", type=int, default=10)
    run.add_argument("--eval-every", type=int, default=250)
    run.add_argument("--eval-windows", type=int, default=48,
                     help="held-out windows of --seq-len tokens for evaluation")

    opt = p.add_argument_group("optimisation")
    opt.add_argument("--batch-size", type=int, default=8)
    opt.add_argument("--seq-len", type=int, default=512)
    opt.add_argument("--lr", type=float, default=2e-3)
    opt.add_argument("--min-lr-ratio", type=float, default=0.1)
    opt.add_argument("--warmup-steps", type=int, default=60)
    opt.add_argument("--weight-decay", type=float, default=0.1)
    opt.add_argument("--grad-clip", type=float, default=1.0)
    opt.add_argument("--lb-coef", type=float, default=0.01, help="load-balancing loss weight")

    arch = p.add_argument_group("architecture (Qwen3-MoE)")
    arch.add_argument("--vocab-size", type=int, default=6144)
    arch.add_argument("--hidden-size", type=int, default=160)
    arch.add_argument("--moe-intermediate-size", type=int, default=112)
    arch.add_argument("--num-layers", type=int, default=4)
    arch.add_argument("--num-experts", type=int, default=32)
    arch.add_argument("--top-k", type=int, default=4)
    arch.add_argument("--num-heads", type=int, default=4)
    arch.add_argument("--num-kv-heads", type=int, default=2)
    arch.add_argument("--head-dim", type=int, default=32)
    arch.add_argument("--max-position-embeddings", type=int, default=1024)
    arch.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    return p.parse_args(argv)


def configure_threads(threads: int) -> None:
    """Limit torch and the tokenizers (rayon) thread pools to ``threads`` threads."""
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if threads <= 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # already set (e.g. when called twice in one process)
        pass


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch RNGs."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# --------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------


def require_data(data_dir: Path, names: list[str]) -> None:
    """Fail with a clear message if the data folder or one of its files is missing."""
    missing = [n for n in names if not (data_dir / n).is_file()]
    if missing:
        raise SystemExit(
            f"training data missing in {data_dir}: {', '.join(missing)}\n"
            "pass --data-dir pointing at the folder with the shared text data "
            "(see ../shared/data/README.md)")


def render_chat(messages: list[dict]) -> str:
    """Render messages exactly as the tokenizer's ChatML chat template does."""
    return "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)


def load_sharegpt(path: Path) -> list[str]:
    """Return every ShareGPT conversation rendered as ChatML text, in file order."""
    docs = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            msgs = [{"role": SHAREGPT_ROLES.get(t.get("from", ""), "user"), "content": t["value"]}
                    for t in row.get("conversations", []) if t.get("value")]
            docs.append(render_chat(msgs) if msgs else "")
    return docs


def clean_wikitext(text: str) -> str:
    """Undo WikiText's ``@-@``-style escapes (the rest of its tokenisation is kept)."""
    return re.sub(r" @(.)@ ", r"\1", text)


def load_wikitext(path: Path) -> list[str]:
    """Split a WikiText-2 file into articles (at top-level ``= Title =`` headings)."""
    text = clean_wikitext(gzip.open(path, "rt", encoding="utf-8").read())
    parts = re.split(r"\n(?= = [^=].* = \n)", text)
    return [p.strip() + "\n" for p in parts if p.strip()]


def load_mmlu(path: Path) -> list[str]:
    """Render MMLU questions as 'Question / A-D / Answer' documents."""
    docs = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            ans = str(row["answer"])
            if ans.isdigit():
                ans = "ABCD"[int(ans)]
            opts = "\n".join(f"{l}. {c}" for l, c in zip("ABCD", row["choices"]))
            docs.append(f"Question: {row['question']}\n{opts}\nAnswer: {ans}\n")
    return docs


def load_corpus(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """Load (training documents, held-out ShareGPT documents)."""
    names = ["sharegpt_4k.jsonl.gz", "wikitext2_test.txt.gz", "wikitext2_valid.txt.gz"]
    if args.include_mmlu:
        names.append("mmlu_test.jsonl.gz")
    require_data(args.data_dir, names)
    chats = load_sharegpt(args.data_dir / "sharegpt_4k.jsonl.gz")
    n_hold = min(args.holdout_conversations, len(chats))
    train_chats, held = chats[: len(chats) - n_hold], chats[len(chats) - n_hold:]
    wiki = (load_wikitext(args.data_dir / "wikitext2_test.txt.gz")
            + load_wikitext(args.data_dir / "wikitext2_valid.txt.gz"))
    train = [d for d in train_chats if d] + wiki
    if args.include_mmlu:
        train += load_mmlu(args.data_dir / "mmlu_test.jsonl.gz")
    log(f"corpus: {len(train_chats)} train + {n_hold} held-out ShareGPT conversations, "
        f"{len(wiki)} WikiText articles, mmlu={'yes' if args.include_mmlu else 'no'}; "
        f"{sum(map(len, train)) / 1e6:.1f}M training chars")
    return train, [d for d in held if d]


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------


def train_tokenizer(docs: list[str], vocab_size: int, max_chars: int, seed: int,
                    model_max_length: int):
    """Train a byte-level BPE on a sample of ``docs``; return a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    sample, total = [], 0
    for i in order:
        if total >= max_chars:
            break
        sample.append(docs[i])
        total += len(docs[i])

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    t0 = time.time()
    tok.train_from_iterator(sample, trainer=trainer, length=len(sample))
    log(f"tokenizer: byte-level BPE, vocab {tok.get_vocab_size()} trained on "
        f"{total / 1e6:.1f}M chars in {time.time() - t0:.0f}s")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END], chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length, clean_up_tokenization_spaces=False)


def encode_stream(tokenizer, docs: list[str]) -> np.ndarray:
    """Tokenise documents into one uint16 stream, each document followed by <|endoftext|>."""
    eot = tokenizer.convert_tokens_to_ids(EOT)
    raw = tokenizer.backend_tokenizer
    out: list[np.ndarray] = []
    for i in range(0, len(docs), 256):
        for enc in raw.encode_batch(docs[i:i + 256], add_special_tokens=False):
            out.append(np.asarray(enc.ids + [eot], dtype=np.uint16))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.uint16)


# --------------------------------------------------------------------------------------
# Model, loss, batches
# --------------------------------------------------------------------------------------


def build_model(args: argparse.Namespace, tokenizer):
    """Instantiate a freshly initialised Qwen3MoeForCausalLM (all layers MoE)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=4 * args.hidden_size,  # dense MLP size; unused (all layers MoE)
        moe_intermediate_size=args.moe_intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        num_experts=args.num_experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=True,
        router_aux_loss_coef=args.lb_coef,
        output_router_logits=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        experts_implementation="grouped_mm",  # same maths as "eager", faster on CPU
    )
    model = Qwen3MoeForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    log(f"model: Qwen3MoeForCausalLM {n / 1e6:.2f}M params, {args.num_layers} MoE layers x "
        f"{args.num_experts} experts, top-{args.top_k}, hidden {args.hidden_size}")
    return model


def load_balance_loss(router_logits: tuple[torch.Tensor, ...], top_k: int) -> torch.Tensor:
    """Switch/Qwen load-balancing loss ``N * sum_i f_i * P_i``, averaged over layers.

    f_i is the share of the T*k top-k assignments of layer's tokens that go to expert i
    and P_i the mean router probability of expert i; balanced routing gives 1.0.
    """
    losses = []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        n_experts = probs.shape[-1]
        top = torch.topk(probs, top_k, dim=-1).indices
        f = torch.bincount(top.reshape(-1), minlength=n_experts).float() / top.numel()
        losses.append(n_experts * torch.sum(f * probs.mean(dim=0)))
    return torch.stack(losses).mean()


def sample_batch(stream: np.ndarray, batch_size: int, seq_len: int,
                 gen: torch.Generator) -> torch.Tensor:
    """Draw ``batch_size`` random windows of ``seq_len + 1`` tokens from the stream."""
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch_size,), generator=gen)
    rows = [stream[s:s + seq_len + 1].astype(np.int64) for s in starts.tolist()]
    return torch.from_numpy(np.stack(rows))


def eval_windows(stream: np.ndarray, n: int, seq_len: int) -> torch.Tensor:
    """Evenly spaced, non-overlapping held-out windows of ``seq_len + 1`` tokens."""
    n = max(1, min(n, len(stream) // (seq_len + 1)))
    step = len(stream) // n
    return torch.from_numpy(np.stack(
        [stream[i * step:i * step + seq_len + 1].astype(np.int64) for i in range(n)]))


def make_optimizer(model, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices/expert tensors only (not norms)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(progress: float, step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr`` over ``progress`` in [0,1]."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    cos = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * (args.min_lr_ratio + (1.0 - args.min_lr_ratio) * cos)


def forward_losses(model, batch: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (next-token cross-entropy, load-balancing loss) for a batch of windows."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    out = model(input_ids=inputs, output_router_logits=True, use_cache=False)
    ce = torch.nn.functional.cross_entropy(
        out.logits.float().reshape(-1, out.logits.shape[-1]), targets.reshape(-1))
    return ce, load_balance_loss(out.router_logits, top_k)


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, top_k: int, batch_size: int) -> dict:
    """Held-out loss and per-layer expert-load shares (share of top-k assignments)."""
    model.eval()
    ce_sum, lb_sum, n_batches, counts = 0.0, 0.0, 0, None
    for i in range(0, len(windows), batch_size):
        batch = windows[i:i + batch_size]
        out = model(input_ids=batch[:, :-1], output_router_logits=True, use_cache=False)
        ce_sum += torch.nn.functional.cross_entropy(
            out.logits.float().reshape(-1, out.logits.shape[-1]),
            batch[:, 1:].reshape(-1)).item()
        lb_sum += load_balance_loss(out.router_logits, top_k).item()
        n_batches += 1
        layer_counts = torch.stack([
            torch.bincount(torch.topk(l, top_k, dim=-1).indices.reshape(-1),
                           minlength=l.shape[-1]) for l in out.router_logits])
        counts = layer_counts if counts is None else counts + layer_counts
    model.train()
    shares = counts.double() / counts.sum(dim=1, keepdim=True)
    return {
        "loss": ce_sum / n_batches,
        "lb_loss": lb_sum / n_batches,
        "tokens": int(windows[:, :-1].numel()),
        "expert_share_min": [round(v, 5) for v in shares.min(dim=1).values.tolist()],
        "expert_share_max": [round(v, 5) for v in shares.max(dim=1).values.tolist()],
        "uniform_share": 1.0 / shares.shape[1],
        "experts_unused": [int(v) for v in (counts == 0).sum(dim=1).tolist()],
    }


def format_eval(ev: dict) -> str:
    """One-line summary of an evaluation dict."""
    per_layer = " ".join(f"L{i}:{lo * 100:.1f}-{hi * 100:.1f}%" for i, (lo, hi) in
                         enumerate(zip(ev["expert_share_min"], ev["expert_share_max"])))
    return (f"held-out loss {ev['loss']:.3f} (ppl {math.exp(ev['loss']):.1f}) "
            f"lb {ev['lb_loss']:.3f}; expert share min-max per layer "
            f"(uniform {ev['uniform_share'] * 100:.2f}%): {per_layer}")


# --------------------------------------------------------------------------------------
# Training loop and saving
# --------------------------------------------------------------------------------------


def train(model, train_stream: np.ndarray, held_windows: torch.Tensor,
          args: argparse.Namespace, deadline: float) -> tuple[list[dict], list[dict], int]:
    """Run the optimisation loop until ``max_steps`` or ``deadline``; return logs."""
    gen = torch.Generator().manual_seed(args.seed)
    opt = make_optimizer(model, args.lr, args.weight_decay)
    model.train()
    curve, evals = [], []
    t_start = time.time()
    budget = max(1.0, deadline - t_start)
    tokens_per_step = args.batch_size * args.seq_len
    acc_ce = acc_lb = 0.0
    acc_n = 0
    step = 0
    try:
        while step < args.max_steps and time.time() < deadline:
            progress = max(step / args.max_steps, (time.time() - t_start) / budget)
            for g in opt.param_groups:
                g["lr"] = lr_at(progress, step, args)
            batch = sample_batch(train_stream, args.batch_size, args.seq_len, gen)
            ce, lb = forward_losses(model, batch, args.top_k)
            loss = ce + args.lb_coef * lb
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            opt.step()
            step += 1
            acc_ce += ce.item()
            acc_lb += lb.item()
            acc_n += 1
            if step % args.log_every == 0 or step == 1:
                elapsed = time.time() - t_start
                tps = step * tokens_per_step / elapsed
                eta = min(deadline - time.time(),
                          (args.max_steps - step) * elapsed / step)
                curve.append({"step": step, "loss": round(acc_ce / acc_n, 4),
                              "lb_loss": round(acc_lb / acc_n, 4),
                              "lr": round(opt.param_groups[0]["lr"], 6),
                              "elapsed_s": round(elapsed, 1)})
                log(f"step {step:5d}  loss {acc_ce / acc_n:.3f}  lb {acc_lb / acc_n:.3f}  "
                    f"lr {opt.param_groups[0]['lr']:.2e}  {tps:,.0f} tok/s  "
                    f"ETA {max(0.0, eta) / 60:.1f} min")
                acc_ce = acc_lb = 0.0
                acc_n = 0
            if args.eval_every and step % args.eval_every == 0:
                ev = evaluate(model, held_windows[:16], args.top_k, args.batch_size)
                ev["step"] = step
                evals.append(ev)
                log(f"eval @ {step}: {format_eval(ev)}")
    except KeyboardInterrupt:
        log(f"interrupted at step {step}: saving what we have")
    if acc_n:  # steps since the last log line
        curve.append({"step": step, "loss": round(acc_ce / acc_n, 4),
                      "lb_loss": round(acc_lb / acc_n, 4),
                      "lr": round(opt.param_groups[0]["lr"], 6),
                      "elapsed_s": round(time.time() - t_start, 1)})
    return curve, evals, step


def dir_size(path: Path) -> int:
    """Total size in bytes of the files under ``path``."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def add_compat_keys(path: Path) -> None:
    """Make the saved files readable by older loaders as well as transformers 5.

    transformers 5 writes ``num_local_experts`` (older readers and vLLM's docs use
    ``num_experts``), the ``TokenizersBackend`` class name (older versions know
    ``PreTrainedTokenizerFast``) and the chat template only as ``chat_template.jinja``.
    """
    cfg_path, tok_path = path / "config.json", path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("num_experts", cfg.get("num_local_experts"))
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok = json.loads(tok_path.read_text())
    tok["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok["chat_template"] = CHAT_TEMPLATE
    tok_path.write_text(json.dumps(tok, indent=2) + "\n")


def save_checkpoint(model, tokenizer, out: Path, save_dtype: str, log_data: dict) -> int:
    """Write the HF checkpoint + training log atomically into ``out``; return its size."""
    from transformers import GenerationConfig

    out = out.resolve()
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.to(getattr(torch, save_dtype)).save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)],
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(tmp)
    add_compat_keys(tmp)
    for f in tmp.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; installed package data must be readable
    size = dir_size(tmp)
    log_data["checkpoint_bytes"] = size
    (tmp / "training_log.json").write_text(json.dumps(log_data, indent=1) + "\n")
    if out.exists():
        if any(out.iterdir()) and not (out / "config.json").exists():
            raise SystemExit(f"refusing to replace non-checkpoint folder {out}; "
                             f"the new checkpoint is in {tmp}")
        shutil.rmtree(out)
    tmp.rename(out)
    return dir_size(out)


def main(argv: list[str] | None = None) -> None:
    """Prepare data and tokenizer, train, evaluate on held-out ShareGPT text, save."""
    args = parse_args(argv)
    t0 = time.time()
    deadline = t0 + 60.0 * args.max_minutes
    configure_threads(args.threads)
    seed_everything(args.seed)

    train_docs, held_docs = load_corpus(args)
    tokenizer = train_tokenizer(train_docs, args.vocab_size, args.tokenizer_chars, args.seed,
                                args.max_position_embeddings)
    t_enc = time.time()
    train_stream = encode_stream(tokenizer, train_docs)
    held_stream = encode_stream(tokenizer, held_docs)
    log(f"encoded {len(train_stream) / 1e6:.2f}M train / {len(held_stream) / 1e6:.2f}M "
        f"held-out tokens in {time.time() - t_enc:.0f}s")
    held = eval_windows(held_stream, args.eval_windows, args.seq_len)

    model = build_model(args, tokenizer)
    # reserve time for the final evaluation and for saving
    reserve = 15.0 + 0.5 * len(held) * args.seq_len / 1000.0
    curve, evals, steps = train(model, train_stream, held, args, deadline - reserve)
    train_s = time.time() - t0

    final = evaluate(model, held, args.top_k, args.batch_size)
    final["step"] = steps
    log(f"final: {format_eval(final)}")
    log_data = {
        "command": shlex.join(["python", "scripts/train_tiny_moe.py"]
                              + (sys.argv[1:] if argv is None else list(argv))),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "steps": steps,
        "tokens_seen": steps * args.batch_size * args.seq_len,
        "train_tokens_available": int(len(train_stream)),
        "wall_time_s": round(time.time() - t0, 1),
        "train_loop_wall_time_s": round(train_s, 1),
        "threads": args.threads,
        "torch": torch.__version__,
        "curve": curve,
        "evals": evals,
        "final_eval": final,
    }
    size = save_checkpoint(model, tokenizer, args.out, args.save_dtype, log_data)
    log(f"saved {args.out} ({size / 2**20:.2f} MiB) after {time.time() - t0:.0f}s; "
        f"loss {curve[0]['loss'] if curve else float('nan'):.3f} -> "
        f"{curve[-1]['loss'] if curve else float('nan'):.3f}")
    if size > MAX_CHECKPOINT_BYTES:
        log(f"WARNING: checkpoint is {size / 2**20:.1f} MiB, above the 20 MiB limit")


if __name__ == "__main__":
    main()
