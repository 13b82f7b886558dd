#!/usr/bin/env python3
"""Print the shipped tiny MoE's training command, loss curve and held-out evaluations."""

import json
import sys
from pathlib import Path

path = Path(__file__).resolve().parent.parent / "vllm_semmoe" / "assets" / "tiny_moe" / "training_log.json"
log = json.loads(path.read_text())
every = int(sys.argv[1]) if len(sys.argv) > 1 else 100
print(f"command: {log['command']}  ({log['wall_time_s'] / 60:.1f} min, {log['threads']} thread, "
      f"{log['steps']} steps, {log['tokens_seen']:,} tokens)")
print("step  train_loss  lb_loss")
for point in log["curve"]:
    if point["step"] == 1 or point["step"] % every == 0:
        print(f"{point['step']:>4}  {point['loss']:>10.3f}  {point['lb_loss']:>7.3f}")
print("held-out: " + ", ".join(f"step {e['step']}: {e['loss']:.3f}" for e in log["evals"])
      + f", final: {log['final_eval']['loss']:.3f}")
