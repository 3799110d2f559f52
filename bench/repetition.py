"""The repetition flag's detector (common/repetition.py): false positives on clean text,
recall on made loops, and its cost per record.

Clean text is what this machine ships, tokenized with the Kimi-format tokenizer (the test
fixture): Python's own documentation (`pydoc_data.topics`: prose, grammar, code samples)
and the long descriptions of every installed package (READMEs: markdown, tables, lists,
code, changelogs), both far more repetitive in shape than a chat answer. Each text is cut
every `--step` tokens from its 256th on, and each cut is one "answer" whose tail is checked,
so the cases end anywhere, as a truncated answer does.

Made loops: a clean lead (64 to 2,000 tokens), then a span of the same text (its period,
log-uniform from 1 to 1,024 tokens) repeated 4 to 16 times (at least 128 tokens), cut
inside its last copy (so some hold fewer than 4 whole copies, which the rule does not
call a loop; recall is given over all and over those with 4 or more); each copy's tokens
are replaced at random with probability 0, 2% or 5% (sampling varies a loop a little).
Run from the repository root:

    python bench/repetition.py [--step 64] [--loops 2000] [--seed 0]

The target is a false-positive rate <= 0.5%.
"""

from __future__ import annotations

import argparse
import email
import importlib.metadata
import math
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.support.fixtures

import pydoc_data.topics

from regen.common.repetition import MIN_REPEATS, WINDOW, tail_loop
from regen.common.tokenizer import load_tokenizer
from tests.support.fixtures.kimi_tokenizer import build_kimi_tokenizer

NOISE_LEVELS = (0.0, 0.02, 0.05)
MIN_TEXT_TOKENS = 256


def clean_texts() -> Iterator[tuple[str, str]]:
    """(source, text) for every clean text on this machine."""
    for name, text in pydoc_data.topics.topics.items():
        yield f"pydoc:{name}", text
    for dist in importlib.metadata.distributions():
        raw = dist.read_text("METADATA")
        if not raw:
            continue
        body = email.message_from_string(raw).get_payload()
        if isinstance(body, str) and body.strip():
            yield f"readme:{dist.metadata['Name']}", body


def made_loop(
    rng: random.Random, ids: list[int], vocab: int, noise: float
) -> tuple[list[int], float]:
    """A clean lead then a loop cut inside its last copy; (ids, copies in the loop)."""
    lead = ids[: rng.randint(64, min(2000, len(ids) - 1))]
    period = max(1, int(math.exp(rng.uniform(0, math.log(1024)))))
    period = min(period, len(ids) - 1)
    start = rng.randrange(0, len(ids) - period)
    unit = ids[start : start + period]
    copies = rng.randint(4, 16)
    length = max(copies * period, 128)
    loop = [unit[i % period] for i in range(length - rng.randrange(period))]
    loop = [rng.randrange(vocab) if rng.random() < noise else t for t in loop]
    return lead + loop, len(loop) / period


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step", type=int, default=64, help="cut every N tokens")
    parser.add_argument("--loops", type=int, default=2000, help="made loops per noise level")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = load_tokenizer(str(build_kimi_tokenizer(Path(tmp))), trust_remote_code=True)
    encoded = []
    for source, text in clean_texts():
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= MIN_TEXT_TOKENS:
            encoded.append((source, ids))
    print(f"clean texts: {len(encoded)} of >= {MIN_TEXT_TOKENS} tokens, "
          f"{sum(len(ids) for _, ids in encoded):,} tokens")  # fmt: skip

    cases = flagged = 0
    examples: list[str] = []
    for source, ids in encoded:
        for cut in range(MIN_TEXT_TOKENS, len(ids) + 1, args.step):
            cases += 1
            loop = tail_loop(ids[max(0, cut - WINDOW) : cut])
            if loop is not None:
                flagged += 1
                if len(examples) < 8:
                    tail = tokenizer.decode(ids[cut - min(loop.span, 60) : cut])
                    examples.append(f"  {source} @{cut}: period {loop.period}, "
                                    f"span {loop.span}: ...{tail!r}")  # fmt: skip
    print(f"false positives: {flagged} of {cases} clean cuts = {flagged / cases:.3%} "
          f"(target <= 0.5%)")  # fmt: skip
    print("\n".join(examples))

    rng = random.Random(args.seed)
    vocab = len(tokenizer)
    longest = [ids for _, ids in encoded if len(ids) >= 2200]
    for noise in NOISE_LEVELS:
        found = full = found_full = 0
        for _ in range(args.loops):
            ids, copies = made_loop(rng, rng.choice(longest), vocab, noise)
            hit = tail_loop(ids) is not None
            found += hit
            if copies >= MIN_REPEATS:
                full += 1
                found_full += hit
        print(
            f"recall, noise {noise:.0%}: {found / args.loops:.3f} of all {args.loops} loops, "
            f"{found_full / full:.3f} of the {full} with >= {MIN_REPEATS} copies"
        )

    outputs = [made_loop(rng, rng.choice(longest), vocab, 0.0)[0][-8192:] for _ in range(50)]
    outputs += [ids[-8192:] for ids in longest[:50]]
    start = time.perf_counter()
    for ids in outputs:
        tail_loop(ids)
    per_call = (time.perf_counter() - start) / len(outputs)
    print(f"cost: {per_call * 1e6:.0f} us per output of up to 8,192 tokens "
          f"({len(outputs)} outputs, half loops, half clean)")  # fmt: skip


if __name__ == "__main__":
    main()
