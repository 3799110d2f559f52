"""`--turns all` without workers: splitting rows into turns, enqueueing and accounting
every turn, rendering a next turn from the target's answer, requeue and plan."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from click.testing import CliRunner

from regen.cli_dlq import dlq_group
from regen.cli_plan import plan
from regen.common import dlq, jobspec, keys
from regen.common.chat_family import render_prompt_ids
from regen.common.chunk import Chunk, ChunkPrompt
from regen.common.conversation import Conversation, turn_id
from regen.common.ledger.commit_ledger import CommitLedger
from regen.common.ledger.places import count_places
from regen.consumers.generate.chunk_context import ChunkContext
from regen.consumers.generate.chunk_runner import run_chunk
from regen.consumers.generate.engine import GenerateResult
from regen.consumers.generate.job_chat import load_job_chat
from regen.consumers.generate.turn_state import ToolCallDiverged, Turn, next_turn, resume
from regen.consumers.tokenize.shard_files import ShardInfo
from regen.producer.conversations import split_turns
from regen.producer.rows import BadRow, to_prompt
from regen.producer.spec import JobOptions, prepare_job
from tests.common.test_record import IM_END, make_spec
from tests.producer.test_enqueue import enqueue
from tests.support.helpers import job_ids, queued_chunks, write_jsonl

SYSTEM = {"role": "system", "content": "You answer briefly."}
USER_TURNS = [
    {"role": "user", "content": "Name a planet."},
    {"role": "user", "content": "Name another one, please."},
    {"role": "user", "content": "And one of its moons?"},
]


def conversation_row(*answers: str, users: list[dict[str, str]] = USER_TURNS) -> dict[str, Any]:
    """A row alternating the user turns with the dataset's answers."""
    messages: list[dict[str, str]] = [SYSTEM]
    for user, answer in zip(users, answers, strict=True):
        messages += [user, {"role": "assistant", "content": answer}]
    return {"id": "conv-1", "messages": messages}


# Three user turns, each with the dataset's (another model's) answer.
ROW = conversation_row("DATASET ANSWER ONE", "DATASET ANSWER TWO", "DATASET ANSWER THREE")


def test_a_conversation_splits_into_its_turns_without_the_datasets_answers() -> None:
    first, conversation = split_turns(to_prompt(ROW))
    assert first.messages == [SYSTEM, USER_TURNS[0]] and first.source_id == "conv-1"
    assert conversation.later == [[USER_TURNS[1]], [USER_TURNS[2]]]
    assert conversation.start == 0 and conversation.end == 3
    assert conversation.turn_ids() == [turn_id(conversation.id, k) for k in range(3)]
    assert b"DATASET" not in orjson.dumps([first.messages, conversation.later])

    # The id follows the user turns and where the answers go, not the answers' text.
    _, same = split_turns(to_prompt(conversation_row("other", "words", "here")))
    assert same.id == conversation.id
    two_in_a_row = {"messages": [*ROW["messages"][:3], ROW["messages"][2], *ROW["messages"][3:]]}
    _, doubled = split_turns(to_prompt(two_in_a_row))
    assert doubled.id == conversation.id and doubled.end == 3  # one turn, two messages
    merged = {"messages": [SYSTEM, *USER_TURNS[:2]]}  # two user messages, one turn
    first_merged, one_turn = split_turns(to_prompt(merged))
    assert one_turn.end == 1 and first_merged.messages == merged["messages"]
    assert one_turn.id != conversation.id


def test_an_assistant_turn_before_any_user_turn_is_refused() -> None:
    row = {"messages": [SYSTEM, {"role": "assistant", "content": "Hi!"}, USER_TURNS[0]]}
    with pytest.raises(BadRow) as refused:
        split_turns(to_prompt(row))
    assert refused.value.reason == "bad_order" and "before any user turn" in refused.value.message


def test_a_spec_stored_before_turns_means_the_last_turn() -> None:
    spec = make_spec()
    stored = orjson.loads(spec.to_json())
    del stored["turns"]
    assert jobspec.JobSpec.from_json(orjson.dumps(stored)).turns == "last"
    with pytest.raises(jobspec.JobSpecError, match="turns must be one of last, all"):
        make_spec(turns="every")
    assert make_spec(turns="all").differences(spec) == ["turns: stored 'last', given 'all'"]


def test_enqueue_accounts_every_turn_of_a_conversation(
    redis_url: str, r: redis.Redis, tmp_path: Path, smollm2_tokenizer: Any
) -> None:
    single = {"prompt": "Say hello."}
    path = write_jsonl(tmp_path / "d.jsonl", [ROW, ROW, single])
    stats = enqueue(redis_url, [path], turns="all", chunk_size=4)
    spec = jobspec.load(r, "j")
    assert spec.turns == "all"
    assert stats.enqueued == 4 and stats.duplicates == 1 and stats.chunks == 1

    (chunk,) = queued_chunks(r, spec.queue)
    conv, one = (ChunkPrompt.from_payload(p) for p in chunk["prompts"])
    assert conv.conversation is not None and one.conversation is not None
    assert conv.id == turn_id(conv.conversation.id, 0) and conv.conversation.end == 3
    assert conv.prompt_ids == render_prompt_ids(smollm2_tokenizer, conv.messages, {})
    assert conv.messages == [SYSTEM, USER_TURNS[0]]
    turns = {*conv.accounted_ids, *one.accounted_ids}
    assert job_ids(r, "j") == turns
    assert r.hget(keys.job_chunks("j"), chunk["chunk"]) == b"4"
    places = count_places(r, spec)
    assert places.total == places.waiting == 4 and places.unplaced == 0

    again = enqueue(redis_url, [path], turns="all", chunk_size=4)
    assert again.enqueued == 0


def test_a_first_turn_too_long_blocks_its_conversation_until_requeued(
    redis_url: str, r: redis.Redis, tmp_path: Path, smollm2_tokenizer: Any
) -> None:
    first, conversation = split_turns(to_prompt(ROW))
    length = len(render_prompt_ids(smollm2_tokenizer, first.messages, {}))
    path = write_jsonl(tmp_path / "d.jsonl", [ROW])
    # Room for a prompt of length - 10 only; with 16 new tokens, of length + 34.
    stats = enqueue(redis_url, [path], turns="all", context_length=length + 50, max_new_tokens=60)
    assert stats.rejected == 1 and stats.enqueued == 0
    ids = conversation.turn_ids()
    letters = {letter.entry_id: letter for letter in dlq.entries(r, "j", "input")}
    assert set(letters) == set(ids)
    assert letters[ids[0]].reason == "prompt_too_long"
    assert [letters[i].reason for i in ids[1:]] == ["blocked", "blocked"]
    assert letters[ids[2]].payload == {"blocked_by": ids[0]}
    spec = jobspec.load(r, "j")
    places = count_places(r, spec)
    assert places.total == places.dead_lettered == 3 and places.unplaced == 0

    def requeue(*args: str) -> Any:
        return CliRunner().invoke(dlq_group, ["requeue", *args, "--redis-url", redis_url])

    alone = requeue(ids[1], "--set", "max_new_tokens=16")
    assert alone.exit_code == 1 and f"waits for {ids[0]}" in alone.output
    done = requeue("--all", "--set", "max_new_tokens=16")
    assert done.exit_code == 0, done.output
    assert "requeued 3 prompt(s) in 1 new chunk(s)" in done.output
    assert "left in the DLQ" not in done.output and dlq.count(r, "j", "input") == 0
    (chunk,) = queued_chunks(r, spec.queue)
    (prompt,) = (ChunkPrompt.from_payload(p) for p in chunk["prompts"])
    assert prompt.conversation == conversation and prompt.accounted_ids == ids
    assert chunk["sampling"] == {"max_new_tokens": 16}
    assert count_places(r, spec).waiting == 3


def test_a_poison_chunk_dead_letters_each_conversation_at_its_open_turn(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    """A chunk whose deliveries keep dying after its first turn was handed off: the
    conversation is dead-lettered at its second turn, on the checkpointed answer."""
    enqueue(redis_url, [write_jsonl(tmp_path / "d.jsonl", [ROW])], turns="all")
    spec = jobspec.load(r, "j")
    (payload,) = queued_chunks(r, spec.queue)
    chunk = Chunk.from_payload(payload)
    (prompt,) = chunk.prompts
    assert prompt.conversation is not None
    ids = prompt.accounted_ids
    answer = {"role": "assistant", "content": "Mars.", "reasoning_content": "Hm."}
    answers = keys.conversation_answers("j", chunk.chunk_id, prompt.conversation.id)
    r.sadd(keys.chunk_generated("j", chunk.chunk_id), ids[0])  # as turn 0's hand-off does
    r.hset(answers, "0", orjson.dumps(answer))
    started = orjson.dumps({"worker": "w", "time": 0.0, "status": "started"})
    r.rpush(keys.chunk_attempts("j", chunk.chunk_id), *[started] * 3)

    ctx = ChunkContext(redis=r, runner=None, max_attempts=3)  # type: ignore[arg-type]
    outcome = run_chunk(ctx, chunk)
    assert (outcome.generated, outcome.skipped, outcome.dead_lettered) == (0, 1, 2)
    letters = {letter.entry_id: letter for letter in dlq.entries(r, "j", "generate")}
    assert set(letters) == set(ids[1:]) and letters[ids[2]].reason == "blocked"
    poisoned = letters[ids[1]]
    assert poisoned.reason == "poison_chunk" and poisoned.payload["prompt_ids"] == []
    assert poisoned.payload["messages"] == [SYSTEM, USER_TURNS[0], answer, USER_TURNS[1]]
    assert not r.exists(answers), "the dead letter holds the history now"

    done = CliRunner().invoke(dlq_group, ["requeue", ids[1], "--redis-url", redis_url])
    assert "requeued 2 prompt(s) in 1 new chunk(s)" in done.output, done.output
    resumed = Chunk.from_payload(queued_chunks(r, spec.queue)[-1]).prompts[0]
    assert resumed.conversation == prompt.conversation.from_turn(1)
    assert resumed.accounted_ids == ids[1:] and resumed.messages == poisoned.payload["messages"]


def _lost_conversation(redis_url: str, r: redis.Redis, tmp_path: Path) -> Conversation:
    """ROW's conversation as Redis restored from a copy holding the job's spec only, then
    `regen recover` would leave it: its first turn committed to a shard."""
    enqueue(redis_url, [], turns="all")  # the job's spec, no row yet
    _, conversation = split_turns(to_prompt(ROW))
    first = conversation.turn_ids()[:1]
    shard = ShardInfo("shard-000001.jsonl.zst", 1, 10, 5, 100, 50, "0" * 64, 0.0, epoch=1)
    CommitLedger(r, "j").restore(shard.shard, shard.to_json(), first, first)
    return conversation


def test_a_conversation_redis_lost_resumes_after_its_committed_turn(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    conversation = _lost_conversation(redis_url, r, tmp_path)
    ids = conversation.turn_ids()
    answer = {"role": "assistant", "content": "Mars.", "reasoning_content": "Hm."}
    r.hset(keys.recovered_answers("j"), ids[0], orjson.dumps(answer))  # saved by recover

    stats = enqueue(redis_url, [write_jsonl(tmp_path / "d.jsonl", [ROW])], turns="all")
    assert (stats.conversations_resumed, stats.already_settled, stats.rejected) == (1, 0, 0)
    assert job_ids(r, "j") == set(ids) and not r.exists(keys.recovered_answers("j"))
    spec = jobspec.load(r, "j")
    (payload,) = queued_chunks(r, spec.queue)
    chunk = Chunk.from_payload(payload)
    (prompt,) = chunk.prompts
    assert prompt.conversation == conversation and prompt.accounted_ids == ids  # whole
    generated = keys.chunk_generated("j", chunk.chunk_id)
    assert r.smembers(generated) == {ids[0].encode()} and r.ttl(generated) > 0
    # The worker resumes it at its second turn, on the committed turn's answer.
    turn = resume(r, chunk, prompt, {ids[0]})
    assert turn is not None and turn.index == 1 and turn.prompt.id == ids[1]
    assert turn.prompt.messages == [SYSTEM, USER_TURNS[0], answer, USER_TURNS[1]]
    places = count_places(r, spec)
    assert (places.total, places.done, places.waiting, places.unplaced) == (3, 1, 2, 0)

    again = enqueue(redis_url, [tmp_path / "d.jsonl"], turns="all")
    assert again.enqueued == 0 and again.conversations_resumed == 0


def test_a_conversation_redis_lost_without_its_answers_is_dead_lettered_at_its_open_turn(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    """`regen recover` not run (or its saved answers expired): the conversation cannot
    resume, and its open turns are accounted for in the input DLQ."""
    conversation = _lost_conversation(redis_url, r, tmp_path)
    ids = conversation.turn_ids()
    stats = enqueue(redis_url, [write_jsonl(tmp_path / "d.jsonl", [ROW])], turns="all")
    assert stats.enqueued == 0 and stats.rejected_by_reason == {"history_lost": 1}
    spec = jobspec.load(r, "j")
    assert queued_chunks(r, spec.queue) == [] and job_ids(r, "j") == set(ids)
    letters = {letter.entry_id: letter for letter in dlq.entries(r, "j", "input")}
    assert set(letters) == set(ids[1:])
    lost = letters[ids[1]]
    assert lost.reason == "history_lost" and lost.payload == {"settled": ids[:1]}
    assert ids[0] in lost.message and "regen recover --job j --out OUT" in lost.message
    assert letters[ids[2]].reason == "blocked" and letters[ids[2]].payload == {"blocked_by": ids[1]}
    places = count_places(r, spec)
    assert (places.total, places.done, places.dead_lettered, places.unplaced) == (3, 1, 2, 0)


@pytest.mark.parametrize("preserve_thinking", [False, True])
def test_the_next_turn_holds_the_targets_answer_as_serving_renders_it(
    kimi_tokenizer_dir: Path, kimi_tokenizer: Any, preserve_thinking: bool
) -> None:
    kwargs = {"preserve_thinking": True} if preserve_thinking else {}
    options = JobOptions(job="k", model=str(kimi_tokenizer_dir), trust_remote_code=True,
                         turns="all", chat_template_kwargs=kwargs)  # fmt: skip
    prepared = prepare_job(options)
    chat = load_job_chat(prepared.spec)
    first, conversation = split_turns(to_prompt(ROW))
    prompt = ChunkPrompt(turn_id(conversation.id, 0), chat.render(first.messages, None),
                         first.messages, {}, conversation=conversation)  # fmt: skip
    turn = Turn(prompt, conversation, 0)
    # Kimi's thinking prompt opens the span: the output starts inside the reasoning.
    text = "I weigh the options.</think>Mars, the red one."
    output = GenerateResult([], text, {"type": "stop", "matched": IM_END}, 0, 0)
    answer = chat.answer(prompt.prompt_ids, output, None, {}, record_id=prompt.id)
    assert answer == {"role": "assistant", "content": "Mars, the red one.",
                      "reasoning_content": "I weigh the options."}  # fmt: skip

    second = next_turn(turn, answer)
    assert second is not None and second.index == 1 and second.prompt.prompt_ids == []
    assert second.prompt.id == turn_id(conversation.id, 1)
    assert second.prompt.messages == [SYSTEM, USER_TURNS[0], answer, USER_TURNS[1]]
    ids = chat.render(second.prompt.messages, None)
    assert ids == render_prompt_ids(
        kimi_tokenizer, second.prompt.messages, prepared.spec.chat_template_kwargs
    )
    shown = kimi_tokenizer.decode(ids)
    assert "Mars, the red one." in shown and "DATASET" not in shown
    assert ("I weigh the options." in shown) is preserve_thinking

    third = next_turn(second.rendered(ids), {"role": "assistant", "content": "Venus."})
    assert third is not None and third.prompt.messages[-2:] == [
        {"role": "assistant", "content": "Venus."}, USER_TURNS[2]]  # fmt: skip
    assert next_turn(third, {"role": "assistant", "content": "Phobos."}) is None


def test_plan_counts_every_turn(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [ROW, {"prompt": "Say hello."}])
    result = CliRunner().invoke(
        plan, [str(path), "--model", "smollm2", "--turns", "all", "--json", "--out", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["turns"] == "all" and report["unique_prompts"] == 2
    assert report["prompts"] == 4 and report["rejected"] == {}
    last = CliRunner().invoke(
        plan, [str(path), "--model", "smollm2", "--json", "--out", str(tmp_path)]
    )
    assert json.loads(last.output)["prompts"] == 2


TOOL_ROW = {
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "dataset_call", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "dataset_call", "name": "get_weather",
         "content": "18 C, sunny"},
        {"role": "assistant", "content": "18 C and sunny."},
        {"role": "user", "content": "Thanks!"},
    ],
}  # fmt: skip


def _tool_turn() -> Turn:
    first, conversation = split_turns(to_prompt(TOOL_ROW))
    assert first.tools == TOOL_ROW["tools"] and len(conversation.later) == 2
    prompt = ChunkPrompt(turn_id(conversation.id, 0), [1], first.messages, {},
                         tools=first.tools, conversation=conversation)  # fmt: skip
    return Turn(prompt, conversation, 0)


def test_a_turn_ending_in_the_targets_tool_call_gets_the_datasets_result_for_it() -> None:
    turn = _tool_turn()
    call = {"id": "functions.get_weather:0", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}  # fmt: skip
    second = next_turn(turn, {"role": "assistant", "content": "", "tool_calls": [call]})
    assert second is not None and second.prompt.tools == TOOL_ROW["tools"]
    # The observation is the dataset's, answering the target's own call by its id.
    assert second.prompt.messages[-1] == {
        "role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather",
        "content": "18 C, sunny"}  # fmt: skip
    assert turn.conversation.context_before(1)[0]["tool_call_id"] == "dataset_call"  # not edited
    third = next_turn(second, {"role": "assistant", "content": "18 C and sunny."})
    assert third is not None and third.prompt.messages[-1]["content"] == "Thanks!"


def test_a_turn_that_does_not_make_the_datasets_tool_call_stops_its_conversation() -> None:
    turn = _tool_turn()
    with pytest.raises(ToolCallDiverged, match="1 tool result") as stopped:
        next_turn(turn, {"role": "assistant", "content": "I cannot check the weather."})
    assert stopped.value.turn.index == 1  # the turn dead-lettered, the rest blocked behind it
    other = {"id": "c0", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    with pytest.raises(ToolCallDiverged, match="get_time"):
        next_turn(turn, {"role": "assistant", "content": "", "tool_calls": [other]})
