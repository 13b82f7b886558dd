#!/usr/bin/env bash
# Cross-dataset transfer on the embedded model (figures: benchmarks/SEEDS.md): profile 300
# ShareGPT prompts (#3000-3299), evaluate in-domain ShareGPT (#3300-3599), MMLU and WikiText-2
# (300 prompts each), EP 8, TP and DP modes, with the layer prior and with nearest-neighbour
# rows for tokens never profiled. Captures (16 generated tokens per prompt) are kept in
# ${SEMMOE_TRANSFER_DIR:-~/.cache/vllm-semmoe/transfer} and reused.
#
#   SEMMOE_DATA_DIR=../shared/data bash scripts/transfer_embedded.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${SEMMOE_DATA_DIR:-../shared/data}/text
OUT=${SEMMOE_TRANSFER_DIR:-$HOME/.cache/vllm-semmoe/transfer}
MODEL=vllm_semmoe/assets/tiny_moe
mkdir -p "$OUT"
capture() {  # name dataset skip
    [ -s "$OUT/$1.npz" ] || .venv/bin/semmoe profile --dataset "$DATA/$2" --num-prompts 300 --skip "$3" \
        --out "$OUT/$1.npz" > "$OUT/$1.log" 2>&1
}
capture sharegpt sharegpt_4k.jsonl.gz 3000
capture sharegpt_other sharegpt_4k.jsonl.gz 3300
capture mmlu mmlu_test.jsonl.gz 0
capture wikitext wikitext2_test.txt.gz 0
# columns: LAR of vanilla, of semmoe (layer prior for unseen tokens) and of semmoe with nearest
# neighbours; expert_imbalance of semmoe and vanilla; DP: semmoe's window_imbalance / least-loaded's
printf '%-16s%-5s%9s%9s%11s%10s%12s%10s\n' evaluated mode vanilla semmoe semmoe-nn "exp.imb" "vanilla-imb" "window"
for target in sharegpt_other mmlu wikitext; do
    for mode in tp dp; do
        .venv/bin/semmoe eval --profile "$OUT/sharegpt.npz" --eval "$OUT/$target.npz" --ep 8 --mode $mode \
            --method vanilla,semmoe --json "$OUT/$target-$mode.json" > /dev/null 2>> "$OUT/eval.log"
        .venv/bin/semmoe eval --profile "$OUT/sharegpt.npz" --eval "$OUT/$target.npz" --ep 8 --mode $mode \
            --method semmoe --oov-neighbours "$MODEL" --json "$OUT/$target-$mode-nn.json" > /dev/null 2>> "$OUT/eval.log"
        .venv/bin/python - "$OUT/$target-$mode.json" "$OUT/$target-$mode-nn.json" "$target" "$mode" <<'PY'
import json, sys
a, b = (json.load(open(p))["methods"] for p in sys.argv[1:3])
s, v = a["semmoe"], a["vanilla"]
window = f"{s['window_imbalance'] / s['window_imbalance_least_loaded']:.3f}x" if "window_imbalance" in s else "-"
print(f"{sys.argv[3]:<16}{sys.argv[4]:<5}{v['lar']:>9.4f}{s['lar']:>9.4f}{b['semmoe']['lar']:>11.4f}"
      f"{s['expert_imbalance']:>10.3f}{v['expert_imbalance']:>12.3f}{window:>10}")
PY
    done
done
