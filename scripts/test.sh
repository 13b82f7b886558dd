#!/usr/bin/env bash
# The project's test command (README, CI): idempotent set-up, the linter (ruff, configured in
# pyproject.toml), the test suite on SEMMOE_TEST_WORKERS processes (default 3, whole files per
# process so that a file's shared engines start once), then the pytest-benchmark speed suite on
# its own (timings need a quiet machine). Extra arguments go to both pytest runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -p no:cacheprovider -n "${SEMMOE_TEST_WORKERS:-3}" --dist loadfile --durations=25 tests "$@"
exec .venv/bin/python -m pytest -p no:cacheprovider --durations=10 benchmarks "$@"
