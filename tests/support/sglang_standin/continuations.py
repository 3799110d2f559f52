"""Where an aborted answer's rest waits for the server that continues it.

regen moves a running answer to a faster server by aborting it (aborts.py) and sending
prompt + partial output there. On a real model that works because both servers run the
same model on the same prefix, so the continuation is drawn from the same distribution
as the rest would have been. The stand-in's answers are a function of the input ids, so
it makes that exact: the abort writes the rest of the planned answer here, keyed by the
completer's digest of (seed, sampling_seed, prompt + partial), and a completer asked that
input answers with the stored rest. Partial + continuation then equals what the first
server would have answered, which a test or bench can check, and the second server's
decode time is the remaining tokens only.

The store is a folder shared by every stand-in on the machine (processes started apart
cannot share memory): one small orjson file per key, written to a temp name and renamed
so a reader never sees half of one. A lookup is one open of a file that usually is not
there.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import orjson


def default_dir(seed: int) -> Path:
    return Path(tempfile.gettempdir()) / "regen-standin-continuations" / f"seed-{seed}"


class ContinuationStore:
    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)

    def _path(self, key: int) -> Path:
        return self.directory / f"{key:016x}.json"

    def put(
        self, key: int, rest: list[int], finish_reason: dict[str, Any], origin: int, resumed: int
    ) -> None:
        """Keep `rest` (ids, then `finish_reason`) for the input whose digest is `key`;
        `origin`: the slot-log key of the prompt the answer began on, `resumed`: the
        tokens decoded before the rest (a bench joins the pieces of one answer by them)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self._path(key)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{path.stem}-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                entry = {"output_ids": rest, "finish_reason": finish_reason,
                         "origin": origin, "resumed": resumed}  # fmt: skip
                fh.write(orjson.dumps(entry))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def get(self, key: int) -> dict[str, Any] | None:
        """What `put` kept for the input whose digest is `key`, or None."""
        try:
            entry: dict[str, Any] = orjson.loads(self._path(key).read_bytes())
        except FileNotFoundError:
            return None
        return entry
