"""Benchmark build_record: records/s and tokens/s, drift check on and off, side by side.

Realistic records: Kimi-format tokenizer (the test fixture), thinking on, prompts of a
few hundred tokens and ~2K-token completions (reasoning, `</think>`, answer,
`<|im_end|>`), text as SGLang returns it. Run from the repository root:

    python bench/tokenize_records.py [--records 300] [--completion 2048] [--repeat 3]

The target is >= 400K record tokens/s in one process.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.support.fixtures

from regen.common.chat_family import detect_family, render_prompt_ids
from regen.common.jobspec import JobSpec
from regen.common.record import RecordContext, build_record
from regen.common.results import GeneratedResult
from regen.common.tokenizer import load_tokenizer
from tests.support.fixtures.kimi_tokenizer import build_kimi_tokenizer
from tests.support.sglang_standin.completer import SENTENCES

IM_END, THINK_END = 163586, 163607


def spec(kwargs: dict[str, Any]) -> JobSpec:
    return JobSpec(
        name="bench", model="kimi-fixture", tokenizer="kimi-fixture", trust_remote_code=True,
        chat_family="kimi", tokenizer_fingerprint="-", sampling={"max_new_tokens": 4096},
        chat_template_kwargs=kwargs, system_prompt=None, chunk_size=64,
        max_prompt_tokens=None, context_length=None, queue="generate",
    )  # fmt: skip


def text_of(tokenizer: Any, rng: random.Random, n_tokens: int) -> str:
    parts: list[str] = []
    while len(tokenizer.encode(" ".join(parts), add_special_tokens=False)) < n_tokens:
        parts.extend(rng.choice(SENTENCES) for _ in range(1 + n_tokens // 200))
    return " ".join(parts)


def make_results(tokenizer: Any, n: int, completion: int, seed: int) -> list[GeneratedResult]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        messages = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": text_of(tokenizer, rng, rng.randint(50, 400))},
        ]
        prompt_ids = render_prompt_ids(tokenizer, messages, {})
        reasoning = text_of(tokenizer, rng, int(completion * 0.6))
        answer = text_of(tokenizer, rng, int(completion * 0.4))
        enc = tokenizer.encode
        output_ids = [
            *enc(reasoning, add_special_tokens=False), THINK_END,
            *enc(answer, add_special_tokens=False), IM_END,
        ]  # fmt: skip
        out.append(GeneratedResult(
            id=f"p{i:06d}", job="bench", chunk="c0", prompt_ids=prompt_ids, messages=messages,
            source={"file": "bench", "row": i}, output_ids=output_ids,
            text=f"{reasoning}</think>{answer}", finish_reason={"type": "stop", "matched": IM_END},
            prompt_tokens=len(prompt_ids), completion_tokens=len(output_ids), cached_tokens=0,
            latency_s=1.0, server="bench", worker="bench", attempt=0,
        ))  # fmt: skip
    return out


def measure(results: list[GeneratedResult], ctx: RecordContext, repeat: int) -> tuple[float, int]:
    """Best wall time of `repeat` passes, and the record tokens one pass makes."""
    best, tokens = float("inf"), 0
    for _ in range(repeat):
        start = time.perf_counter()
        tokens = sum(len(build_record(r, ctx)["input_ids"]) for r in results)
        best = min(best, time.perf_counter() - start)
    return best, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=300)
    parser.add_argument("--completion", type=int, default=2048, help="completion tokens")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    folder = build_kimi_tokenizer(Path(tempfile.mkdtemp(prefix="kimi-bench-")))
    tokenizer = load_tokenizer(str(folder), trust_remote_code=True)
    family = detect_family(tokenizer)
    results = make_results(tokenizer, args.records, args.completion, seed=1)
    completion = sum(r.completion_tokens for r in results) / len(results)
    prompt = sum(r.prompt_tokens for r in results) / len(results)
    print(f"{len(results)} records, mean {prompt:.0f} prompt + {completion:.0f} completion tokens")

    print(
        f"{'drift check':<12} {'records/s':>10} {'tokens/s':>12} {'ms/record':>10} {'drifted':>8}"
    )
    for drift_check in (True, False):
        ctx = RecordContext(spec=spec({}), tokenizer=tokenizer, family=family,
                            drift_check=drift_check)  # fmt: skip
        build_record(results[0], ctx)  # warm caches (the template, the thinking probe)
        drifted = sum(bool(build_record(r, ctx)["drift"]) for r in results)
        seconds, tokens = measure(results, ctx, args.repeat)
        print(f"{'on' if drift_check else 'off':<12} {len(results) / seconds:>10,.0f} "
              f"{tokens / seconds:>12,.0f} {1e3 * seconds / len(results):>10.2f} "
              f"{drifted:>8}")  # fmt: skip


if __name__ == "__main__":
    main()
