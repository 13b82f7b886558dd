#!/usr/bin/env bash
# The project's test command (README, CI): idempotent set-up, the linter (ruff, configured in
# pyproject.toml), then the test suite and the pytest-benchmark speed suite. Extra arguments go
# to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -p no:cacheprovider --durations=25 tests benchmarks "$@"
