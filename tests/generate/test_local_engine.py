"""The local transformers engine, on the real SmolLM2 (CPU), loaded once for the module."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from regen.consumers.generate.engine import (
    EngineUnavailable,
    GenerateRequest,
    GenerateResult,
    PromptRejected,
)
from regen.consumers.generate.engines.local import LocalEngine
from regen.consumers.generate.engines.local_model import dequantized_copy
from tests.support.helpers import wait_for

pytestmark = pytest.mark.slow

END_OF_TURN = 2  # <|im_end|>, SmolLM2's eos
GREEDY = {"temperature": 0, "max_new_tokens": 16}
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "What is 2+2?",
    "Name three colours of the rainbow, then explain in detail how rainbows form in the sky.",
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEngine]:
    weights = tmp_path_factory.mktemp("weights")
    eng = LocalEngine("smollm2", max_batch_size=8, batch_wait_s=0.05, cache_dir=weights)
    yield eng
    asyncio.run(eng.close())


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer: Any) -> list[list[int]]:
    rendered = []
    for question in QUESTIONS:
        text = smollm2_tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        rendered.append(smollm2_tokenizer.encode(text, add_special_tokens=False))
    return rendered


def loaded(engine: LocalEngine) -> None:
    """Wait for the model: an engine loads it on a thread of its own, and only a request
    with no outage limit waits for that by itself."""
    wait_for(
        lambda: engine.stats()["loaded"] or engine.stats()["error"],
        timeout=240,
        what="the local model to load",
    )
    assert engine.stats()["loaded"], engine.stats()["error"]


def run(engine: LocalEngine, *asks: tuple[list[int], dict[str, Any]]) -> list[Any]:
    """Send all requests concurrently; results (or exceptions) in order."""

    async def main() -> list[Any]:
        requests = [GenerateRequest(f"r{i}", ids, params) for i, (ids, params) in enumerate(asks)]
        return await asyncio.gather(*map(engine.generate, requests), return_exceptions=True)

    return asyncio.run(main())


def one(engine: LocalEngine, ids: list[int], sampling: dict[str, Any]) -> GenerateResult:
    (result,) = run(engine, (ids, sampling))
    assert isinstance(result, GenerateResult), result
    return result


def test_greedy_answer_is_real_and_ends_with_the_end_of_turn_token(
    engine: LocalEngine, prompts: list[list[int]], smollm2_tokenizer: Any
) -> None:
    result = one(engine, prompts[0], GREEDY)
    assert "Paris" in result.text
    assert result.output_ids[-1] == END_OF_TURN
    assert result.finish_reason == {"type": "stop", "matched": END_OF_TURN}
    assert result.text == smollm2_tokenizer.decode(result.output_ids[:-1])
    assert result.completion_tokens == len(result.output_ids)
    assert result.prompt_tokens == len(prompts[0])
    assert asyncio.run(engine.health())


def test_length_limit_gives_exactly_max_new_tokens(
    engine: LocalEngine, prompts: list[list[int]], smollm2_tokenizer: Any
) -> None:
    result = one(engine, prompts[1], {"temperature": 0, "max_new_tokens": 5})
    assert result.finish_reason == {"type": "length", "length": 5}
    assert len(result.output_ids) == 5
    assert result.text == smollm2_tokenizer.decode(result.output_ids, skip_special_tokens=True)
    empty = one(engine, prompts[1], {"max_new_tokens": 0})
    assert (empty.output_ids, empty.finish_reason) == ([], {"type": "length", "length": 0})


def test_a_batch_gives_each_prompt_what_it_gets_alone(
    engine: LocalEngine, prompts: list[list[int]]
) -> None:
    # Prompts of different lengths: rows are left-padded, and finish at different steps.
    alone = [one(engine, ids, GREEDY).output_ids for ids in prompts]
    batches = engine.stats()["batches"]
    together = run(engine, *((ids, GREEDY) for ids in prompts))
    assert engine.stats()["batches"] == batches + 1  # all four in one batch
    assert [r.meta["batch_size"] for r in together] == [len(prompts)] * len(prompts)
    assert [r.output_ids for r in together] == alone
    assert {r.finish_reason["type"] for r in together} == {"stop", "length"}


def test_repetition_penalty_ignores_the_padding(
    engine: LocalEngine, prompts: list[list[int]]
) -> None:
    sampling = {"temperature": 0, "max_new_tokens": 12, "repetition_penalty": 1.3}
    short, long = prompts[2], prompts[3]  # the short one is left-padded in the batch
    alone = [one(engine, ids, sampling).output_ids for ids in (short, long)]
    together = run(engine, (short, sampling), (long, sampling))
    assert [r.output_ids for r in together] == alone
    assert alone[0] != one(engine, short, {**sampling, "repetition_penalty": 1.0}).output_ids


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(
    engine: LocalEngine, prompts: list[list[int]]
) -> None:
    sampling = {"temperature": 0.9, "top_p": 0.95, "max_new_tokens": 24, "seed": 1234}
    first = one(engine, prompts[1], sampling)
    assert first.meta["seed"] == 1234
    assert one(engine, prompts[1], sampling).output_ids == first.output_ids
    others = [(prompts[i], {**sampling, "seed": 7 + i}) for i in (0, 2)]
    batched = run(engine, others[0], (prompts[1], sampling), others[1])
    assert batched[1].meta["batch_size"] == 3
    assert batched[1].output_ids == first.output_ids
    # Without a seed the draw is random, but the seed it used is reported and replays it.
    unseeded = one(engine, prompts[1], {k: v for k, v in sampling.items() if k != "seed"})
    replay = one(engine, prompts[1], {**sampling, "seed": unseeded.meta["seed"]})
    assert replay.output_ids == unseeded.output_ids


def test_stop_token_ids_and_ignore_eos(
    engine: LocalEngine, prompts: list[list[int]], smollm2_tokenizer: Any
) -> None:
    answer = one(engine, prompts[0], GREEDY).output_ids  # "The capital of France is Paris."
    stop_at = answer[3]
    stopped = one(engine, prompts[0], {**GREEDY, "stop_token_ids": [stop_at]})
    assert stopped.output_ids == answer[:4]
    assert stopped.finish_reason == {"type": "stop", "matched": stop_at}
    assert stopped.text == smollm2_tokenizer.decode(answer[:3])  # the stop token trimmed
    # As in SGLang the length limit is checked first, even when the last token is a stop.
    exact = one(engine, prompts[0], {**GREEDY, "max_new_tokens": len(answer)})
    assert exact.output_ids == answer
    assert exact.finish_reason == {"type": "length", "length": len(answer)}
    budget = len(answer) + 4
    ignored = one(engine, prompts[0], {**GREEDY, "max_new_tokens": budget, "ignore_eos": True})
    assert ignored.finish_reason == {"type": "length", "length": budget}
    assert ignored.output_ids[: len(answer)] == answer


def test_bad_prompts_are_rejected_without_failing_their_batch(
    engine: LocalEngine, prompts: list[list[int]]
) -> None:
    too_long = [28] * 8192  # SmolLM2's context is 8192 tokens
    results = run(
        engine,
        (too_long, GREEDY),
        ([28] * 8100, {**GREEDY, "max_new_tokens": 200}),
        (prompts[2], {**GREEDY, "top_k": 0}),
        (prompts[2], {**GREEDY, "stop": ["\n"]}),
        (prompts[2], {**GREEDY, "no_such_param": 1}),
        ([10**6], GREEDY),
        (prompts[2], GREEDY),
    )
    *bad, good = results
    assert all(isinstance(r, PromptRejected) for r in bad), bad
    assert "longer than the model's context length (8192 tokens)" in bad[0].message
    assert "8100 tokens from the input messages and 200 tokens" in bad[1].message
    assert "top_k" in bad[2].message and "stop" in bad[3].message
    assert "no_such_param" in bad[4].message and "token ids" in bad[5].message
    assert isinstance(good, GenerateResult) and good.finish_reason["type"] == "stop"


def test_a_busy_loaded_engine_is_waited_out_past_the_outage_limit(
    engine: LocalEngine, prompts: list[list[int]]
) -> None:
    long_run = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
    loaded(engine)

    async def main() -> tuple[GenerateResult, GenerateResult]:
        running = asyncio.ensure_future(
            engine.generate(GenerateRequest("long", prompts[3], long_run), outage_s=0.5)
        )
        await asyncio.sleep(0.2)  # its batch runs for seconds: nothing else can start
        late = GenerateRequest("late", prompts[2], GREEDY)
        # The model is loaded: a prompt waits for the batch rather than give up.
        waited = await engine.generate(late, outage_s=0.1)
        return await running, waited

    result, waited = asyncio.run(main())
    assert result.finish_reason == {"type": "length", "length": 48}
    assert waited.output_ids


def test_engines_share_one_model_and_a_closed_engine_refuses_work(
    engine: LocalEngine, prompts: list[list[int]]
) -> None:
    other = LocalEngine("smollm2", max_batch_size=2, cache_dir=engine._load_args[-1])
    assert one(other, prompts[2], GREEDY).output_ids == one(engine, prompts[2], GREEDY).output_ids
    assert other._loaded is engine._loaded  # loaded once per process
    asyncio.run(other.close())
    assert not asyncio.run(other.health())
    with pytest.raises(EngineUnavailable):
        asyncio.run(other.generate(GenerateRequest("late", prompts[2], GREEDY)))


def test_dequantized_weights_cache_is_exact(engine: LocalEngine) -> None:
    loaded(engine)
    cache_dir = engine._load_args[-1]
    assert isinstance(cache_dir, Path)
    entry = dequantized_copy(engine.ref, cache_dir)  # a hit: built when the engine loaded
    assert entry is not None and (entry / "regen-cache.json").is_file()
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(str(entry), local_files_only=True)
    assert engine._loaded is not None
    live = engine._loaded.model.state_dict()
    assert all(torch.equal(t, live[k]) for k, t in reloaded.state_dict().items())


def test_a_model_that_fails_to_load_makes_the_engine_unavailable(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")  # a folder, but no model in it
    broken = LocalEngine(str(tmp_path), cache=False)
    with pytest.raises(EngineUnavailable, match="failed to load"):
        asyncio.run(broken.generate(GenerateRequest("r", [1, 2], GREEDY)))
    assert not asyncio.run(broken.health())
    assert broken.stats()["error"]
    asyncio.run(broken.close())
