#!/usr/bin/env bash
# The main job (README): idempotent set-up, then `semmoe demo` on the embedded tiny MoE:
# profile ShareGPT prompts through vLLM, solve vanilla and Sem-MoE placements (EP 8), serve
# other prompts with each placement applied and the plugin metering live LAR, and print live
# vs predicted LAR side by side. JSON lands in out/demo.json. Extra arguments go to `demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/semmoe demo --json out/demo.json "$@"
