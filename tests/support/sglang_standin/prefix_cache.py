"""SGLang's radix prefix cache, as far as `meta_info.cached_tokens` shows it.

SGLang matches a request's prompt against the token sequences its radix tree holds
(the prompts it prefilled, and each finished request's prompt and output) and reports
the length of the match as `cached_tokens`, capped at `len(prompt) - 1` because the last
prompt token is always computed for the next token's logits. The tree lives in the KV
pool, so it is bounded in tokens, and it evicts the least recently used leaves first.

This is the same tree with page size 1: each edge holds a run of tokens, so matching
compares whole runs (C-speed tuple compares) and the least-recently-used bookkeeping is
per node, not per token. When it holds more than its budget, it evicts leaves, oldest
first, down to 90% of the budget, so the walk that finds them is paid once per many
requests.
"""

from __future__ import annotations

import heapq
import itertools

# Cached tokens per server by default: a KV pool of a few GB on a real GPU.
DEFAULT_CAPACITY_TOKENS = 262_144
# After an eviction the cache holds at most this share of its budget.
EVICT_DOWN_TO = 0.9


class _Node:
    __slots__ = ("children", "last_used", "parent", "tokens")

    def __init__(self, tokens: tuple[int, ...], parent: _Node | None) -> None:
        self.tokens = tokens  # the run of tokens on the edge from the parent
        self.parent = parent
        self.children: dict[int, _Node] = {}  # by their first token
        self.last_used = 0


class PrefixCache:
    def __init__(self, capacity_tokens: int = DEFAULT_CAPACITY_TOKENS) -> None:
        if capacity_tokens < 0:
            raise ValueError("capacity_tokens must be >= 0")
        self.capacity_tokens = capacity_tokens
        self._root = _Node((), None)
        self._size = 0
        self._clock = itertools.count(1)

    def __len__(self) -> int:
        """Tokens held."""
        return self._size

    def match(self, prompt_ids: list[int]) -> int:
        """How many leading prompt tokens are cached (at most all but the last one);
        the match counts as a use of what it matched."""
        node, matched, _ = self._walk(prompt_ids[: len(prompt_ids) - 1])
        self._touch(node)
        return matched

    def insert(self, ids: list[int]) -> None:
        """Cache the sequence `ids` (a prompt at prefill; prompt + output at the end)."""
        if not self.capacity_tokens:
            return
        node, matched, inside = self._walk(ids)
        if inside:  # the match ends inside node's edge: split it there
            node = self._split(node, inside)
        if matched < len(ids):
            leaf = _Node(tuple(ids[matched:]), node)
            node.children[ids[matched]] = leaf
            self._size += len(leaf.tokens)
            node = leaf
        self._touch(node)
        if self._size > self.capacity_tokens:
            self._evict(int(self.capacity_tokens * EVICT_DOWN_TO))

    def _walk(self, ids: list[int]) -> tuple[_Node, int, int]:
        """(the deepest node the match reaches, tokens matched, how far into that
        node's edge the match ends: 0 when it ends at the node itself)."""
        node, pos = self._root, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            edge = child.tokens
            if tuple(ids[pos : pos + len(edge)]) == edge:
                node, pos = child, pos + len(edge)
                continue
            same = _common(edge, ids[pos:])  # >= 1: the first tokens are equal
            return child, pos + same, same
        return node, pos, 0

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut node's edge after `at` tokens; returns the new node in between."""
        assert node.parent is not None
        middle = _Node(node.tokens[:at], node.parent)
        middle.last_used = node.last_used
        node.parent.children[node.tokens[0]] = middle
        node.tokens, node.parent = node.tokens[at:], middle
        middle.children[node.tokens[0]] = node
        return middle

    def _touch(self, node: _Node | None) -> None:
        now = next(self._clock)
        while node is not None:
            node.last_used = now
            node = node.parent

    def _evict(self, target: int) -> None:
        """Drop least recently used leaves until at most `target` tokens are held."""
        leaves = [(n.last_used, id(n), n) for n in self._nodes() if not n.children]
        heapq.heapify(leaves)
        while self._size > target and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.tokens[0]]
            self._size -= len(leaf.tokens)
            if parent is not self._root and not parent.children:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))

    def _nodes(self) -> list[_Node]:
        found, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            found.append(node)
            stack.extend(node.children.values())
        return found


def _common(edge: tuple[int, ...], ids: list[int]) -> int:
    """Length of the common prefix of an edge and the ids that follow it."""
    for i, (a, b) in enumerate(zip(edge, ids, strict=False)):  # either may be shorter
        if a != b:
            return i
    return min(len(edge), len(ids))
