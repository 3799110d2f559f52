"""Requeue dead letters: send each entry back into the stage that can retry it.

- A generate entry becomes a prompt of a new chunk on the job's generate queue, with the
  sampling override given (`--set`) merged over the one it last ran with. So does an
  input entry refused as too long, once it fits (e.g. with a smaller max_new_tokens),
  and, with `regenerate`, a tokenize entry (its stored prompt, generated afresh).
  Prompts are grouped into chunks of the job's chunk size, one chunk per stage and
  override, since a chunk has one DLQ to leave and one set of sampling params.
- A tokenize entry is otherwise re-checked: its stored result goes back on the job's
  results stream, exactly as generated (e.g. after a fix to the checks, or for a tokenize
  worker run with `--on-truncated keep`).

Each step is one Redis script that removes entries from the DLQ and queues their work
together, so a requeue killed at any instant leaves every entry either still in the DLQ
or queued, never both and never neither. Requeued chunk ids are salted per run: a new
chunk never meets the bookkeeping (done marks, attempts) of the chunk its prompts came
in. No backpressure is needed: an entry leaves Redis as its chunk enters it.

A turn of a conversation (`--turns all`) resumes the conversation from that turn, on the
history its entry holds; the entries of the later turns blocked behind it leave the DLQ
in the same step, as ids of the new chunk (common/conversation.py).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis
from celery import Celery

from regen.common import chat_family, crashpoints, dlq, keys
from regen.common.chunk import Chunk, ChunkPrompt
from regen.common.conversation import BLOCKED, Conversation
from regen.common.jobspec import SAMPLING_KEYS, JobSpec, JobSpecError
from regen.common.ledger.places import is_prompt_entry
from regen.common.results import FIELD, GeneratedResult
from regen.producer.publish import ChunkPublisher
from regen.producer.rows import Reason as InputReason

# Where a crash test stops a requeue: right after one step (a chunk, a re-check) is in.
CRASHPOINT = "dlq.requeue_step"

# KEYS: dlq tokenize hash, results stream, counters hash; ARGV: entry id, field, result.
_RECHECK_LUA = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('XADD', KEYS[2], '*', ARGV[2], ARGV[3])
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HINCRBY', KEYS[3], 'requeued', 1)
return 1
"""


class RequeueError(ValueError):
    """A requeue that cannot start (bad overrides), with the reason."""


class _Refused(Exception):
    """This entry stays in the DLQ; the message says why."""


@dataclass
class RequeueReport:
    chunks: int = 0
    prompts: int = 0  # sent to the generate stage
    rechecked: int = 0  # results sent back to the tokenize stage
    gone: int = 0  # left the DLQ meanwhile (another requeue, a purge, a commit)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (entry id, why)

    def merge(self, other: RequeueReport) -> None:
        self.chunks += other.chunks
        self.prompts += other.prompts
        self.rechecked += other.rechecked
        self.gone += other.gone
        self.skipped += other.skipped


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """`KEY=VALUE` items to sampling overrides: VALUE is JSON (numbers, booleans, lists),
    or else a plain string (`stop=END`); KEY must be a sampling param regen sends."""
    overrides: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep:
            raise RequeueError(f"{item!r} is not KEY=VALUE")
        if name not in SAMPLING_KEYS:
            raise RequeueError(
                f"{name!r} is not an SGLang sampling param regen sends; "
                f"known: {', '.join(sorted(SAMPLING_KEYS))}"
            )
        try:
            overrides[name] = orjson.loads(raw)
        except orjson.JSONDecodeError:
            overrides[name] = raw
    return overrides


def check_overrides(spec: JobSpec, overrides: dict[str, Any]) -> None:
    """Refuse overrides the job spec itself would refuse (unknown keys, a max_new_tokens
    that is not a positive int or leaves no room for a prompt)."""
    try:
        dataclasses.replace(spec, sampling={**spec.sampling, **overrides})
    except JobSpecError as exc:
        raise RequeueError(f"job {spec.name}: {exc}") from exc


class Requeuer:
    """Requeues entries of one job; `add` them, then `finish` (or use it as a context
    manager) to send the last, partial chunks."""

    def __init__(
        self,
        r: redis.Redis,
        app: Celery,
        spec: JobSpec,
        overrides: dict[str, Any],
        *,
        regenerate: bool = False,
    ) -> None:
        check_overrides(spec, overrides)
        self.report = RequeueReport()
        self._spec = spec
        self._overrides = overrides
        self._regenerate = regenerate
        self._publisher = ChunkPublisher(app, r, spec)
        self._recheck = r.register_script(_RECHECK_LUA)
        self._salt = f"requeue:{uuid.uuid4().hex}"
        # (stage, override as sorted JSON) -> prompts waiting for a full chunk.
        self._buckets: dict[tuple[str, bytes], list[ChunkPrompt]] = {}
        self._tokenizer: Any = None
        self._tokenizer_refused: str | None = None
        # Blocked turns seen (entry id, the turn it waits for), and the ids requeued.
        self._blocked: list[tuple[str, str]] = []
        self._requeued: set[str] = set()

    def __enter__(self) -> Requeuer:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.finish()
        else:  # entries not yet sent simply stay in the DLQ
            self._publisher.close()

    def add(self, letter: dlq.DeadLetter) -> None:
        if letter.job != self._spec.name:
            raise ValueError(f"entry of job {letter.job!r} given to job {self._spec.name!r}")
        if letter.reason == BLOCKED:  # it goes with the turn it waits for
            self._blocked.append((letter.entry_id, str(letter.payload.get("blocked_by"))))
            return
        try:
            if letter.stage == "tokenize" and not self._regenerate:
                self._send_to_recheck(letter)
                return
            prompt, override = self._prompt(letter)
        except _Refused as exc:
            self.report.skipped.append((letter.entry_id, str(exc)))
            return
        key = (letter.stage, orjson.dumps(override, option=orjson.OPT_SORT_KEYS))
        bucket = self._buckets.setdefault(key, [])
        if any(p.id == prompt.id for p in bucket):
            return  # HSCAN may return an entry twice
        bucket.append(prompt)
        if len(bucket) >= self._spec.chunk_size:
            self._publish(letter.stage, override, self._buckets.pop(key))

    def finish(self) -> RequeueReport:
        try:
            for (stage, override), prompts in self._buckets.items():
                self._publish(stage, orjson.loads(override), prompts)
            self._buckets.clear()
        finally:
            self._publisher.close()
        for entry_id, blocker in self._blocked:
            if entry_id not in self._requeued:
                why = f"waits for {blocker}: requeue that turn and the ones after it come along"
                self.report.skipped.append((entry_id, why))
        return self.report

    # --- what an entry becomes -----------------------------------------------------

    def _prompt(self, letter: dlq.DeadLetter) -> tuple[ChunkPrompt, dict[str, Any]]:
        """The prompt to generate again, and the sampling override to generate it with."""
        payload = letter.payload
        if letter.stage == "generate":
            if not is_prompt_entry(letter.entry_id):
                raise _Refused(
                    f"{letter.reason}: a queue message that was no chunk of its queue, so no "
                    "prompt to requeue; see it with `regen dlq show`, then purge it"
                )
            if "prompt_ids" not in payload or not payload.get("messages"):
                raise _Refused(f"{letter.reason}: no prompt stored (see `regen dlq show`)")
            prompt = ChunkPrompt(
                id=letter.prompt_id or letter.entry_id,
                prompt_ids=payload["prompt_ids"],
                messages=payload["messages"],
                source=letter.source or {},
                tools=payload.get("tools"),
                conversation=_conversation(payload),
            )
            return prompt, {**(payload.get("sampling") or {}), **self._overrides}
        if letter.stage == "tokenize":
            result = _stored_result(letter)
            # A turn of a conversation is generated again as that one turn.
            turn = None
            if result.conversation_id is not None and result.turn is not None:
                turn = Conversation(result.conversation_id, start=result.turn)
            prompt = ChunkPrompt(
                id=result.id,
                prompt_ids=result.prompt_ids,
                messages=result.messages,
                source=result.source,
                tools=result.tools,
                conversation=turn,
            )
            return prompt, {**result.sampling, **self._overrides}
        return self._render_input(letter), dict(self._overrides)

    def _render_input(self, letter: dlq.DeadLetter) -> ChunkPrompt:
        """An input entry refused as too long, rendered again as the producer would."""
        if letter.reason != InputReason.PROMPT_TOO_LONG:
            if letter.entry_id.startswith("row:"):
                raise _Refused(
                    f"{letter.reason}: a dataset row that gave no prompt; fix the row, "
                    "enqueue the file again, then purge this entry"
                )
            raise _Refused(f"{letter.reason}: only prompt_too_long input entries can retry")
        spec = dataclasses.replace(self._spec, sampling={**self._spec.sampling, **self._overrides})
        messages, tools = letter.payload["messages"], letter.payload.get("tools")
        ids = chat_family.render_prompt_ids(
            self._load_tokenizer(), messages, spec.chat_template_kwargs, tools
        )
        limit = spec.prompt_token_limit()
        if limit is not None and len(ids) > limit:
            raise _Refused(
                f"still too long: {len(ids)} tokens, the job allows {limit} with "
                f"max_new_tokens {spec.sampling['max_new_tokens']}"
            )
        return ChunkPrompt(
            id=letter.prompt_id or letter.entry_id,
            prompt_ids=ids,
            messages=messages,
            source=letter.source or {},
            tools=tools,
            conversation=_conversation(letter.payload),
        )

    def _load_tokenizer(self) -> Any:
        if self._tokenizer_refused is not None:
            raise _Refused(self._tokenizer_refused)
        if self._tokenizer is None:
            # Imported here: transformers takes seconds, and only input entries need it.
            from regen.common.tokenizer import TokenizerMismatch, load_job_tokenizer

            try:
                self._tokenizer = load_job_tokenizer(self._spec)
            except TokenizerMismatch as exc:
                # Ids from another tokenizer would not be the ones the job's prompts had.
                self._tokenizer_refused = "the tokenizer here differs from the job's"
                raise _Refused(self._tokenizer_refused) from exc
        return self._tokenizer

    # --- the atomic steps ----------------------------------------------------------

    def _publish(self, stage: str, override: dict[str, Any], prompts: list[ChunkPrompt]) -> None:
        job = self._spec.name
        while prompts:
            ids = [pid for p in prompts for pid in p.accounted_ids]
            chunk = Chunk(job, Chunk.make_id(job, ids, salt=self._salt), prompts, override)
            gone = set(
                self._publisher.requeue(
                    chunk.chunk_id, chunk.to_payload(), ids, keys.dlq(job, stage)
                )
            )
            if not gone:
                self.report.chunks += 1
                self.report.prompts += len(ids)
                self._requeued.update(ids)
                crashpoints.hit(CRASHPOINT)
                return
            self.report.gone += len(gone)
            for p in prompts:
                if p.id not in gone and not gone.isdisjoint(p.accounted_ids):
                    why = "a later turn of its conversation left the DLQ (purged?): purge it too"
                    self.report.skipped.append((p.id, why))
            prompts = [p for p in prompts if gone.isdisjoint(p.accounted_ids)]

    def _send_to_recheck(self, letter: dlq.DeadLetter) -> None:
        if self._overrides:
            raise _Refused(
                "a re-check replays the stored result as generated, so --set cannot apply "
                "(add --regenerate to generate it again with new params)"
            )
        result = _stored_result(letter)
        job = self._spec.name
        done = self._recheck(
            keys=[keys.dlq(job, "tokenize"), keys.results_stream(job), keys.job_counters(job)],
            args=[letter.entry_id, FIELD, result.to_fields()[FIELD]],
        )
        if done:
            self.report.rechecked += 1
            crashpoints.hit(CRASHPOINT)
        else:
            self.report.gone += 1


def _conversation(payload: dict[str, Any]) -> Conversation | None:
    """The rest of the conversation a turn's entry resumes, if it is one's."""
    rest = payload.get("conversation")
    return None if rest is None else Conversation(**rest)


def _stored_result(letter: dlq.DeadLetter) -> GeneratedResult:
    raw = letter.payload.get("result")
    if raw is None:
        raise _Refused(
            f"{letter.reason}: the result was not kept, so there is nothing to re-check or "
            "regenerate; purge the entry"
        )
    return GeneratedResult(**raw)
