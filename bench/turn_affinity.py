"""How much of each turn's prompt the servers find cached, with and without turn
affinity (not a test; a measurement).

Runs the same synthetic conversations through the SGLang HTTP engine over several SGLang
stand-ins (each with its own prefix cache) twice, on fresh servers each time: once with
each turn carrying its conversation's affinity key, as `--turns all` sends them, once
routed by load alone. A turn's prompt is the previous turn's prompt and answer plus a
new user message, as a template that keeps the history renders it; every conversation
starts with the same system prompt. Prints each run's prefix-cache hit rate (cached
prompt tokens / prompt tokens, the servers' own count) and the ratio of the prompt
tokens each run had to prefill (not cached), which is what affinity saves.

    python bench/turn_affinity.py [--servers 4] [--conversations 64] [--turns 6]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from regen.consumers.generate.engine import GenerateRequest
from regen.consumers.generate.engines.sglang_http import SGLangHTTPEngine
from tests.support.sglang_standin.process import run_standin

VOCAB = 49_152  # SmolLM2's, the stand-in's default tokenizer
SYSTEM_TOKENS = 200
USER_TOKENS = 40
# Answers of spread lengths at a finite decode speed, so turns finish out of step and
# routing by load does not send a conversation round the servers in one fixed order.
ANSWERS = "lognormal:mean=64,sigma=0.8,min=4,max=512"
DECODE_TOKENS_PER_S = 1000.0


def user_message(rng: random.Random) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(USER_TOKENS)]


async def converse(urls: list[str], conversations: int, turns: int, affinity: bool) -> None:
    rng = random.Random(0)
    system = [rng.randrange(VOCAB) for _ in range(SYSTEM_TOKENS)]
    firsts = [system + user_message(rng) for _ in range(conversations)]
    engine = SGLangHTTPEngine(urls, max_inflight_per_server=conversations)
    await engine.wait_until_healthy(60)

    async def conversation(i: int) -> None:
        prompt, own = firsts[i], random.Random(i)
        for k in range(turns):
            request = GenerateRequest(
                f"c{i}-{k}", prompt, {"max_new_tokens": 512},
                affinity=f"c{i}" if affinity else None,
            )  # fmt: skip
            result = await engine.generate(request)
            prompt = prompt + result.output_ids + user_message(own)

    try:
        await asyncio.gather(*(conversation(i) for i in range(conversations)))
    finally:
        await engine.close()


def hit_rate(servers: int, conversations: int, turns: int, affinity: bool) -> float:
    with ExitStack() as stack:
        standins = [
            stack.enter_context(
                run_standin(output_len_dist=ANSWERS, decode_tokens_per_s=DECODE_TOKENS_PER_S)
            )
            for _ in range(servers)
        ]
        asyncio.run(converse([s.url for s in standins], conversations, turns, affinity))
        stats = [s.stats() for s in standins]
    cached = sum(s["cached_tokens_total"] for s in stats)
    prompt = sum(s["prompt_tokens_total"] for s in stats)
    return float(cached / prompt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=6)
    args = parser.parse_args()
    shape = (args.servers, args.conversations, args.turns)
    with_affinity = hit_rate(*shape, affinity=True)
    by_load = hit_rate(*shape, affinity=False)
    print(f"{args.conversations} conversations x {args.turns} turns over {args.servers} servers")
    print(f"prefix-cache hit rate, turn affinity: {with_affinity:.3f}")
    print(f"prefix-cache hit rate, least loaded:  {by_load:.3f}")
    print(
        "prompt tokens prefilled, least loaded / turn affinity: "
        f"{(1 - by_load) / (1 - with_affinity):.2f}x"
    )


if __name__ == "__main__":
    main()
