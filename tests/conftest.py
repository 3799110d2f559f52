from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import regen.common
import regen.consumers
import regen.producer
from regen.common import settings
from tests.support.bucket_stores import KINDS, StoreServer, store_server
from tests.support.redis_server import RedisServer, reserved_port, running_redis

# One torch (OpenMP) thread per process, set before anything imports torch; the
# processes a test starts (`regen demo`, its workers) inherit it. The suite runs more
# processes than cores, and torch's default, one thread per core, makes each model step
# wait at OpenMP barriers for threads that another process holds off the CPU: measured on
# 2 busy cores, tests/generate/test_local_engine.py took 145 s of CPU with the default and 46 s
# with one thread, the local-engine demo 137 s and 67 s. What the tests assert does not
# depend on the thread count: each compares results computed in the same process.
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]


def installed_elsewhere() -> dict[str, str]:
    """The subpackages that do not come from this checkout's top-level folders.

    regen.common, regen.producer and regen.consumers are common/, producer/ and consumers/
    through the venv's editable install (`pip install -e .` in scripts/setup.sh; docs/
    design.md, Layout), whatever PYTHONPATH says: a venv installed from another checkout
    would run that one's code beside this one's regen/, and its workers too."""
    return {
        module.__name__: str(module.__file__)
        for module in (regen.common, regen.producer, regen.consumers)
        if Path(str(module.__file__)).resolve().parent != REPO / module.__name__.split(".")[-1]
    }


def pytest_configure(config: pytest.Config) -> None:
    if elsewhere := installed_elsewhere():
        raise pytest.UsageError(
            f"the venv runs another checkout's code: {elsewhere}; install this checkout "
            f"into it (scripts/setup.sh, or `pip install --no-deps -e {REPO}`)"
        )


# Nothing in the test suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# State (the converted-tokenizer cache) goes to pytest's cache folder, never ./.regen;
# subprocesses inherit it, so each does not convert the GGUF tokenizer again.
os.environ.setdefault("REGEN_HOME", str(REPO / ".pytest_cache" / "regen"))
# The embedded Redis of the session (and of every subprocess it starts) is on a port of its
# own, never the default one: a `regen demo` or `regen redis start` left running on the
# machine must not change what a test sees. The port is held by a socket that is bound but
# never listens, so for the whole session nothing answers there (the embedded Redis is
# "not running") and no test's own Redis can be given it. A test that wants an embedded
# Redis sets REGEN_EMBEDDED_PORT itself (tests/common/test_redis_connection.py).
_EMBEDDED_PORT_HOLDER = reserved_port()
os.environ["REGEN_EMBEDDED_PORT"] = str(_EMBEDDED_PORT_HOLDER.getsockname()[1])


@pytest.fixture(autouse=True)
def settings_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A process reads its settings once; after a test that set REGEN_* variables in
    this process (e.g. for a command it runs in-process), they are read again."""
    yield
    monkeypatch.undo()
    settings.load()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real Redis for the test session, on a free port, never the machine's own."""
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """The session Redis, emptied for this test."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield redis_server.url
    client.close()


@pytest.fixture
def r(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


@pytest.fixture
def regen_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "regen-home"
    monkeypatch.setenv("REGEN_HOME", str(home))
    return home


@pytest.fixture
def needs_missing_package_dir(tmp_path: Path) -> Path:
    """A remote-code tokenizer folder whose code imports a package that is not installed
    (`regen_test_absent_package`): a real import failure, as a missing tiktoken gives."""
    folder = tmp_path / "needs-missing-package"
    folder.mkdir()
    auto_map = {"AutoTokenizer": ["tokenization_needy.NeedyTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps({"auto_map": auto_map}))
    (folder / "tokenization_needy.py").write_text(
        "import regen_test_absent_package\n\n\nclass NeedyTokenizer:\n    pass\n"
    )
    return folder


@pytest.fixture(scope="session")
def kimi_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Kimi K2-format tokenizer folder (tiktoken, remote code), built from qwen3_6 ranks."""
    from tests.support.fixtures.kimi_tokenizer import build_kimi_tokenizer

    return build_kimi_tokenizer(tmp_path_factory.mktemp("kimi-tokenizer"))


@pytest.fixture(scope="session")
def kimi_tokenizer(kimi_tokenizer_dir: Path) -> Any:
    from regen.common.tokenizer import load_tokenizer

    return load_tokenizer(str(kimi_tokenizer_dir), trust_remote_code=True)


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    from regen.common.tokenizer import load_tokenizer

    return load_tokenizer("smollm2")


@pytest.fixture(scope="module", params=KINDS)
def store(request: pytest.FixtureRequest) -> Iterator[StoreServer]:
    """An object store's emulator (tests/support/bucket_stores.py), one per kind: a test runs on
    each, or on those it names with `@pytest.mark.parametrize("store", [...],
    indirect=True)`."""
    with store_server(request.param) as server:
        yield server
