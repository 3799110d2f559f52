"""Read a GGUF file's key/value header without loading the rest of the file.

gguf's GGUFReader parses every array (the whole vocabulary) first, which takes seconds;
the keys needed here come before those arrays, so the header is streamed and the read
stops as soon as they are found.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import IO, Any

# GGUF value types (the GGUF spec): fixed-size scalars by struct format, then string/array.
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


class GGUFHeaderError(ValueError):
    """The file is not a readable GGUF file."""


def context_length(path: Path) -> int | None:
    """The model's `<arch>.context_length`, None when the header has none."""
    try:
        with path.open("rb") as f:
            magic, version, _tensors, kv_count = struct.unpack("<4sIQQ", f.read(24))
            if magic != b"GGUF" or version < 2:  # v1 used 32-bit counts; long obsolete
                return None
            arch, lengths = None, {}
            for _ in range(kv_count):
                key = _string(f)
                (value_type,) = struct.unpack("<I", f.read(4))
                if key == "general.architecture" and value_type == _STRING:
                    arch = _string(f)
                elif key.endswith(".context_length") and value_type in _SCALARS:
                    lengths[key] = _scalar(f, value_type)
                else:
                    _skip(f, value_type)
                if arch is not None and f"{arch}.context_length" in lengths:
                    return int(lengths[f"{arch}.context_length"])
    except (struct.error, KeyError, UnicodeDecodeError) as exc:
        raise GGUFHeaderError(f"{path} is not a readable GGUF file: {exc}") from exc
    return None


def _string(f: IO[bytes]) -> str:
    (length,) = struct.unpack("<Q", f.read(8))
    return f.read(length).decode("utf-8")


def _scalar(f: IO[bytes], value_type: int) -> Any:
    fmt = _SCALARS[value_type]
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def _skip(f: IO[bytes], value_type: int) -> None:
    if value_type == _STRING:
        (length,) = struct.unpack("<Q", f.read(8))
        f.seek(length, os.SEEK_CUR)
    elif value_type == _ARRAY:
        item_type, count = struct.unpack("<IQ", f.read(12))
        if item_type in _SCALARS:
            f.seek(struct.calcsize(_SCALARS[item_type]) * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip(f, item_type)
    else:
        f.seek(struct.calcsize(_SCALARS[value_type]), os.SEEK_CUR)
