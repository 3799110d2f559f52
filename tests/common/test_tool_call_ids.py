"""Tool calls a model writes without ids (Hermes style: Qwen, SmolLM2) get ids of their
own, derived from the record they are in and the call's place in it, so the next turn's
tool results answer them, and a rerun gives the same ids (issue #20, bug 1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from regen.common import jobspec
from regen.common.celery_app import make_app
from regen.common.chat_family import detect_family, render_prompt_ids
from regen.common.chunk import ChunkPrompt
from regen.common.conversation import turn_id
from regen.common.record import build_record
from regen.consumers.generate.engine import GenerateResult
from regen.consumers.generate.job_chat import JobChat
from regen.consumers.generate.turn_state import Turn, next_turn
from regen.producer.conversations import split_turns
from regen.producer.enqueue import Enqueuer
from regen.producer.rows import to_prompt
from regen.producer.spec import JobOptions, prepare_job
from tests.common.test_record import hermes_tokenizer_dir, make_ctx, make_result
from tests.generate.test_turns_stage import by_turn, tokenize, verified, worker
from tests.support.generate_harness import all_generated, results
from tests.support.helpers import wait_for, write_jsonl
from tests.support.sglang_standin import run_standin

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# Two turns: the model's call, then its answer on the dataset's tool result.
ROW = {
    "id": "weather",
    "tools": [{"type": "function", "function": WEATHER}],
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "dataset_call", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "dataset_call", "name": "get_weather",
         "content": "18 C, sunny"},
        {"role": "assistant", "content": "18 C and sunny."},
    ],
}  # fmt: skip


@pytest.fixture(scope="module")
def hermes_dir(smollm2_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hermes_tokenizer_dir(smollm2_tokenizer, tmp_path_factory.mktemp("hermes-model"))


@pytest.fixture(scope="module")
def chat(hermes_dir: Path) -> JobChat:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hermes_dir), local_files_only=True)
    return JobChat(tokenizer, detect_family(tokenizer), {})


def first_turn(chat: JobChat) -> Turn:
    first, conversation = split_turns(to_prompt(ROW))
    prompt_ids = chat.render(first.messages, first.tools)
    prompt = ChunkPrompt(turn_id(conversation.id, 0), prompt_ids, first.messages, {},
                         tools=first.tools, conversation=conversation)  # fmt: skip
    return Turn(prompt, conversation, 0)


def hermes_output(chat: JobChat, text: str) -> GenerateResult:
    output = [*chat.tokenizer.encode(text, add_special_tokens=False), 2]  # <|im_end|>
    return GenerateResult(output, text, {"type": "stop", "matched": 2}, 0, len(output))


def test_a_call_without_id_gets_one_from_its_turn_and_the_next_turn_answers_it(
    chat: JobChat,
) -> None:
    turn = first_turn(chat)
    output = hermes_output(chat, "Checking.\n" + CALL_TEXT)
    answer = chat.answer(turn.prompt.prompt_ids, output, turn.prompt.tools, {},
                         record_id=turn.prompt.id)  # fmt: skip
    (call,) = answer["tool_calls"]
    assert call["id"] == f"call_{turn.prompt.id}_0"
    # The same output read again (a rerun, or the tokenize stage) gives the same id.
    again = chat.answer(turn.prompt.prompt_ids, output, turn.prompt.tools, {},
                        record_id=turn.prompt.id)  # fmt: skip
    assert again == answer

    second = next_turn(turn, answer)
    assert second is not None
    assert second.prompt.messages[-1] == {
        "role": "tool", "tool_call_id": call["id"], "name": "get_weather",
        "content": "18 C, sunny",
    }  # fmt: skip
    # An answer checkpointed without ids (by a worker before they were given) resumes
    # the same way; it was a KeyError 'id', and the chunk was retried forever.
    bare = {**answer, "tool_calls": [{k: v for k, v in call.items() if k != "id"}]}
    resumed = next_turn(turn, bare)
    assert resumed is not None and resumed.prompt.messages == second.prompt.messages


def test_the_record_holds_the_same_ids_as_the_history(hermes_dir: Path, chat: JobChat) -> None:
    ctx = make_ctx(chat.tokenizer, chat_family="chatml")
    turn = first_turn(chat)
    output = hermes_output(chat, CALL_TEXT + CALL_TEXT)  # two calls, in order
    result = make_result(ctx, output.output_ids, id=turn.prompt.id, messages=turn.prompt.messages,
                         tools=turn.prompt.tools, prompt_ids=turn.prompt.prompt_ids,
                         prompt_tokens=len(turn.prompt.prompt_ids))  # fmt: skip
    record = build_record(result, ctx)
    answer = chat.answer(turn.prompt.prompt_ids, output, turn.prompt.tools, {},
                         record_id=turn.prompt.id)  # fmt: skip
    assert record["messages"][-1] == answer
    assert [c["id"] for c in answer["tool_calls"]] == [
        f"call_{turn.prompt.id}_0", f"call_{turn.prompt.id}_1",
    ]  # fmt: skip
    # Ids the model wrote itself (Kimi's) are kept: tested in test_record.


@pytest.mark.slow
def test_turns_all_with_hermes_calls_without_ids_finishes(
    redis_url: str, r: redis.Redis, tmp_path: Path, hermes_dir: Path
) -> None:
    path = write_jsonl(tmp_path / "h.jsonl", [ROW])
    prepared = prepare_job(JobOptions(job="h", model=str(hermes_dir), turns="all",
                                      max_new_tokens=64))  # fmt: skip
    spec = prepared.spec
    jobspec.save(r, spec)
    Enqueuer(r, make_app(redis_url), prepared, high_water=100).run([path])
    with (
        run_standin(tokenizer=str(hermes_dir), output_len_dist="fixed:n=4",
                    answer_suffix="\n" + CALL_TEXT) as server,
        worker(redis_url, tmp_path, server),
    ):  # fmt: skip
        # Before the fix the chunk failed with KeyError 'id' on every delivery.
        wait_for(lambda: all_generated(r, spec), timeout=90, what="both turns generated")
    sent = {res.id: res for res in results(r, "h")}
    assert len(sent) == 2
    found = by_turn(tokenize(r, tmp_path / "out", "h", 2))
    (conversation,) = {cid for cid, _ in found}
    first, second = found[conversation, 0], found[conversation, 1]
    (call,) = first["messages"][-1]["tool_calls"]
    function = {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    assert call == {"id": f"call_{first['id']}_0", "type": "function", "function": function}
    # The next turn was rendered on that answer, its tool result answering that id.
    assert second["messages"][1] == first["messages"][-1]
    assert second["messages"][2]["tool_call_id"] == call["id"]
    assert second["messages"][-1]["tool_calls"][0]["id"] == f"call_{second['id']}_0"
    for record in (first, second):
        assert record["input_ids"] == sent[record["id"]].prompt_ids + sent[record["id"]].output_ids
        assert record["drift"] is False
        assert sent[record["id"]].prompt_ids == render_prompt_ids(
            spec_tokenizer(hermes_dir), record["messages"][:-1], {}, record["tools"]
        )
    assert verified(redis_url, "h", tmp_path / "out")["ok"]


def spec_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
