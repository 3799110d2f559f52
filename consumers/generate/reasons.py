"""Why the generate stage dead-letters a prompt: the generate DLQ's reason codes."""

from __future__ import annotations

from regen.common.conversation import BLOCKED
from regen.common.dlq import ReasonCode


class Reason(ReasonCode):
    # The server refused the prompt itself (e.g. longer than its context).
    REJECTED_BY_SERVER = "rejected_by_server"
    # Its chunk was delivered more than the attempt cap without finishing.
    POISON_CHUNK = "poison_chunk"
    # A message on a generate queue that is no chunk for it (consumers/generate/poison.py),
    # from the outermost layer in: no prompt can be named, the raw message is kept.
    NOT_JSON = "not_json"
    NOT_A_TASK_MESSAGE = "not_a_task_message"
    UNKNOWN_TASK = "unknown_task"
    MALFORMED_CHUNK = "malformed_chunk"
    WRONG_QUEUE = "wrong_queue"
    # A later turn of a conversation (`--turns all`), rendered by the worker, that the
    # template refuses, that is too long for the job, or that the dataset answers with a
    # tool result for a call the target's previous turn did not make.
    TEMPLATE_ERROR = "template_error"
    PROMPT_TOO_LONG = "prompt_too_long"
    TOOL_CALL_DIVERGED = "tool_call_diverged"
    # A turn waiting behind a dead-lettered earlier turn of its conversation.
    BLOCKED = BLOCKED
