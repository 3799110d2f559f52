"""The one zstd reader: a file of zstd frames as a buffered stream of its lines, which
raises `TruncatedFrame` where the file ends inside a frame.

zstandard's `stream_reader` (0.25) ends quietly where a truncated file ends, even inside
a frame, which would pass a cut-off dataset download, or a shard cut short, off as a
complete one. This reader decodes one frame at a time with `decompressobj`, which says
where each frame ends. The producer reads `.zst` datasets through it, the tokenize stage
and the operator commands read shards through it.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import IO

import zstandard

# Compressed bytes fed to the decoder per step. A step's output is held whole, so the
# step is small: 2 KiB of a file of duplicate rows (ratio ~350) is ~0.7 MB, and the
# extra calls cost nothing measurable on ordinary data.
_STEP = 1 << 11
# Buffer size of the decompressed stream that lines are split from.
BUFFER_SIZE = 1 << 16


class TruncatedFrame(zstandard.ZstdError):
    """The file ends inside a zstd frame: it was cut short (a ZstdError, as a damaged
    frame is, so one `except zstandard.ZstdError` catches both)."""


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a file of one or more concatenated zstd frames."""

    def __init__(self, fh: IO[bytes]) -> None:
        self._fh = fh
        self._dctx = zstandard.ZstdDecompressor()
        self._frame: zstandard.ZstdDecompressionObj | None = None  # None between frames
        self._out = b""
        self._pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        while self._pos == len(self._out):
            data = self._fh.read(_STEP)
            if not data:
                if self._frame is not None:
                    raise TruncatedFrame(
                        "file ends inside a zstd frame (truncated); zstd decodes whole "
                        "blocks (up to 128 KB of data), so what came before the cut block "
                        "was read and the cut block is lost"
                    )
                return 0
            self._out, self._pos = self._decompress(data), 0
        n = min(len(buffer), len(self._out) - self._pos)
        buffer[:n] = self._out[self._pos : self._pos + n]
        self._pos += n
        return n

    def _decompress(self, data: bytes) -> bytes:
        out = []
        while data:
            if self._frame is None:
                self._frame = self._dctx.decompressobj()
            out.append(self._frame.decompress(data))
            data = b""
            if self._frame.eof:  # the rest of `data` starts the next frame
                data = self._frame.unused_data
                self._frame = None
        return b"".join(out)

    def close(self) -> None:
        self._fh.close()
        super().close()


def open_zstd(source: Path | IO[bytes]) -> io.BufferedReader:
    """The decompressed content of a file (a path, or a binary stream such as an object
    being downloaded, closed with the reader), to read or iterate line by line; reading
    past a cut frame raises TruncatedFrame, a damaged one zstandard.ZstdError."""
    fh = open(source, "rb") if isinstance(source, Path) else source  # noqa: SIM115 (closed with the reader)
    return io.BufferedReader(_ZstdFrames(fh), buffer_size=BUFFER_SIZE)
