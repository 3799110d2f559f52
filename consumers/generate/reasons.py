"""Why the generate stage dead-letters a prompt: the generate DLQ's reason codes."""

from __future__ import annotations

from regen.common.dlq import ReasonCode


class Reason(ReasonCode):
    # The server refused the prompt itself (e.g. longer than its context).
    REJECTED_BY_SERVER = "rejected_by_server"
    # Its chunk was delivered more than the attempt cap without finishing.
    POISON_CHUNK = "poison_chunk"
    # A chunk message that does not parse: no prompt can be named, the message is kept.
    MALFORMED_CHUNK = "malformed_chunk"
