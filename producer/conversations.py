"""Cut a prompt into the turns `--turns all` regenerates (common/conversation.py).

The messages `rows.to_prompt` gives (system first, ending on a user turn, trailing
assistant turns dropped) are cut at each run of assistant messages: a turn is
regenerated after each group of other messages, and the dataset's own assistant
messages are dropped, since the target writes its own. So a row with n user turns gives
n turns, the last one answering its last user turn as `--turns last` does.
"""

from __future__ import annotations

from typing import Any

from regen.common.conversation import Conversation
from regen.common.jobspec import TURNS_ALL, JobSpec
from regen.producer.rows import BadRow, Prompt, Reason, prompt_id, to_prompt

# Stands for an assistant turn in the content a conversation id is derived from: the id
# depends on where the turns are, never on the dataset's answers.
_TURN = {"role": "assistant"}


def job_prompt(row: object, spec: JobSpec) -> tuple[Prompt, Conversation | None]:
    """A dataset row as the job regenerates it: the prompt to send (the first turn's with
    `--turns all`) and, with `--turns all`, its conversation; raises BadRow."""
    prompt = to_prompt(row, system_prompt=spec.system_prompt, prompt_text=spec.prompt_text)
    if spec.turns == TURNS_ALL:
        return split_turns(prompt)
    return prompt, None


def split_turns(prompt: Prompt) -> tuple[Prompt, Conversation]:
    """(the first turn's prompt, the conversation); raises BadRow for an assistant
    message before any user message, which no turn could regenerate."""
    # The messages as written are what is rendered; their normalized key (one message
    # for each) is what the ids hash.
    keyed = prompt.messages if prompt.key is None else prompt.key
    groups: list[list[dict[str, Any]]] = [[]]
    key_groups: list[list[dict[str, Any]]] = [[]]
    for index, (message, key) in enumerate(zip(prompt.messages, keyed, strict=True)):
        if message["role"] != "assistant":
            groups[-1].append(message)
            key_groups[-1].append(key)
        elif not any(m["role"] == "user" for m in groups[0]):
            raise BadRow(
                Reason.BAD_ORDER,
                f"message {index} is an assistant turn before any user turn; --turns all "
                "regenerates every assistant turn, each answering the turns before it",
            )
        elif groups[-1]:  # a run of assistant messages is one turn
            groups.append([])
            key_groups.append([])
    conversation_id = prompt_id([m for group in key_groups for m in [*group, _TURN]], prompt.tools)
    first = Prompt(
        messages=groups[0],
        tools=prompt.tools,
        source_id=prompt.source_id,
        key=None if prompt.key is None else key_groups[0],
    )
    return first, Conversation(id=conversation_id, later=groups[1:])
