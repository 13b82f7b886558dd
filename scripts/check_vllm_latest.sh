#!/usr/bin/env bash
# The newest vLLM on the package index, checked against the plugin; prints ONE line:
#
#   <UTC date> vLLM <version>: supported|NOT supported; modes ...; refused at start: ...; N internals needed, ...
#
# Downloads the newest `vllm` wheel (no dependencies, never installed; kept in the wheel cache
# beside the ones scripts/setup_env.sh caches) and runs `semmoe doctor --vllm-source` on it.
# Not part of CI's pass/fail (an upstream release must not stop our own work landing): the
# exit code is 0 whenever the line was printed, 2 when no wheel could be had.
#
#   bash scripts/check_vllm_latest.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${SEMMOE_PYTHON:-.venv/bin/python}
WHEELS=${SEMMOE_WHEEL_CACHE:-$HOME/.cache/vllm-semmoe/wheels}
PIP=("$PY" -m pip --disable-pip-version-check)

# the newest version on the index (pip prints "vllm (X.Y.Z)" first)
VERSION=$("${PIP[@]}" index versions vllm 2>/dev/null | sed -n 's/^vllm (\([^)]*\)).*/\1/p' | head -1)
if [[ -z "$VERSION" ]]; then
  echo "check_vllm_latest: could not read vllm's versions from the package index (pip index versions vllm)" >&2
  exit 2
fi
WHEEL=$(ls "$WHEELS"/vllm-"$VERSION"-*.whl 2>/dev/null | head -1)
if [[ -z "$WHEEL" ]]; then
  mkdir -p "$WHEELS"
  if ! "${PIP[@]}" download -q --no-deps --dest "$WHEELS" "vllm==$VERSION" 2> >(grep -v "^WARNING: Location" >&2) \
      >/dev/null; then
    echo "check_vllm_latest: could not download vllm==$VERSION into $WHEELS" >&2
    exit 2
  fi
  WHEEL=$(ls "$WHEELS"/vllm-"$VERSION"-*.whl 2>/dev/null | head -1)
fi
if [[ -z "$WHEEL" ]]; then
  echo "check_vllm_latest: vllm==$VERSION has no wheel in $WHEELS (only a source archive?)" >&2
  exit 2
fi
LINE=$("$PY" -m vllm_semmoe.cli doctor --one-line --vllm-source "$WHEEL")
echo "$(date -u +%Y-%m-%d) $LINE"
exit 0
