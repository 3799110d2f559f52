"""Export formats: the row each format makes of a record, and the files rows go to.

Every sink writes to a hidden temporary name and renames it into place on commit, so a
reader never sees half an export; abort removes what was written.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import orjson
import pyarrow as pa

from regen.common import extras

Row = dict[str, Any]
Shape = Callable[[Row], Row]  # a record to the row a format writes
TMP_SUFFIX = ".tmp"
# A batch of rows bound for Arrow is written once it holds this many token ids (or rows),
# so memory stays flat however long the records are.
BATCH_TOKENS = 1 << 16
BATCH_ROWS = 1000


# The message keys a conversation row keeps: what a chat template reads back (SpecForge's
# raw path takes role, content, reasoning_content and tool_calls; a tool result's
# tool_call_id and name are what templates pair it with its call by).
_CONVERSATION_KEYS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name")


def conversation_row(record: Row) -> Row:
    """SpecForge's conversation JSONL (`regenerate_train_data.py --reasoning save`): the
    regenerated turn last, its `reasoning_content` beside `content` when the model thought,
    its `tool_calls` when it called tools, and the `tools` the prompt offered. Text only:
    a trainer that reads it tokenizes again, and renders the tools and calls as the
    prompt was rendered."""
    turns = [
        {key: message[key] for key in _CONVERSATION_KEYS if key in message}
        for message in record["messages"]
    ]
    row: Row = {"id": record["id"], "conversations": turns}
    if record.get("tools"):
        row["tools"] = record["tools"]
    return row


def specforge_row(record: Row) -> Row:
    """SpecForge's pre-tokenized rows (`data.prompts_path`): its loader takes non-empty
    integer lists `input_ids` and `loss_mask` of equal length, the mask 0/1, and ignores
    every other key."""
    return {"id": record["id"], "input_ids": record["input_ids"], "loss_mask": record["loss_mask"]}


def token_row(record: Row) -> Row:
    """Ids, mask and the metadata to select and audit rows by (speculators, `datasets`).

    `sampling` and `chat_template_kwargs` are JSON text: their keys vary between jobs and
    requeues, and `datasets` fixes one column type per dataset, which a struct with
    varying fields would break when jobs are merged. `seq_len` is read by speculators'
    trainer for length bucketing.
    """
    return {
        "id": record["id"], "job": record["job"], "model": record["model"],
        "input_ids": record["input_ids"], "loss_mask": record["loss_mask"],
        "seq_len": len(record["input_ids"]),
        "prompt_tokens": record["prompt_tokens"],
        "completion_tokens": record["completion_tokens"],
        "finish_reason": record["finish_reason"],
        "sampling": orjson.dumps(record["sampling"]).decode(),
        "chat_template_kwargs": orjson.dumps(record["chat_template_kwargs"]).decode(),
        "flags": record.get("flags", []),
    }  # fmt: skip


TOKEN_SCHEMA = pa.schema([
    ("id", pa.string()), ("job", pa.string()), ("model", pa.string()),
    ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
    ("seq_len", pa.int32()), ("prompt_tokens", pa.int32()), ("completion_tokens", pa.int32()),
    ("finish_reason", pa.string()), ("sampling", pa.string()),
    ("chat_template_kwargs", pa.string()), ("flags", pa.list_(pa.string())),
])  # fmt: skip


class ExportError(ValueError):
    """A bad option, job name or output path, or a missing extra: the user's to fix."""


class Sink(Protocol):
    def write(self, row: Row) -> None: ...
    def commit(self) -> None: ...
    def abort(self) -> None: ...


class JsonlSink:
    """Plain (uncompressed) JSON Lines, one row a line."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._tmp = path.with_name(f".{path.name}{TMP_SUFFIX}")
        self._file = open(self._tmp, "wb")  # noqa: SIM115 (closed in commit/abort)

    def write(self, row: Row) -> None:
        self._file.write(orjson.dumps(row) + b"\n")

    def commit(self) -> None:
        self._file.close()
        os.replace(self._tmp, self._path)

    def abort(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)


class DatasetSink:
    """A `datasets` folder as `Dataset.save_to_disk` writes it (`load_from_disk` reads it).

    Rows stream into an Arrow file in bounded batches; `datasets` then memory-maps that
    file and saves it, so neither step holds the rows.
    """

    def __init__(self, path: Path) -> None:
        self._datasets = require_datasets()
        self._path = path
        self._scratch = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        self._arrow = self._scratch / "rows.arrow"
        self._file = pa.OSFile(str(self._arrow), "wb")
        self._writer = pa.ipc.new_stream(self._file, TOKEN_SCHEMA)
        self._batch: list[Row] = []
        self._tokens = 0

    def write(self, row: Row) -> None:
        self._batch.append(row)
        self._tokens += len(row["input_ids"])
        if self._tokens >= BATCH_TOKENS or len(self._batch) >= BATCH_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self._batch:
            self._writer.write_batch(pa.RecordBatch.from_pylist(self._batch, TOKEN_SCHEMA))
        self._batch, self._tokens = [], 0

    def commit(self) -> None:
        self._flush()
        self._writer.close()
        self._file.close()
        staged = self._scratch / "dataset"
        dataset = self._datasets.Dataset.from_file(str(self._arrow))
        # An empty dataset saved with the default sharding writes no data file at all,
        # and load_from_disk then fails on it (datasets 5.2): give it its one shard.
        dataset.save_to_disk(str(staged), num_shards=None if len(dataset) else 1)
        os.replace(staged, self._path)
        shutil.rmtree(self._scratch)

    def abort(self) -> None:
        self._file.close()
        shutil.rmtree(self._scratch, ignore_errors=True)


def require_datasets() -> ModuleType:
    """The `datasets` package, or ExportError naming the extra that installs it."""
    try:
        import datasets
    except ImportError:
        raise ExportError(
            "--format hf needs the `export` extra (datasets not installed): "
            f"{extras.install_hint('export')}"
        ) from None
    return datasets


# Format -> (the row it makes of a record, the sink its rows go to).
FORMATS: dict[str, tuple[Shape, Callable[[Path], Sink]]] = {
    "conversations": (conversation_row, JsonlSink),
    "specforge": (specforge_row, JsonlSink),
    "speculators": (token_row, JsonlSink),
    "hf": (token_row, DatasetSink),
}
