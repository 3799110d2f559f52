"""How commands get their options: as objects, built once, from options declared once.

`options_object(name, build, *options)` adds click options to a command and hands it, in
their place, one argument `name` built from their values by `build`: `regen enqueue`
receives one `JobOptions`, `regen worker generate` one `WorkerOptions` (as rq's commands
receive one config), instead of twenty parameters to copy into an object. Defaults come
from common.defaults.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import click
import orjson

from regen.common import defaults
from regen.common.bucket_folder import SCHEMES as BUCKET_SCHEMES
from regen.common.bucket_folder import is_bucket_url
from regen.common.jobspec import TURN_MODES, TURNS_LAST

if TYPE_CHECKING:
    from regen.producer.spec import JobOptions, PreparedJob

F = TypeVar("F", bound=Callable[..., Any])
# A click.option(...), or any decorator of a command function.
Decorator = Callable[[Any], Any]


def apply(func: F, decorators: Sequence[Decorator]) -> F:
    """`func` under `decorators`, the first listed outermost (shown first in --help)."""
    for decorator in reversed(decorators):
        func = decorator(func)
    return func


def options_object(name: str, build: Callable[..., Any], *options: Decorator) -> Callable[[F], F]:
    """Add `options` to a command, which gets `name=build(**their values)` instead; a
    ValueError from `build` is a command-line error."""
    probe = click.command()(apply(lambda **_: None, options))  # the options' names
    names = [param.name for param in probe.params if param.name]

    def decorator(command: F) -> F:
        @functools.wraps(command)
        def run(*args: Any, **kwargs: Any) -> Any:
            values = {key: kwargs.pop(key) for key in names}
            try:
                built = build(**values)
            except ValueError as exc:
                raise click.ClickException(str(exc)) from exc
            return command(*args, **kwargs, **{name: built})

        return apply(cast("F", run), options)

    return decorator


def pop_fields(values: dict[str, Any], cls: type) -> dict[str, Any]:
    """Take out of `values` those that are fields of the dataclass `cls`."""
    names = {field.name for field in fields(cls)}
    return {key: values.pop(key) for key in list(values) if key in names}


# --- callbacks --------------------------------------------------------------------


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


def csv_list(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> list[str]:
    """Click callback: a repeatable option whose values may also be comma-separated."""
    return [item for raw in value for item in raw.split(",") if item]


# --- options ------------------------------------------------------------------------


def tunable(*decls: str, show_default: bool | str = True, **attrs: Any) -> Decorator:
    """An option with a default (from common.defaults) that --help shows (or, given a
    string `show_default`, describes)."""
    return click.option(*decls, show_default=show_default, **attrs)


def int_option(*decls: str, minimum: int = 1, **attrs: Any) -> Decorator:
    """A tunable integer (a count, a size), at least `minimum`."""
    return tunable(*decls, type=click.IntRange(min=minimum), **attrs)


def seconds_option(*decls: str, minimum: float = 1, **attrs: Any) -> Decorator:
    """A tunable duration in seconds, at least `minimum`."""
    return tunable(*decls, type=click.FloatRange(min=minimum), **attrs)


def redis_url_option(func: F) -> F:
    return click.option(
        "--redis-url",
        envvar="REGEN_REDIS_URL",
        metavar="URL",
        help="redis://[:password@]host:port/db, rediss:// for TLS, or "
        "sentinel://[:password@]host:26379;sentinel://host2:26379/db with "
        "REGEN_REDIS_SENTINEL_MASTER (env REGEN_REDIS_URL; default: the embedded Redis).",
    )(func)


# What loads the target's tokenizer and shapes its chat template.
MODEL = click.option(
    "--model",
    required=True,
    envvar="REGEN_MODEL",
    help="HF model folder, a .gguf file, or 'smollm2' (the bundled SmolLM2-135M).",
)
TOKENIZER = click.option("--tokenizer", help="Load the tokenizer from here instead.")
TRUST_REMOTE_CODE = click.option(
    "--trust-remote-code",
    is_flag=True,
    help="Allow the tokenizer's own code (Kimi's tiktoken tokenizer needs it).",
)
CHAT_TEMPLATE_KWARGS = click.option(
    "--chat-template-kwargs",
    callback=json_object,
    metavar="JSON",
    help="Extra chat template kwargs, e.g. '{\"preserve_thinking\": true}'.",
)
THINKING = click.option(
    "--thinking/--no-thinking",
    default=None,
    help="Thinking mode, mapped to the chat template's switch "
    "(Kimi: thinking, Qwen3: enable_thinking). Default: the template's.",
)


def max_new_tokens_option(default: int) -> Decorator:
    return int_option(
        "--max-new-tokens",
        default=default,
        help="Always sent: SGLang's own default is only 128.",
    )


# What decides the prompt ids the server gets: the model, its tokenizer and chat template
# settings, and the limits on prompts. `enqueue` and `plan` share them, so a plan counts
# exactly what an enqueue would send.
TARGET = (
    MODEL,
    TOKENIZER,
    TRUST_REMOTE_CODE,
    max_new_tokens_option(defaults.MAX_NEW_TOKENS),
    THINKING,
    CHAT_TEMPLATE_KWARGS,
    click.option("--system-prompt", help="System message for rows that have none."),
    click.option(
        "--max-prompt-tokens",
        type=click.IntRange(min=1),
        help="Longer prompts go to the input DLQ.",
    ),
    click.option(
        "--context-length",
        type=click.IntRange(min=2),
        help="The server's context length (default: from the model's config).",
    ),
    click.option(
        "--max-row-bytes",
        type=click.IntRange(min=1),
        help="Prompts with more bytes of text go to the input DLQ untokenized "
        "(default: the most that could fit the prompt token limit).",
    ),
    click.option(
        "--turns",
        type=click.Choice(TURN_MODES),
        default=TURNS_LAST,
        show_default=True,
        help="Regenerate the last assistant turn, on the dataset's history, or every "
        "turn in order, each on the target's own earlier answers (one record a turn).",
    ),
    click.option(
        "--samples",
        type=click.IntRange(min=1),
        default=1,
        show_default=True,
        help="Answers per prompt, each with its own seed (ids PROMPT-s0, PROMPT-s1, ...).",
    ),
)


def tokenizer_options(func: F) -> F:
    """The target's tokenizer and chat template kwargs (`preflight`)."""
    return apply(func, [MODEL, TOKENIZER, TRUST_REMOTE_CODE, CHAT_TEMPLATE_KWARGS])


def job_options(job: Decorator, *more: Decorator) -> Callable[[F], F]:
    """The job name option `job`, the target options and `more` of JobOptions' fields,
    given to the command as one `options: JobOptions`."""
    return options_object("options", _job_options, job, *TARGET, *more)


def _job_options(**values: Any) -> JobOptions:
    # Imported here: `regen --help` should not load the tokenizer machinery.
    from regen.producer.spec import JobOptions

    return JobOptions(**values)


def prepare_job_or_fail(options: JobOptions) -> PreparedJob:
    """`producer.spec.prepare_job`, its refusals shown as a command-line error."""
    from regen.common.jobspec import JobSpecError
    from regen.producer.spec import prepare_job

    try:
        return prepare_job(options)
    except (ValueError, JobSpecError) as exc:
        raise click.ClickException(str(exc)) from exc


def print_json_or_text(document: Any, as_json: bool) -> None:
    """A report (`to_json()`, `to_text()`) as indented JSON or as text."""
    if as_json:
        click.echo(orjson.dumps(document.to_json(), option=orjson.OPT_INDENT_2).decode())
    else:
        click.echo(document.to_text())


class ShardsLocation(click.ParamType):
    """A shard folder: a local path, or an object storage URL (`s3://bucket/prefix`,
    `gs://`, `az://`), kept a str since pathlib would fold its `//` (the old bug: a
    local folder named `s3:`)."""

    name = "PATH|URL"

    def __init__(self, exists: bool = False) -> None:
        self.exists = exists  # a local path must be an existing folder

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> Path | str:
        text = str(value)
        if is_bucket_url(text):
            return text
        if "://" in text:
            self.fail(
                f"{text}: not a folder, and not an object storage URL regen reads "
                f"({', '.join(f'{s}://' for s in BUCKET_SCHEMES)})",
                param,
                ctx,
            )
        path = Path(text)
        if self.exists and not path.is_dir():
            self.fail(f"{text}: no such folder", param, ctx)
        return path
