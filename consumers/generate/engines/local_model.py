"""Loading the local engine's model: once per process, with a de-quantized weight cache."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

from regen.common.tokenizer import ModelRef, load_tokenizer
from regen.consumers.generate.engines.local_sampling import SAMPLING_DEFAULTS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    model: Any
    tokenizer: Any
    eos_ids: frozenset[int]
    defaults: dict[str, float]
    context_len: int | None
    vocab_size: int


_MODELS: dict[tuple[Any, ...], LoadedModel] = {}
_MODELS_LOCK = threading.Lock()


def shared_model(
    ref: ModelRef, device: str, dtype: torch.dtype, trust_remote_code: bool,
    weights_cache: Path | None,
) -> LoadedModel:  # fmt: skip
    key = (ref.path, device, dtype, trust_remote_code)
    # Held while loading, so a second engine waits for the first load instead of repeating it.
    with _MODELS_LOCK:
        if key not in _MODELS:
            tokenizer = load_tokenizer(ref.spec, trust_remote_code=trust_remote_code)
            _MODELS[key] = _load(ref, tokenizer, device, dtype, trust_remote_code, weights_cache)
        return _MODELS[key]


def _load(
    ref: ModelRef, tokenizer: Any, device: str, dtype: torch.dtype, trust_remote_code: bool,
    weights_cache: Path | None,
) -> LoadedModel:  # fmt: skip
    started = time.monotonic()
    source, gguf_file = str(ref.folder), ref.gguf_file
    if gguf_file and weights_cache is not None:
        cached = dequantized_copy(ref, weights_cache)
        if cached is not None:
            source, gguf_file = str(cached), None
    model = AutoModelForCausalLM.from_pretrained(
        source, gguf_file=gguf_file, dtype=dtype, device_map=device, local_files_only=True,
        trust_remote_code=trust_remote_code,
    ).eval()  # fmt: skip
    generation, config = model.generation_config, model.config.get_text_config()
    eos = {tokenizer.eos_token_id} - {None}
    for ids in (generation.eos_token_id, config.eos_token_id):  # SGLang stops on all of them
        eos.update([ids] if isinstance(ids, int) else ids or [])
    found = {k: getattr(generation, k, None) for k in SAMPLING_DEFAULTS}
    # generate() would lay generation_config over what each request asks for; its sampling
    # defaults were just read, so leave it nothing to add.
    model.generation_config = GenerationConfig()
    context = next((v for k in ("max_position_embeddings", "n_positions", "seq_length")
                    if isinstance(v := getattr(config, k, None), int)), None)  # fmt: skip
    log.info("loaded %s on %s in %.1f s", ref.path, device, time.monotonic() - started)
    return LoadedModel(
        model=model, tokenizer=tokenizer, eos_ids=frozenset(eos),
        defaults={k: v for k, v in found.items() if v is not None}, context_len=context,
        vocab_size=model.get_input_embeddings().num_embeddings,
    )  # fmt: skip


def dequantized_copy(ref: ModelRef, cache_dir: Path) -> Path | None:
    """The GGUF's de-quantized weights as a safetensors folder, built on first use.

    Keyed by file, size, mtime and transformers version (the de-quantizer is its code).
    A new entry is reloaded and compared tensor by tensor, then renamed into place, so
    readers never see half an entry. Failures only cost the speed-up.
    """
    stat = ref.path.stat()
    raw = f"{ref.path}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    entry = cache_dir / f"{ref.path.stem}-{hashlib.sha256(raw.encode()).hexdigest()[:16]}"
    marker = entry / "regen-cache.json"
    if marker.is_file():
        return entry
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".tmp-"))
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(ref.folder), gguf_file=ref.gguf_file, local_files_only=True
            )
            # transformers flags GGUF models as quantized and refuses to save them, yet
            # once loaded they hold plain de-quantized tensors.
            model.hf_quantizer = None  # type: ignore[assignment]
            del model.config.quantization_config
            model.save_pretrained(tmp)
            want = model.state_dict()
            got = AutoModelForCausalLM.from_pretrained(str(tmp), local_files_only=True).state_dict()
            if want.keys() != got.keys() or not all(torch.equal(want[k], got[k]) for k in want):
                log.warning("not caching %s: the saved weights differ", ref.path)
                return None
            (tmp / marker.name).write_text(json.dumps({"source": raw}), encoding="utf-8")
            os.replace(tmp, entry)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception as exc:  # e.g. a full disk, or another process renamed its copy first
        log.warning("could not cache the weights of %s: %s", ref.path, exc)
    return entry if marker.is_file() else None
