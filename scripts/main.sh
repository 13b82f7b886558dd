#!/usr/bin/env bash
# The main job (README): idempotent set-up, then `semmoe demo` on the embedded tiny MoE:
# profile ShareGPT prompts through vLLM, solve vanilla and Sem-MoE placements, serve other
# prompts on executed DP 2 + EP engines (stock vLLM vs Sem-MoE, MoE bytes counted by the
# engines) and on one device with EP 8 simulated (LAR replayed from the capture).
# JSON lands in out/demo.json. Extra arguments go to `demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/semmoe demo --json out/demo.json "$@"
