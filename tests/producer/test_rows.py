"""producer.rows: row shapes, history, system precedence, text as written and normalized
ids, bad rows. Tool-use rows: test_tool_rows.py."""

from __future__ import annotations

import unicodedata
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from regen.common.jobspec import PROMPT_TEXT_STRIPPED
from regen.producer.readers import iter_rows
from regen.producer.rows import BadRow, Prompt, Reason, prompt_id, to_prompt


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def system(text: str) -> dict[str, str]:
    return {"role": "system", "content": text}


# --- shapes -----------------------------------------------------------------------


def test_openai_messages() -> None:
    prompt = to_prompt({"messages": [system("be brief"), user("hi"), assistant("hello")]})
    assert prompt.messages == [system("be brief"), user("hi")]


def test_openai_text_parts_are_joined() -> None:
    parts = [{"type": "text", "text": "look at"}, {"type": "text", "text": "this"}]
    prompt = to_prompt({"messages": [{"role": "user", "content": parts}]})
    assert prompt.messages == [user("look at\nthis")]


@pytest.mark.parametrize("field", ["conversations", "conversation"])
def test_sharegpt_from_value(field: str) -> None:
    row = {
        field: [
            {"from": "system", "value": "sys"},
            {"from": "human", "value": "q1"},
            {"from": "gpt", "value": "a1"},
            {"from": "user", "value": "q2"},
            {"from": "chatgpt", "value": "a2"},
        ]
    }
    assert to_prompt(row).messages == [system("sys"), user("q1"), assistant("a1"), user("q2")]


def test_sharegpt_role_content_and_other_assistant_names() -> None:
    row = {
        "conversations": [
            {"role": "User", "content": "q1"},
            {"from": "bing", "value": "a1"},
            {"from": "human", "value": "q2"},
            {"from": "bard", "value": "a2"},
            {"from": "human", "value": "q3"},
        ]
    }
    prompt = to_prompt(row)
    assert [m["role"] for m in prompt.messages] == ["user", "assistant"] * 2 + ["user"]


def test_alpaca_instruction_input_system() -> None:
    row = {"instruction": "Translate.", "input": "bonjour", "output": "hello", "system": "sys"}
    assert to_prompt(row).messages == [system("sys"), user("Translate.\n\nbonjour")]
    assert to_prompt({"instruction": "Say hi.", "input": ""}).messages == [user("Say hi.")]


@pytest.mark.parametrize("field", ["prompt", "question", "text"])
def test_bare_prompt_fields(field: str) -> None:
    assert to_prompt({field: "  why?  "}).messages == [user("  why?  ")]
    stripped = to_prompt({field: "  why?  "}, prompt_text=PROMPT_TEXT_STRIPPED)
    assert stripped.messages == [user("why?")]


def test_prompt_as_messages_list() -> None:
    row = {"prompt": [user("q1"), assistant("a1"), user("q2")], "chosen": "x", "rejected": "y"}
    assert to_prompt(row).messages == [user("q1"), assistant("a1"), user("q2")]


def test_bare_field_precedence() -> None:
    assert to_prompt({"text": "t", "question": "q", "prompt": "p"}).messages == [user("p")]
    assert to_prompt({"text": "t", "question": "q"}).messages == [user("q")]


def test_null_fields_count_as_absent() -> None:
    # A Parquet file with mixed shapes gives every row every column.
    row = {"messages": None, "instruction": None, "prompt": "p", "system": None, "id": None}
    prompt = to_prompt(row)
    assert prompt.messages == [user("p")]
    assert prompt.source_id is None


# --- history and the trailing assistant ---------------------------------------------


def test_multi_turn_history_kept_and_trailing_assistants_dropped() -> None:
    history = [user("q1"), assistant("a1"), user("q2"), assistant("a2"), user("q3")]
    row = {"messages": [*history, assistant("a3"), assistant("a3 again")]}
    assert to_prompt(row).messages == history


def test_dropped_trailing_assistant_is_not_validated() -> None:
    # An assistant turn with tool calls has content null; it is dropped, so it is fine.
    row = {"messages": [user("q"), {"role": "assistant", "content": None}]}
    assert to_prompt(row).messages == [user("q")]


# --- system precedence ---------------------------------------------------------------


def test_system_prompt_prepended_when_row_has_none() -> None:
    prompt = to_prompt({"prompt": "q"}, system_prompt=" be kind\r\n ")
    assert prompt.messages == [system(" be kind\r\n "), user("q")]
    stripped = to_prompt(
        {"prompt": "q"}, system_prompt=" be kind\r\n ", prompt_text=PROMPT_TEXT_STRIPPED
    )
    assert stripped.messages == [system("be kind"), user("q")]
    assert prompt.id == stripped.id == prompt_id([system("be kind"), user("q")])


def test_rows_own_system_wins_over_system_prompt() -> None:
    row = {"messages": [system("row says"), user("q")]}
    assert to_prompt(row, system_prompt="cli says").messages[0] == system("row says")
    field_row = {"system": "field says", "prompt": "q"}
    assert to_prompt(field_row, system_prompt="cli says").messages[0] == system("field says")
    both = {"system": "field says", "messages": [system("message says"), user("q")]}
    assert to_prompt(both).messages == [system("message says"), user("q")]


def test_empty_system_message_is_no_system_message() -> None:
    row = {"conversations": [{"from": "system", "value": "  "}, {"from": "human", "value": "q"}]}
    assert to_prompt(row).messages == [user("q")]
    assert to_prompt(row, system_prompt="cli").messages == [system("cli"), user("q")]
    assert to_prompt({"prompt": "q", "system": ""}, system_prompt="").messages == [user("q")]


# --- normalization and ids -----------------------------------------------------------


def test_normalization_and_same_id_for_same_content() -> None:
    text = "Café\nsecond line"
    base = to_prompt({"messages": [user(text)]})
    variants = [
        {"messages": [{"role": "USER", "content": "  " + text + "\n\t"}]},
        {"messages": [user(text.replace("\n", "\r\n"))]},
        {"messages": [user(unicodedata.normalize("NFD", text))]},
        {"conversations": [{"from": "human", "value": text}]},
        {"prompt": text, "id": "other-id"},
        {"instruction": text},
    ]
    assert unicodedata.normalize("NFD", text) != text  # the NFD variant really differs
    for row in variants:
        # A job of the old rule renders the normalized text; every job dedupes on it.
        stripped = to_prompt(row, prompt_text=PROMPT_TEXT_STRIPPED)
        assert stripped.messages == base.messages
        assert to_prompt(row).id == stripped.id == base.id


def test_different_content_different_id() -> None:
    ids = {
        to_prompt({"prompt": "a"}).id,
        to_prompt({"prompt": "b"}).id,
        to_prompt({"prompt": "a"}, system_prompt="s").id,
        to_prompt({"messages": [user("a"), assistant("b"), user("c")]}).id,
        to_prompt({"messages": [user("a\n\nb"), user("c")]}).id,
    }
    assert len(ids) == 5


def test_prompt_id_is_stable_and_key_order_free() -> None:
    messages = [user("hello")]
    assert prompt_id(messages) == prompt_id([{"content": "hello", "role": "user"}])
    # Pinned: a change here changes every id, which breaks resuming old jobs.
    expected = orjson.dumps(messages, option=orjson.OPT_SORT_KEYS)
    assert expected == b'[{"content":"hello","role":"user"}]'
    assert prompt_id(messages) == Prompt(messages).id
    assert len(prompt_id(messages)) == 16
    int(prompt_id(messages), 16)


@pytest.mark.parametrize(
    ("row", "source_id"),
    [
        ({"id": "abc", "prompt": "q"}, "abc"),
        ({"uuid": "u-1", "prompt": "q"}, "u-1"),
        ({"conversation_id": "c", "prompt": "q"}, "c"),
        ({"idx": 7, "prompt": "q"}, "7"),
        ({"id": True, "prompt": "q"}, None),
        ({"prompt": "q"}, None),
    ],
)
def test_source_id(row: dict[str, object], source_id: str | None) -> None:
    assert to_prompt(row).source_id == source_id


# --- bad rows --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("row", "reason", "words"),
    [
        ([user("q")], Reason.NOT_AN_OBJECT, "array"),
        ("q", Reason.NOT_AN_OBJECT, "string"),
        ({"chosen": "x"}, Reason.UNKNOWN_SHAPE, "chosen"),
        ({"messages": "q"}, Reason.WRONG_TYPE, "'messages'"),
        ({"messages": [user("q"), {"content": "x"}, user("r")]}, Reason.WRONG_TYPE, "[1]"),
        ({"messages": [{"role": 1, "content": "x"}]}, Reason.WRONG_TYPE, "number"),
        ({"messages": [{"role": "user", "content": 42}]}, Reason.WRONG_TYPE, "number"),
        ({"messages": [{"role": "user"}]}, Reason.WRONG_TYPE, "'content'"),
        ({"messages": ["q"]}, Reason.WRONG_TYPE, "string"),
        ({"prompt": 3}, Reason.WRONG_TYPE, "'prompt'"),
        ({"instruction": ["x"]}, Reason.WRONG_TYPE, "part 0"),
        (
            {"messages": [user("q"), {"role": "narrator", "content": "x"}]},
            Reason.UNSUPPORTED_ROLE,
            "narrator",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            Reason.UNSUPPORTED_CONTENT,
            "image_url",
        ),
        ({"messages": [user(" \n ")]}, Reason.EMPTY_CONTENT, "messages[0]"),
        ({"messages": [user("q"), assistant(""), user("r")]}, Reason.EMPTY_CONTENT, "messages[1]"),
        ({"prompt": ""}, Reason.EMPTY_CONTENT, "'prompt'"),
        ({"instruction": " ", "input": ""}, Reason.EMPTY_CONTENT, "instruction"),
        ({"messages": []}, Reason.NO_USER_TURN, "user"),
        ({"messages": [system("s"), assistant("a")]}, Reason.NO_USER_TURN, "user"),
        ({"messages": [user("q"), system("s")]}, Reason.BAD_ORDER, "messages[1]"),
        ({"messages": [user("q"), system("s"), user("r")]}, Reason.BAD_ORDER, "messages[1]"),
    ],
)
def test_bad_rows(row: object, reason: str, words: str) -> None:
    with pytest.raises(BadRow) as caught:
        to_prompt(row)
    assert caught.value.reason == reason
    assert words in caught.value.message
    assert str(caught.value).startswith(reason + ": ")


def test_bad_rows_do_not_stop_good_rows_around_them(tmp_path: Path) -> None:
    rows = [
        {"prompt": "first"},
        {"messages": [{"role": "narrator", "content": "x"}]},
        {"prompt": ""},
        [1, 2],
        {"nothing": "here"},
        {"conversations": [{"from": "human", "value": "last"}]},
    ]
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows) + b"{oops\n")
    outcomes = []
    for raw in iter_rows(path):
        if raw.error is not None:
            outcomes.append(raw.error.reason)
            continue
        try:
            outcomes.append(to_prompt(raw.value).messages[-1]["content"])
        except BadRow as bad:
            outcomes.append(bad.reason)
    assert outcomes == [
        "first",
        Reason.UNSUPPORTED_ROLE,
        Reason.EMPTY_CONTENT,
        Reason.NOT_AN_OBJECT,
        Reason.UNKNOWN_SHAPE,
        "last",
        Reason.INVALID_JSON,
    ]


def test_parquet_rows_become_prompts(tmp_path: Path) -> None:
    # Mixed shapes in one Parquet file: every row gets every column, nulls where absent,
    # and the message structs carry both spellings of role and content.
    path = tmp_path / "d.parquet"
    table = pa.table(
        {
            "id": [1, 2],
            "prompt": [None, "bare"],
            "conversations": [
                [
                    {"from": "human", "value": "q", "role": None, "content": None},
                    {"from": None, "value": None, "role": "assistant", "content": "a"},
                ],
                None,
            ],
        }
    )
    pq.write_table(table, path)
    prompts = [to_prompt(raw.value) for raw in iter_rows(path)]
    assert [p.messages for p in prompts] == [[user("q")], [user("bare")]]
    assert [p.source_id for p in prompts] == ["1", "2"]


# --- text as written, ids normalized ---------------------------------------------------


def test_text_is_rendered_as_written() -> None:
    code = "def square(x):\r\n    return x * x\n"
    parts = [{"type": "text", "text": code}]
    row = {"conversations": [{"from": "system", "value": " Answer in Python. "},
                             {"from": "human", "value": parts}]}  # fmt: skip
    assert to_prompt(row).messages == [system(" Answer in Python. "), user(code)]
    assert to_prompt(row, prompt_text=PROMPT_TEXT_STRIPPED).messages == [
        system("Answer in Python."), user("def square(x):\n    return x * x"),
    ]  # fmt: skip


def test_rows_differing_only_in_outer_whitespace_share_one_id() -> None:
    plain = to_prompt({"prompt": "Fix this:\nx = 1"})
    padded = to_prompt({"prompt": "Fix this:\r\nx = 1\n\n  "})
    assert padded.messages == [user("Fix this:\r\nx = 1\n\n  ")]
    assert padded.id == plain.id == prompt_id([user("Fix this:\nx = 1")])


def test_alpaca_id_normalizes_each_part_as_regen_always_did() -> None:
    # Pinned: ids of an existing job must not move, so the key joins normalized parts.
    prompt = to_prompt({"instruction": "Translate. ", "input": " bonjour\n"})
    assert prompt.messages == [user("Translate. \n\n bonjour\n")]
    assert prompt.id == prompt_id([user("Translate.\n\nbonjour")])
    assert to_prompt({"instruction": "Say hi.", "input": "  "}).messages == [user("Say hi.")]
