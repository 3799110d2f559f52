"""Where an answer ends (common/answer_ends.py): an abort that lands on an answer's last
step is settled as the completion SGLang's next check would have made (resume.ended),
the tokenize stage refuses an answer that runs past its end or over its budget, and only
sampling that a continuation draws the same moves (resume.why_not_movable)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import redis

from regen.common import jobspec
from regen.common.answer_ends import (
    misplaced_end,
    request_end_ids,
    server_end_ids,
    where_it_ends,
)
from regen.common.chat_family import detect_family
from regen.common.provenance import effective_sampling
from regen.common.record import Reason, build_record
from regen.consumers.generate.engine import GenerateResult
from regen.consumers.generate.placement.resume import ended, joined, why_not_movable
from tests.common.test_record import IM_END, failure, ids, make_ctx, make_result, make_spec

EOS = 2
ENDS = frozenset({EOS, 9})


def handed(output_ids: list[int], **fields: Any) -> GenerateResult:
    """An answer so far, as an abort the worker asked for returns it."""
    answer: dict[str, Any] = {
        "output_ids": output_ids, "text": "so far", "prompt_tokens": 5,
        "finish_reason": {"type": "abort", "message": None},
        "completion_tokens": len(output_ids), "handed_over": True,
    }  # fmt: skip
    return GenerateResult(**{**answer, **fields})


def test_an_answer_ends_at_its_first_end_token_or_its_budget() -> None:
    assert where_it_ends([5, 6, 7], ENDS, 10) is None
    assert where_it_ends([5, 6, EOS], ENDS, 10) == (3, {"type": "stop", "matched": EOS})
    # Speculative decoding accepted tokens past the end: the first end counts.
    assert where_it_ends([5, 9, 7, EOS, 8], ENDS, 10) == (2, {"type": "stop", "matched": 9})
    # SGLang checks the length first: an end on the budget's last token is "length".
    assert where_it_ends([5, 6, EOS], ENDS, 3) == (3, {"type": "length", "length": 3})
    assert where_it_ends([5, 6, 7, 8], ENDS, 3) == (3, {"type": "length", "length": 3})
    assert where_it_ends([5, 6, 7], frozenset(), 10) is None  # ignore_eos: no end token


def test_the_ids_that_end_a_request_are_the_models_and_its_own_unless_it_ignores_eos() -> None:
    assert request_end_ids([2, 3], {"stop_token_ids": [7]}) == {2, 3, 7}
    assert request_end_ids([2, 3], {"ignore_eos": True, "stop_token_ids": [7]}) == set()
    assert misplaced_end([5, EOS, 6, EOS], ENDS) == 1
    assert misplaced_end([5, 6, EOS], ENDS) is None


def test_an_abort_on_the_last_step_is_the_answer_it_ended_as() -> None:
    """The abort landed on the step that decoded the end of turn: the reply carries it,
    finish "abort". Settled, it is a completion (no hand-over); the old code gave the
    prompt back with the end token in its answer so far."""
    at_end = ended(handed([5, 6, EOS]), ENDS, budget=10)
    assert not at_end.handed_over
    assert at_end.output_ids == [5, 6, EOS] and at_end.completion_tokens == 3
    assert at_end.finish_reason == {"type": "stop", "matched": EOS}
    assert at_end.text is None  # the stages decode the ids as SGLang's detokenizer would
    past = ended(handed([5, EOS, 6, 7]), ENDS, budget=10)  # speculative decoding
    assert past.output_ids == [5, EOS] and past.finish_reason["type"] == "stop"
    full = ended(handed([5, 6, 7, 8]), ENDS, budget=4)  # the step that reached the budget
    assert full.finish_reason == {"type": "length", "length": 4} and not full.handed_over
    # Not ended: the answer so far moves, untouched.
    running = handed([5, 6, 7])
    assert ended(running, ENDS, budget=10) is running
    # A completion is never touched, whatever it holds.
    done = dataclasses.replace(running, handed_over=False, finish_reason={"type": "length"})
    assert ended(done, ENDS, budget=2) is done


def test_a_continued_answer_that_reaches_its_budget_ends_there() -> None:
    """The answer so far (3 tokens) was continued with the 2 tokens left, and handed over
    again on the step that reached the budget: it ends as "length", 5 tokens in all."""
    again = joined(handed([7, 8], prompt_tokens=8), [4, 5, 6])
    settled = ended(dataclasses.replace(again, handed_over=True), ENDS, budget=5)
    assert settled.output_ids == [4, 5, 6, 7, 8] and settled.resumed_tokens == 3
    assert settled.finish_reason == {"type": "length", "length": 5}


def test_the_tokenize_stage_refuses_an_answer_past_its_end_or_over_its_budget(
    kimi_tokenizer: Any,
) -> None:
    """Whatever made it: a record with an end of turn inside its answer, or more answer
    tokens than max_new_tokens, goes to the dead-letter queue with its reason."""
    ctx = make_ctx(kimi_tokenizer, on_truncated="keep")
    answer = ids(kimi_tokenizer, "Four.")
    glued = [*answer, IM_END, *ids(kimi_tokenizer, " And more."), IM_END]
    assert failure(make_result(ctx, glued), ctx) == Reason.END_INSIDE_ANSWER
    long = ids(kimi_tokenizer, " four" * 70)
    assert len(long) > ctx.spec.sampling["max_new_tokens"]
    assert failure(make_result(ctx, long, finish={"type": "length"}), ctx) == Reason.OVER_BUDGET
    # The request's own stop_token_ids end an answer too.
    stop_at = answer[1]
    sampling = {**ctx.spec.sampling, "stop_token_ids": [stop_at]}
    early = make_result(ctx, [*answer, IM_END], sampling=sampling)
    assert failure(early, ctx) == Reason.END_INSIDE_ANSWER
    # With ignore_eos the server stops on no token: an end inside is what was asked.
    ignoring = {**ctx.spec.sampling, "ignore_eos": True}
    kept = build_record(make_result(ctx, glued, finish={"type": "length"}, sampling=ignoring), ctx)
    assert kept["completion_tokens"] == len(glued)
    assert build_record(make_result(ctx, [*answer, IM_END]), ctx)["finish_reason"] == "stop"


def test_the_job_spec_names_the_end_tokens_and_they_decide_the_check(
    kimi_tokenizer: Any,
) -> None:
    """The spec's end tokens (the server's) are used where it has them: a token the
    chat template does not write but the model's config ends on counts."""
    ctx = make_ctx(kimi_tokenizer, end_token_ids=[IM_END, 163585], on_truncated="keep")
    answer = ids(kimi_tokenizer, "Four.")
    assert failure(make_result(ctx, [*answer, 163585, *answer, IM_END]), ctx) == (
        Reason.END_INSIDE_ANSWER
    )


def test_the_end_tokens_are_read_from_the_tokenizer_and_the_models_configs(
    kimi_tokenizer: Any, tmp_path: Path
) -> None:
    family = detect_family(kimi_tokenizer)
    assert server_end_ids(kimi_tokenizer, family.end_of_turn_ids, None) == [IM_END]
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 163585}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END, 7]}))
    assert server_end_ids(kimi_tokenizer, family.end_of_turn_ids, tmp_path) == [7, 163585, IM_END]


def test_a_spec_from_an_older_regen_learns_its_end_tokens_when_enqueued_again(
    r: redis.Redis,
) -> None:
    old = make_spec()
    assert old.end_token_ids == []
    jobspec.save(r, old)
    newer = dataclasses.replace(old, end_token_ids=[IM_END])
    assert jobspec.save(r, newer).end_token_ids == [IM_END]
    assert jobspec.load(r, old.name).end_token_ids == [IM_END]
    assert jobspec.load(r, old.name).created == old.created  # the stored spec, filled in


@pytest.mark.parametrize(
    ("sampling", "why"),
    [
        ({"max_new_tokens": 9, "temperature": 0.6, "top_p": 0.95, "sampling_seed": 3}, None),
        ({"max_new_tokens": 9, "frequency_penalty": 0.0, "repetition_penalty": 1.0}, None),
        ({"max_new_tokens": 9, "frequency_penalty": 0.5}, "frequency_penalty"),
        ({"max_new_tokens": 9, "presence_penalty": 0.1}, "presence_penalty"),
        ({"max_new_tokens": 9, "repetition_penalty": 1.05}, "repetition_penalty"),
        ({"max_new_tokens": 9, "min_new_tokens": 4}, "min_new_tokens"),
        ({"max_new_tokens": 9, "stop": ["\n\n"]}, "stop strings"),
        ({"max_new_tokens": 9, "logit_bias": {"5": 1.0}}, "logit_bias"),
    ],
)
def test_only_sampling_a_continuation_draws_the_same_moves(
    sampling: dict[str, Any], why: str | None
) -> None:
    reason = why_not_movable(sampling)
    assert reason is None if why is None else why in (reason or "")


def test_a_penalty_the_model_sets_by_default_keeps_answers_where_they_are() -> None:
    """SGLang fills an unset repetition_penalty from generation_config.json: the job
    sets none, yet the server applies the model's."""
    job = {"max_new_tokens": 9, "temperature": 0.7}
    assert why_not_movable(job) is None
    assert "repetition_penalty" in (
        why_not_movable(effective_sampling(job, {"repetition_penalty": 1.05})) or ""
    )
