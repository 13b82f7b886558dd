#!/usr/bin/env bash
# Offline evaluation (README): idempotent set-up, then Sem-MoE's offline evaluation on the real
# DeepSeek-V2-Lite routing trace: affinity evidence, then every placement method side by side
# in TP and DP mode at EP 8 (20% of requests profiled, 80% evaluated), the cost model of each,
# Sem-MoE's tables, then the
# HTML report with figures. JSON lands in out/, the report in out/report/index.html.
set -euo pipefail
cd "$(dirname "$0")/.."
TRACE=${SEMMOE_TRACE:-../shared/data/routing/dsv2lite_puffin-dev.npz}
OUT=${SEMMOE_OUT:-out}
bash scripts/setup_env.sh
mkdir -p "$OUT"
.venv/bin/semmoe analyze "$TRACE" --json "$OUT/analyze.json"
for mode in tp dp; do
  .venv/bin/semmoe eval --profile "$TRACE" --profile-frac 0.2 --seed 0 --ep 8 --mode "$mode" \
    --method all --json "$OUT/eval_$mode.json"
done
for mode in tp dp; do
  .venv/bin/semmoe cost --trace "$TRACE" --profile-frac 0.2 --seed 0 --ep 8 --mode "$mode" --json "$OUT/cost_$mode.json"
done
.venv/bin/semmoe solve --trace "$TRACE" --profile-frac 0.2 --seed 0 --ep 8 --mode tp --method semmoe \
  --out "$OUT/tables_semmoe_ep8" --json "$OUT/solve_semmoe_ep8.json"
.venv/bin/semmoe report --from "$OUT" --out "$OUT/report"
