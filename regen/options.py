"""Options shared by several commands."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click
import orjson

from regen.common import defaults

F = TypeVar("F", bound=Callable[..., Any])


def redis_url_option(func: F) -> F:
    return click.option(
        "--redis-url",
        envvar="REGEN_REDIS_URL",
        default=None,
        metavar="URL",
        help="redis://[:password@]host:port/db or rediss:// for TLS "
        "(env REGEN_REDIS_URL; default: the embedded Redis).",
    )(func)


def json_object(ctx: click.Context, param: click.Parameter, value: str | None) -> dict[str, Any]:
    """Click callback: a JSON object given on the command line."""
    if not value:
        return {}
    try:
        parsed = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise click.BadParameter(f"not valid JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise click.BadParameter("must be a JSON object, e.g. '{\"thinking\": false}'")
    return parsed


def prepare_job_or_fail(options: Any) -> Any:
    """`producer.spec.prepare_job`, its refusals shown as a command-line error."""
    from regen.common.jobspec import JobSpecError
    from regen.producer.spec import prepare_job

    try:
        return prepare_job(options)
    except (ValueError, JobSpecError) as exc:
        raise click.ClickException(str(exc)) from exc


# What loads the target's tokenizer and shapes its chat template.
_MODEL = click.option(
    "--model",
    required=True,
    envvar="REGEN_MODEL",
    help="HF model folder, a .gguf file, or 'smollm2' (the bundled SmolLM2-135M).",
)
_TOKENIZER = click.option("--tokenizer", default=None, help="Load the tokenizer from here instead.")
_TRUST_REMOTE_CODE = click.option(
    "--trust-remote-code",
    is_flag=True,
    help="Allow the tokenizer's own code (Kimi's tiktoken tokenizer needs it).",
)
_CHAT_TEMPLATE_KWARGS = click.option(
    "--chat-template-kwargs",
    callback=json_object,
    default=None,
    metavar="JSON",
    help="Extra chat template kwargs, e.g. '{\"preserve_thinking\": true}'.",
)


def _apply(func: F, decorators: list[Callable[[F], F]]) -> F:
    for decorator in reversed(decorators):  # the first listed shows first in --help
        func = decorator(func)
    return func


def tokenizer_options(func: F) -> F:
    """The target's tokenizer and chat template kwargs (`preflight`)."""
    return _apply(func, [_MODEL, _TOKENIZER, _TRUST_REMOTE_CODE, _CHAT_TEMPLATE_KWARGS])


def target_options(func: F) -> F:
    """What decides the prompt ids the server gets: the model, its tokenizer and chat
    template settings, and the limits on prompts. `enqueue` and `plan` share them, so a
    plan counts exactly what an enqueue would send."""
    return _apply(func, [
        _MODEL,
        _TOKENIZER,
        _TRUST_REMOTE_CODE,
        click.option(
            "--max-new-tokens",
            type=click.IntRange(min=1),
            default=defaults.MAX_NEW_TOKENS,
            show_default=True,
            help="Always sent: SGLang's own default is only 128.",
        ),
        click.option(
            "--thinking/--no-thinking",
            default=None,
            help="Thinking mode, mapped to the chat template's switch "
            "(Kimi: thinking, Qwen3: enable_thinking). Default: the template's.",
        ),
        _CHAT_TEMPLATE_KWARGS,
        click.option(
            "--system-prompt", default=None, help="System message for rows that have none."
        ),
        click.option(
            "--max-prompt-tokens",
            type=click.IntRange(min=1),
            default=None,
            help="Longer prompts go to the input DLQ.",
        ),
        click.option(
            "--context-length",
            type=click.IntRange(min=2),
            default=None,
            help="The server's context length (default: from the model's config).",
        ),
        click.option(
            "--max-row-bytes",
            type=click.IntRange(min=1),
            default=None,
            help="Prompts with more bytes of text go to the input DLQ untokenized "
            "(default: the most that could fit the prompt token limit).",
        ),
    ])  # fmt: skip
