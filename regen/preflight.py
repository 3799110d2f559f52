"""`regen preflight`: check that a target's tokenizer and chat template are ready for a job.

Each check has a status: ok, warn (works, but read the detail) or fail (a job would not
run, or would write wrong records). The first failure to load the tokenizer stops the
rest, since every other check needs it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from regen.common import tokenizer as tokenizers
from regen.common.chat_family import ChatFamily, ChatTemplateError, detect_family, render_prompt_ids

Status = Literal["ok", "warn", "fail"]
SYMBOLS: dict[Status, str] = {"ok": "✓", "warn": "!", "fail": "✗"}
# Rendered with thinking on and off; a system turn too, since templates often treat it apart.
SAMPLE_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2+2?"},
]
# Tokens shown from the end of the generation prompt: enough to see the assistant
# header and any think tags after it.
TAIL_TOKENS = 6


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Report:
    model: str
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return all(check.status != "fail" for check in self.checks)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "ok": self.ok,
            "checks": [
                {"name": c.name, "status": c.status, "detail": c.detail, **c.data}
                for c in self.checks
            ],
        }

    def to_text(self) -> str:
        lines = [f"{SYMBOLS[c.status]} {c.name}: {c.detail}" for c in self.checks]
        lines.append("ready" if self.ok else "NOT ready: fix the ✗ checks above")
        return "\n".join(lines)


def run_preflight(
    model: str,
    *,
    tokenizer: str | None = None,
    trust_remote_code: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> Report:
    try:
        tok = tokenizers.load_tokenizer(
            model, tokenizer=tokenizer, trust_remote_code=trust_remote_code
        )
    except tokenizers.TokenizerLoadError as exc:
        return Report(model, [Check("tokenizer", "fail", str(exc))])
    family = detect_family(tok)
    extra = dict(chat_template_kwargs or {})
    fingerprint = tokenizers.tokenizer_fingerprint(tok)
    checks = [
        Check(
            "tokenizer",
            "ok",
            f"{type(tok).__name__} from {tokenizer or model}, vocab {len(tok):,}",
            {"class": type(tok).__name__, "vocab_size": len(tok)},
        ),
        _family_check(family),
        *_render_checks(tok, family, extra),
        _end_of_turn_check(tok, family),
        _mask_check(tok, family),
        *_think_tags_check(tok, family),
        _context_check(model),
        Check("fingerprint", "ok", fingerprint, {"fingerprint": fingerprint}),
    ]
    return Report(model, checks)


def _family_check(family: ChatFamily) -> Check:
    switch = family.thinking_kwarg
    detail = family.name + (
        f" (thinking switch: {switch})" if switch else " (no thinking switch in the chat template)"
    )
    return Check("chat family", "ok", detail, {"family": family.name, "thinking_switch": switch})


def _render_checks(tok: Any, family: ChatFamily, extra: dict[str, Any]) -> list[Check]:
    """The generation prompt rendered each way the job may render it."""
    switch = family.thinking_kwarg
    if switch is None:
        return [_render_check(tok, "chat template", extra)[0]]
    on, on_ids = _render_check(tok, "thinking on", {**extra, switch: True})
    off, off_ids = _render_check(tok, "thinking off", {**extra, switch: False})
    checks = [on, off]
    if on_ids is None or off_ids is None:
        return checks
    if on_ids == off_ids:
        detail = f"{switch}=true and {switch}=false render the same prompt"
        return [*checks, Check("thinking switch", "warn", detail)]
    # Which way the template goes when a job leaves the switch unset.
    default, default_ids = _render_check(tok, "thinking default", extra)
    if default_ids is not None:
        which = {on_ids: "on", off_ids: "off"}.get(default_ids)
        detail = f"without --thinking/--no-thinking the template renders thinking {which}"
        if which is None:
            detail = "without --thinking/--no-thinking the template renders neither way"
        default = Check("thinking default", "ok", detail, {"default": which})
    return [*checks, default]


def _render_check(
    tok: Any, name: str, kwargs: dict[str, Any]
) -> tuple[Check, tuple[int, ...] | None]:
    """The check and the rendered ids (a tuple, to compare renders), None on failure."""
    try:
        ids = render_prompt_ids(tok, SAMPLE_CONVERSATION, kwargs)
    except ChatTemplateError as exc:
        return Check(name, "fail", str(exc), {"kwargs": kwargs}), None
    tail = ids[-TAIL_TOKENS:]
    pieces = [tok.decode([i]) for i in tail]
    shown = " ".join(repr(p) for p in pieces)
    data = {"kwargs": kwargs, "tail_ids": tail, "tail_tokens": pieces}
    return Check(name, "ok", f"prompt ends … {shown}  ids {tail}", data), tuple(ids)


def _end_of_turn_check(tok: Any, family: ChatFamily) -> Check:
    data = {"end_of_turn_ids": list(family.end_of_turn_ids), "eos_token_id": tok.eos_token_id}
    if not family.end_of_turn_ids:
        return Check("end of turn", "fail", "no end-of-turn token and no eos", data)
    named = ", ".join(f"{tok.convert_ids_to_tokens(i)} {i}" for i in family.end_of_turn_ids)
    return Check("end of turn", "ok", f"{named}; eos {tok.eos_token} {tok.eos_token_id}", data)


def _mask_check(tok: Any, family: ChatFamily) -> Check:
    mask = family.mask_token_id
    if mask is None:
        return Check(
            "mask token",
            "warn",
            "no reserved special token found; a DFlash drafter needs a mask token id the "
            "target never generates: choose one yourself",
            {"mask_token_id": None},
        )
    token = tok.convert_ids_to_tokens(mask)
    return Check(
        "mask token",
        "ok",
        f"{mask} {token} (reserved special; for DFlash)",
        {"mask_token_id": mask},
    )


def _think_tags_check(tok: Any, family: ChatFamily) -> list[Check]:
    """Records split reasoning from the answer on the server's text, which SGLang decodes
    with skip_special_tokens=true by default: special think tags would vanish from it."""
    if family.think_open_id is None or family.think_close_id is None:
        return []
    decoder = tok.added_tokens_decoder
    special = [
        tag
        for tag, i in (
            (family.think_open, family.think_open_id),
            (family.think_close, family.think_close_id),
        )
        if i in decoder and decoder[i].special
    ]
    if special:
        detail = (
            f"{', '.join(map(str, special))} special: SGLang's default skip_special_tokens=true "
            "drops them from the text, and thinking records would fail their checks"
        )
        return [Check("think tags", "warn", detail, {"special": special})]
    detail = "not special: they stay in the text with skip_special_tokens=true"
    return [Check("think tags", "ok", detail, {"special": []})]


def _context_check(model: str) -> Check:
    try:
        length = tokenizers.model_context_length(tokenizers.resolve_model(model))
    except tokenizers.TokenizerLoadError as exc:
        return Check("context length", "warn", str(exc), {"context_length": None})
    if length is None:
        return Check(
            "context length",
            "warn",
            "not in the model's metadata; give enqueue --context-length",
            {"context_length": None},
        )
    return Check("context length", "ok", f"{length:,} tokens", {"context_length": length})
