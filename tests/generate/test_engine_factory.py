"""`--engine` names to engines, with clear errors for what cannot be built here."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
from click.testing import CliRunner

from regen import cli
from regen.consumers.generate.engine import Engine
from regen.consumers.generate.engines import EngineOptions, make_engine
from regen.consumers.generate.worker import WorkerOptions
from tests.support.poison_engine import PoisonEngine


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
    engine = make_engine("tests.support.poison_engine:make", EngineOptions())
    assert isinstance(engine, PoisonEngine)


def engine_from_cli(monkeypatch: pytest.MonkeyPatch, *args: str) -> Engine:
    """The engine `regen worker generate ARGS` would run."""
    seen: list[WorkerOptions] = []
    monkeypatch.setattr("regen.consumers.generate.worker.run_worker", seen.append)
    result = CliRunner().invoke(cli.main, ["worker", "generate", *args])
    assert result.exit_code == 0, result.output
    return make_engine(seen[0].engine, seen[0].engine_options)


@pytest.mark.parametrize(("flags", "batch"), [([], 16), (["--max-inflight", "4"], 4)])
def test_the_local_engine_batches_16_unless_told(
    monkeypatch: pytest.MonkeyPatch, flags: list[str], batch: int
) -> None:
    engine = engine_from_cli(monkeypatch, "--engine", "local", "--model", "smollm2", *flags)
    assert engine.stats()["max_batch_size"] == batch
    asyncio.run(engine.close())


def test_the_sglang_engine_keeps_256_in_flight_per_server(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engine_from_cli(monkeypatch, "--engine", "sglang", "--server", "http://a:1,http://b:1")
    assert [s["max_inflight"] for s in engine.stats()["servers"]] == [256, 256]
    asyncio.run(engine.close())


@pytest.mark.parametrize(
    ("flags", "reason"),
    [([], "start: fixed default"), (["--max-inflight", "auto"], "start: fixed default"),
     (["--max-inflight", "8"], "fixed: --max-inflight")],
)  # fmt: skip
def test_sglang_in_flight_is_auto_unless_a_number_is_given(
    monkeypatch: pytest.MonkeyPatch, flags: list[str], reason: str
) -> None:
    engine = engine_from_cli(monkeypatch, "--engine", "sglang", "--server", "http://a:1", *flags)
    (server,) = engine.stats()["servers"]
    assert server["limit_reason"] == reason
    assert server["max_inflight"] == (8 if "8" in flags else 256)
    asyncio.run(engine.close())


def test_auto_in_flight_starts_under_its_cap_and_needs_sglang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = engine_from_cli(
        monkeypatch, "--engine", "sglang", "--server", "http://a:1", "--max-inflight-cap", "100"
    )
    assert engine.stats()["servers"][0]["max_inflight"] == 100
    asyncio.run(engine.close())
    with pytest.raises(ValueError, match="auto needs --engine sglang"):
        make_engine("local", EngineOptions(model="smollm2", max_inflight="auto"))
    result = CliRunner().invoke(cli.main, ["worker", "generate", "--max-inflight", "lots"])
    assert result.exit_code == 2 and "neither 'auto' nor a whole number" in result.output
