"""`--engine` names to engines, with clear errors for what cannot be built here."""

from __future__ import annotations

import importlib.util

import pytest

from consumers.generate.engines import EngineOptions, make_engine
from tests.poison_engine import PoisonEngine


def test_unknown_engine_names_the_choices() -> None:
    with pytest.raises(ValueError, match="sglang, sglang-engine, local"):
        make_engine("vllm", EngineOptions())


def test_sglang_needs_a_server() -> None:
    with pytest.raises(ValueError, match="--server"):
        make_engine("sglang", EngineOptions())


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang installed")
def test_the_in_process_engine_says_how_to_get_sglang() -> None:
    with pytest.raises(ValueError, match=r"pip install 'regen\[sglang\]'"):
        make_engine("sglang-engine", EngineOptions(model="/models/x"))


def test_a_custom_engine_loads_from_module_and_factory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REGEN_TEST_POISON", "never-matches")
    engine = make_engine("tests.poison_engine:make", EngineOptions())
    assert isinstance(engine, PoisonEngine)
