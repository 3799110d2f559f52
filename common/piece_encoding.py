"""Encoding rendered chats piece by piece, remembering the pieces prompts share.

A `tokenizers` pipeline first splits text at its added tokens, then pre-tokenizes and
encodes each piece between them on its own. Where every step after that split treats a
piece alike wherever it stands (`encodes_piecewise`), the ids of a text are the ids of
its pieces and split tokens in order. Prompts of one dataset share many pieces: the
system prompt, role headers, the generation prompt. The byte-level pre-tokenizer's regex
is most of a short prompt's encoding cost, so a piece seen recently is looked up instead
of encoded again (docs/design/records.md, "Chat formats").

A token splits text here only where the pipeline itself always splits there (`split_at`):
otherwise the pieces would be cut differently and the ids could differ.
"""

from __future__ import annotations

import functools
import re
import weakref
from typing import Any

# A tokenizer (`tokenizers` library) whose pipeline encodes the text between added tokens
# piece by piece, each piece alike wherever it stands: no normalizer, or NFC (per piece),
# and a byte-level pre-tokenizer that adds no prefix space (which only the first piece
# would get).
_PIECEWISE_NORMALIZERS = (None, "NFC")
# Pieces remembered per tokenizer, and the longest one remembered (in characters): at
# most ~128 x 32K characters of text and their ids (~40 MB) stay in memory; a system
# prompt of a few thousand tokens fits.
MEMO_PIECES = 128
MEMO_MAX_CHARS = 32 * 1024
_WORD_CHAR = re.compile(r"\w")


def encodes_piecewise(backend: Any) -> bool:
    """Whether the pipeline encodes each piece between added tokens alike wherever it
    stands, and decodes the bytes back exactly (byte-level)."""
    normalizer = backend.normalizer
    if (None if normalizer is None else type(normalizer).__name__) not in _PIECEWISE_NORMALIZERS:
        return False
    if type(backend.decoder).__name__ != "ByteLevel":
        return False
    if getattr(backend.model, "dropout", None):  # BPE dropout: no encoding is repeatable
        return False
    pre = backend.pre_tokenizer
    steps = list(pre) if type(pre).__name__ == "Sequence" else [pre]
    kinds = [type(step).__name__ for step in steps]
    return (
        bool(kinds)
        and kinds[-1] == "ByteLevel"
        and set(kinds) <= {"Split", "ByteLevel"}
        and not any(getattr(step, "add_prefix_space", False) for step in steps)
    )


def split_at(backend: Any) -> dict[str, int]:
    """The added tokens (content -> id) the pipeline splits at wherever their text
    stands; empty when it does not encode piecewise.

    The pipeline finds added tokens leftmost first, then longest. A token is split at
    wherever it stands when it is matched as is (not normalized first), takes no
    neighbouring whitespace (lstrip, rstrip) and needs no word boundary (single_word),
    starts and ends with a non-word character (so another token's word-boundary check
    sees the same neighbour in a piece as in the whole text), and no other added token
    could match over any of it: one that contains it, or one that ends in a beginning
    of it (starting earlier, that one would win).
    """
    if not encodes_piecewise(backend):
        return {}
    added = backend.get_added_tokens_decoder()
    contents = [token.content for token in added.values()]
    return {
        token.content: token_id
        for token_id, token in added.items()
        if not (token.normalized or token.lstrip or token.rstrip or token.single_word)
        and token.content
        and not _WORD_CHAR.match(token.content[0])
        and not _WORD_CHAR.match(token.content[-1])
        and not any(_overlaps(other, token.content) for other in contents)
    }


def _overlaps(other: str, content: str) -> bool:
    """Whether a match of `other` could take characters of `content` where it stands."""
    if other == content:
        return False
    return content in other or any(content.startswith(other[i:]) for i in range(1, len(other)))


class PieceEncoder:
    """Encodes text as its pipeline does, piece by piece between split tokens, each
    recently seen piece from memory."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self._split_ids = split_at(backend)
        longest_first = sorted(self._split_ids, key=len, reverse=True)
        # One capture group: re.split returns the pieces and the tokens between them.
        self._pattern = (
            re.compile("(" + "|".join(map(re.escape, longest_first)) + ")")
            if longest_first
            else None
        )
        self._remembered = functools.lru_cache(maxsize=MEMO_PIECES)(self._encode_piece)

    def encode(self, text: str) -> list[int]:
        """`backend.encode(text, add_special_tokens=False).ids`."""
        if self._pattern is None:
            return self._encode(text)
        parts = self._pattern.split(text)
        ids: list[int] = []
        for index, part in enumerate(parts):
            if index % 2:  # a split token
                ids.append(self._split_ids[part])
            elif len(part) > MEMO_MAX_CHARS:
                ids += self._encode(part)
            elif part:
                ids += self._remembered(part)
        return ids

    def _encode(self, text: str) -> list[int]:
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        return ids

    def _encode_piece(self, piece: str) -> tuple[int, ...]:
        return tuple(self._encode(piece))  # immutable: every caller shares it


# One encoder per tokenizer object (load_tokenizer shares one, never mutated).
_encoders: weakref.WeakKeyDictionary[Any, PieceEncoder] = weakref.WeakKeyDictionary()


def piece_encoder(tokenizer: Any, backend: Any) -> PieceEncoder:
    """The encoder of `tokenizer`, whose `tokenizers` pipeline is `backend`."""
    encoder = _encoders.get(tokenizer)
    if encoder is None or encoder._backend is not backend:
        encoder = _encoders[tokenizer] = PieceEncoder(backend)
    return encoder
