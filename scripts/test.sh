#!/usr/bin/env bash
# The test command of the README: set up (idempotent), lint, type-check, run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy  # the packages and settings are in pyproject.toml [tool.mypy]
.venv/bin/python -m pytest -q "$@"
