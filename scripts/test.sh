#!/usr/bin/env bash
# The test command of the README: set up (idempotent), lint, type-check, run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# mypy over the installed namespace (regen.common is common/: docs/design/README.md, Layout);
# its settings are in pyproject.toml [tool.mypy].
.venv/bin/python scripts/typecheck.py
# Tests run in parallel processes (pytest-xdist), each with its own Redis and folders.
# Most of a test's time is spent waiting on the processes it started (workers, servers,
# Redis), so more processes than cores pays: 4 on 2 cores halves the run.
.venv/bin/python -m pytest -q -n "${REGEN_TEST_PROCESSES:-4}" "$@"
