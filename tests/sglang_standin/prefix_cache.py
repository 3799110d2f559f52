"""SGLang's radix prefix cache, as far as `meta_info.cached_tokens` shows it.

SGLang matches a request's prompt against the token sequences its radix tree holds
(the prompts it prefilled, and each finished request's prompt and output) and reports
the length of the match as `cached_tokens`, capped at `len(prompt) - 1` because the last
prompt token is always computed for the next token's logits. The tree lives in the KV
pool, so it is bounded in tokens and evicts the least recently used leaves first.

Here each cached token is one entry keyed by a hash of the whole prefix that ends in it
(a chain: the key of token i hashes the key of token i-1 and the token), so matching
and inserting cost O(length) dict operations. Recency is kept deepest-first along a
sequence, so eviction takes a sequence's tail before its head, as leaves go first in a
tree, and a prefix that is still cached never loses the entries that reach it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

# Cached tokens per server by default: a KV pool of a few GB on a real GPU.
DEFAULT_CAPACITY_TOKENS = 262_144


def _chain(ids: list[int]) -> Iterator[int]:
    key = 0
    for token in ids:
        key = hash((key, token))
        yield key


class PrefixCache:
    def __init__(self, capacity_tokens: int = DEFAULT_CAPACITY_TOKENS) -> None:
        if capacity_tokens < 0:
            raise ValueError("capacity_tokens must be >= 0")
        self.capacity_tokens = capacity_tokens
        # Prefix key -> None; the least recently used first.
        self._entries: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, prompt_ids: list[int]) -> int:
        """How many leading prompt tokens are cached (at most all but the last one);
        the match counts as a use."""
        matched: list[int] = []
        for key in _chain(prompt_ids[: len(prompt_ids) - 1]):
            if key not in self._entries:
                break
            matched.append(key)
        self._touch(matched)
        return len(matched)

    def insert(self, ids: list[int]) -> None:
        """Cache the sequence `ids` (a prompt at prefill; prompt + output at the end)."""
        if not self.capacity_tokens:
            return
        self._touch(list(_chain(ids)))
        while len(self._entries) > self.capacity_tokens:
            self._entries.popitem(last=False)

    def _touch(self, keys: list[int]) -> None:
        """Mark used, the shortest prefix most recent: its tail is evicted first."""
        for key in reversed(keys):
            self._entries[key] = None
            self._entries.move_to_end(key)
