"""Engine factory: `--engine NAME` to an Engine instance, importing heavy parts lazily.

Besides the built-in names, `--engine package.module:factory` loads a custom engine:
`factory(options: EngineOptions) -> Engine`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Literal

from regen.common import defaults, extras
from regen.consumers.generate.engine import Engine

BUILTIN = ("sglang", "sglang-engine", "local")
# `--max-inflight auto`: each SGLang server's limit follows its /metrics (admission_policy.py).
AUTO = "auto"


@dataclass(frozen=True)
class EngineOptions:
    # SGLang server URLs (engine "sglang").
    servers: list[str] = field(default_factory=list)
    # Model for in-process engines ("local", "sglang-engine"); default: the job's model.
    model: str | None = None
    # Requests in flight per server (sglang), or the batch size (local); "auto" (sglang
    # only) lets each server's /metrics steer it; None: the engine's default (sglang: auto).
    max_inflight: int | Literal["auto"] | None = None
    # The most `auto` keeps in flight on one server.
    max_inflight_cap: int = defaults.MAX_INFLIGHT_CAP
    request_timeout_s: float = defaults.REQUEST_TIMEOUT_S
    trust_remote_code: bool = False
    device: str = defaults.DEVICE
    tp_size: int = defaults.TP_SIZE
    # More `sglang.Engine` arguments (SGLang's ServerArgs fields), engine "sglang-engine".
    sglang_args: dict[str, Any] = field(default_factory=dict)
    # SGLang's --api-key and --admin-api-key (engine "sglang"): the admin key is what
    # /abort_request takes where a server has one (docs/design/placement.md, "What may move").
    sglang_api_key: str | None = field(default=None, repr=False)
    sglang_admin_api_key: str | None = field(default=None, repr=False)


# The extra each built-in in-process engine needs (pyproject.toml).
ENGINE_EXTRAS = {"local": "local", "sglang-engine": "sglang"}


def require_engine_extra(name: str) -> None:
    """extras.MissingExtra when engine `name` needs an extra that is not installed: said
    before a worker starts anything, instead of an import error once it has."""
    extra = ENGINE_EXTRAS.get(name)
    if extra is not None:
        extras.require(extra, f"--engine {name}")


def make_engine(name: str, options: EngineOptions) -> Engine:
    require_engine_extra(name)
    if name == "sglang":
        if not options.servers:
            raise ValueError("--engine sglang needs at least one --server URL")
        from regen.consumers.generate.engines.admission_policy import AdmissionPolicy
        from regen.consumers.generate.engines.sglang_http import SGLangHTTPEngine

        auto = options.max_inflight in (None, AUTO)
        return SGLangHTTPEngine(
            options.servers,
            max_inflight_per_server=_fixed(options, defaults.MAX_INFLIGHT_PER_SERVER),
            admission=AdmissionPolicy(cap=options.max_inflight_cap) if auto else None,
            request_timeout_s=options.request_timeout_s,
            api_key=options.sglang_api_key,
            admin_api_key=options.sglang_admin_api_key,
        )
    if options.max_inflight == AUTO:
        raise ValueError("--max-inflight auto needs --engine sglang (it reads servers' /metrics)")
    if name == "local":
        if options.model is None:
            raise ValueError("--engine local needs a model (the job's, or --model)")
        from regen.consumers.generate.engines.local import LocalEngine

        return LocalEngine(
            options.model,
            device=options.device,
            max_batch_size=_fixed(options, defaults.LOCAL_BATCH_SIZE),
            trust_remote_code=options.trust_remote_code,
        )
    if name == "sglang-engine":
        if options.model is None:
            raise ValueError("--engine sglang-engine needs a model (the job's, or --model)")
        from regen.consumers.generate.engines.sglang_inprocess import SGLangInProcessEngine

        return SGLangInProcessEngine(
            options.model,
            tp_size=options.tp_size,
            trust_remote_code=options.trust_remote_code,
            max_inflight=_fixed(options, defaults.MAX_INFLIGHT_PER_SERVER),
            server_args=options.sglang_args,
        )
    if ":" in name:
        module_name, _, attr = name.partition(":")
        factory = getattr(importlib.import_module(module_name), attr)
        engine: Engine = factory(options)
        return engine
    raise ValueError(
        f"unknown engine {name!r}: use one of {', '.join(BUILTIN)} or package.module:factory"
    )


def _fixed(options: EngineOptions, default: int) -> int:
    """The fixed in-flight limit (or batch size) asked for, else `default`."""
    return options.max_inflight if isinstance(options.max_inflight, int) else default
