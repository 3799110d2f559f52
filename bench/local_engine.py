"""Output tokens/s of the local engine at several batch sizes, side by side in one run.

    python bench/local_engine.py [--model smollm2] [--max-new-tokens 64] [--rounds 3]

Every round runs each batch size once, interleaved, so drifting machine load touches all
sizes alike; a size's figure is its best round. Requests set ignore_eos, so every row
generates exactly --max-new-tokens tokens, and each size's requests are sent at once so
the engine runs them as one batch (checked). Figures are printed as ratios to size 1.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from regen.common.tokenizer import load_tokenizer
from regen.consumers.generate.engine import GenerateRequest
from regen.consumers.generate.engines.local import LocalEngine

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "What is 2+2?",
    "Explain photosynthesis in one sentence.", "Tell me a story about a dragon.",
    "List three fruits.", "Why is the sky blue?", "How do I boil an egg?",
    "What is a prime number?", "Describe a cat.", "Who wrote Hamlet?",
    "Give me a tip for learning Python.", "What is gravity?", "Name a famous painter.",
    "How many legs does a spider have?", "What does a compiler do?",
]  # fmt: skip


async def timed_batch(engine: LocalEngine, prompts: list[list[int]], max_new: int) -> float:
    sampling = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    batches = engine.stats()["batches"]
    started = time.perf_counter()
    await asyncio.gather(
        *(engine.generate(GenerateRequest(f"b{i}", p, sampling)) for i, p in enumerate(prompts))
    )
    elapsed = time.perf_counter() - started
    if engine.stats()["batches"] != batches + 1:
        print(f"  note: {len(prompts)} requests ran as several batches")
    return elapsed


async def main(args: argparse.Namespace) -> None:
    sizes = [int(s) for s in args.sizes.split(",")]
    tokenizer = load_tokenizer(args.model)
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        for q in QUESTIONS
    ]
    engine = LocalEngine(
        args.model, device=args.device, max_batch_size=max(sizes), batch_wait_s=0.05
    )
    loading = time.perf_counter()
    await timed_batch(engine, prompts[:1], 4)  # waits for the load
    print(f"loaded in {time.perf_counter() - loading:.1f} s on {engine.device}")
    await timed_batch(engine, prompts[: max(sizes)], 8)  # warm-up: first-call overheads
    best = dict.fromkeys(sizes, float("inf"))
    for round_no in range(1, args.rounds + 1):
        for size in sizes:
            batch = [prompts[i % len(prompts)] for i in range(size)]
            elapsed = await timed_batch(engine, batch, args.max_new_tokens)
            best[size] = min(best[size], elapsed)
            rate = size * args.max_new_tokens / elapsed
            print(f"round {round_no} size {size:>3}: {rate:7.1f} tok/s")
    await engine.close()
    base = args.max_new_tokens / best[sizes[0]]
    print(f"\n{args.max_new_tokens} new tokens per row, best of {args.rounds} rounds")
    print("batch  tok/s  ms/step  vs size " + str(sizes[0]))
    for size in sizes:
        rate = size * args.max_new_tokens / best[size]
        step_ms = 1000 * best[size] / args.max_new_tokens
        print(f"{size:>5}  {rate:5.1f}  {step_ms:7.1f}  {rate / base:6.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--sizes", default="1,4,8,16")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
