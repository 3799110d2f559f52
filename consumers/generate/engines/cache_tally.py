"""Prefix-cache hits as SGLang reports them per reply (`meta_info.cached_tokens`), kept
per server by the HTTP engine and for the whole in-process engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class CacheTally:
    """Prompt tokens and cached tokens over the completions that reported cached_tokens;
    those that did not are only counted, so an old server reads "unknown", not "0%"."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    unreported: int = 0

    def count(self, prompt_tokens: int, cached_tokens: int | None) -> None:
        """Account one completion's prompt tokens and how many of them were cached."""
        if cached_tokens is None:
            self.unreported += 1
        else:
            self.prompt_tokens += prompt_tokens
            self.cached_tokens += cached_tokens

    def hit_rate(self) -> float | None:
        """Cached prompt tokens / prompt tokens; None until a completion reported it."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    def snapshot(self) -> dict[str, Any]:
        """The fields heartbeats carry, and status and Prometheus read."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "cache_hit_rate": self.hit_rate(),
            "cache_unreported": self.unreported,
        }
