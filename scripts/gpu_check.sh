#!/usr/bin/env bash
# GPU check (CUDA vLLM 0.32/0.33): run once on a machine with an NVIDIA GPU; prints one summary.
#
#   bash scripts/gpu_check.sh            # uses/creates .venv-gpu; pip needs PyPI, or
#   SEMMOE_WHEELHOUSE=/path/to/wheels bash scripts/gpu_check.sh   # offline: wheels folder
#   SEMMOE_GPU_PYTHON=/usr/bin/python3 bash scripts/gpu_check.sh   # a Python that already has vllm (CUDA)
#   SEMMOE_GPU_NO_VLLM=1 SEMMOE_GPU_PYTHON=python3 bash scripts/gpu_check.sh
#       # no CUDA vLLM to be had (no network, no wheelhouse): only steps 3, 4 and 6, with 6 timed
#       # against the layer's expert FLOPs instead of vLLM's MoE layer; needs torch, triton, numba,
#       # numpy, pytest and hypothesis in that Python. Steps 2 and 5 print "not run".
#
# Steps (each prints a line; the last line is the JSON summary):
#  1. install .[cuda,dev] with vllm>=0.32,<0.34 (the CUDA build; the engine steps capture routing,
#     which 0.34 refuses) unless the Python already has it;
#  2. `semmoe doctor` on that vLLM;
#  3. the Triton kernels (shuffle, the decision's price rounds) compiled for this GPU against
#     their references;
#  4. the device-side (PyTorch + Triton) TP decision against the Numba one, on the GPU;
#  5. the tiny MoE model through CUDA vLLM, compiled with piecewise CUDA graphs, with a Sem-MoE
#     placement and routing capture: tokens equal the plugin-off run, every step captured, and
#     the default full CUDA graphs refused at start with the plugin's message;
#  6. the device-side TP decision timed against a MoE layer of the same batch on the GPU (with
#     SEMMOE_GPU_NO_VLLM: by part, against the layer's expert FLOPs, and the rounds kernel at
#     several tile sizes and warp counts).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${SEMMOE_GPU_OUT:-${OUT:-$ROOT/gpu_check_out}}  # $OUT: the device runner's folder that comes back
mkdir -p "$OUT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_CACHE_ROOT="$OUT/vllm_cache" TORCHINDUCTOR_CACHE_DIR="$OUT/inductor_cache"

if [[ -n "${SEMMOE_GPU_PYTHON:-}" ]]; then
  PY=$SEMMOE_GPU_PYTHON
else
  VENV=${SEMMOE_GPU_VENV:-$ROOT/.venv-gpu}
  [[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
  PY=$VENV/bin/python
fi
if [[ -z "${SEMMOE_GPU_NO_VLLM:-}" ]]; then
  if ! "$PY" -c 'import vllm, sys; v = vllm.__version__; sys.exit(0 if v.startswith(("0.32.", "0.33.")) and "+cpu" not in v else 1)' 2>/dev/null; then
    echo "[gpu_check] installing .[cuda,dev]" >&2
    if [[ -n "${SEMMOE_WHEELHOUSE:-}" ]]; then
      "$PY" -m pip install -q --no-index --find-links "$SEMMOE_WHEELHOUSE" -e "$ROOT[cuda,dev]" "vllm>=0.32,<0.34" || { echo "install failed"; exit 1; }
    else
      "$PY" -m pip install -q -e "$ROOT[cuda,dev]" "vllm>=0.32,<0.34" || { echo "install failed"; exit 1; }
    fi
  else
    "$PY" -m pip install -q --no-deps -e "$ROOT" >/dev/null 2>&1 || true
  fi
fi

declare -A STATUS
step() {  # step NAME command...: run, keep the log, record pass/fail
  local name=$1; shift
  local start=$SECONDS
  if "$@" >"$OUT/$name.log" 2>&1; then STATUS[$name]="pass $((SECONDS - start))s"; else STATUS[$name]="FAIL $((SECONDS - start))s (see $OUT/$name.log)"; fi
  echo "[gpu_check] $name: ${STATUS[$name]}" >&2
}

if [[ -n "${SEMMOE_GPU_NO_VLLM:-}" ]]; then
  STATUS[doctor]="not run (no CUDA vLLM)"; STATUS[engine]="not run (no CUDA vLLM)"
  step triton_kernels "$PY" -m pytest -q -p no:cacheprovider tests/test_triton_shuffle.py tests/test_triton_align.py tests/test_triton_decide.py -k "cuda"
  step decision_and_timing "$PY" "$ROOT/scripts/gpu_check_engine.py" --no-vllm "$OUT"
else
  step doctor "$PY" -m vllm_semmoe.cli doctor
  step triton_kernels "$PY" -m pytest -q -p no:cacheprovider tests/test_triton_shuffle.py tests/test_triton_align.py tests/test_triton_decide.py -k "cuda"
  step engine_and_timing "$PY" "$ROOT/scripts/gpu_check_engine.py" "$OUT"
fi

"$PY" - "$OUT" <<PYEOF
import json, sys, os
out = sys.argv[1]
summary = {"steps": {k: v for k, v in [$(for k in "${!STATUS[@]}"; do printf '("%s", "%s"),' "$k" "${STATUS[$k]}"; done)]}}
path = os.path.join(out, "engine.json")
if os.path.exists(path):
    summary.update(json.load(open(path)))
print("GPU_CHECK_SUMMARY " + json.dumps(summary, sort_keys=True))
PYEOF
