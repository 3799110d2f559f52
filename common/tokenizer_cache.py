"""On-disk cache of tokenizers converted from GGUF files.

Converting a GGUF tokenizer takes seconds, so the converted tokenizer is saved under
`$REGEN_HOME/cache/tokenizers`, one entry per source file and transformers version, and
only used when it behaves exactly like the original (same fingerprint).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from regen.common import settings
from regen.common.tokenizer_fingerprint import tokenizer_fingerprint

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("regen.common.tokenizer")  # the tokenizer's warnings, under one name

CACHE_MARKER = "regen-tokenizer-cache.json"


def default_cache_dir() -> Path:
    return settings.current().home / "cache" / "tokenizers"


def load_cached(
    source: Path, cache_dir: Path, convert: Callable[[], PreTrainedTokenizerBase]
) -> PreTrainedTokenizerBase:
    """The cached tokenizer of the GGUF file `source`, else `convert()`'s, then cached."""
    entry = cache_dir / _cache_key(source)
    cached = read_cache(entry)
    if cached is not None:
        return cached
    tokenizer = convert()
    _write_cache(entry, tokenizer, source)
    return tokenizer


def _cache_key(source: Path) -> str:
    stat = source.stat()
    # The conversion is transformers' code, so a new version gets a fresh entry. Its
    # version comes from the package metadata: importing transformers costs ~0.6 s.
    raw = f"{source}|{stat.st_size}|{stat.st_mtime_ns}|{importlib.metadata.version('transformers')}"
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


def _load_entry(entry: Path) -> PreTrainedTokenizerBase:
    """Load a saved tokenizer folder. transformers saves a GGUF-converted tokenizer as
    its generic `TokenizersBackend`; that class is loaded directly, because going through
    AutoTokenizer imports torch (transformers' config machinery), over a second of a
    warm `regen enqueue`'s start-up. Any other class goes through AutoTokenizer."""
    config = json.loads((entry / "tokenizer_config.json").read_text(encoding="utf-8"))
    if config.get("tokenizer_class") == "TokenizersBackend":
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(entry), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(entry), local_files_only=True)


def read_cache(entry: Path) -> PreTrainedTokenizerBase | None:
    """The tokenizer of a cache entry; None when missing, unreadable or not a match."""
    marker = entry / CACHE_MARKER
    if not marker.is_file():
        return None
    try:
        expected = json.loads(marker.read_text(encoding="utf-8"))["fingerprint"]
        tokenizer = _load_entry(entry)
    except Exception as exc:  # a broken cache must never make a load fail
        log.warning("ignoring unreadable tokenizer cache %s: %s", entry, exc)
        return None
    if tokenizer_fingerprint(tokenizer) != expected:
        log.warning("ignoring tokenizer cache %s: it no longer matches its source", entry)
        return None
    return tokenizer


def _write_cache(entry: Path, tokenizer: PreTrainedTokenizerBase, source: Path) -> None:
    """Save, reload and compare; keep the entry only if the reload is indistinguishable.

    Written to a temporary folder and renamed into place, so a reader never sees half an
    entry and concurrent writers simply lose the race. Failures only cost the speed-up.
    """
    try:
        shutil.rmtree(entry, ignore_errors=True)  # a stale or broken entry
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=".tmp-"))
        try:
            tokenizer.save_pretrained(str(tmp))
            fingerprint = tokenizer_fingerprint(tokenizer)
            reloaded = _load_entry(tmp)
            if tokenizer_fingerprint(reloaded) != fingerprint:
                log.warning("not caching the tokenizer of %s: the saved copy differs", source)
                return
            record = {"fingerprint": fingerprint, "source": str(source)}
            (tmp / CACHE_MARKER).write_text(json.dumps(record), encoding="utf-8")
            os.replace(tmp, entry)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception as exc:  # caching is only a speed-up; the load itself succeeded
        log.warning("could not cache the tokenizer of %s: %s", source, exc)
