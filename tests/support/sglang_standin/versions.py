"""What differs between the SGLang releases the stand-in imitates (its `version` option).

Each fact was read in a release's wheel: 0.4.6.post5, 0.4.10.post2, 0.5.3, 0.5.4,
0.5.5, 0.5.6 and 0.5.23. A version between two of them is imitated as the older one,
since where the change landed in between was not read.

- Replies: 0.4.x detokenize into `{"text", "meta_info"}` with no `output_ids` (only
  `--skip-tokenizer-init` gives ids); 0.5.x carry `output_ids` beside `text`.
- Info routes: `/get_server_info` and `/get_model_info` everywhere; `/server_info` and
  `/model_info` from 0.5.6 on.
- POST /abort_request: 0.4.6 takes `{"rid": R}` only (`abort_all` came by 0.4.10); a
  request still in the waiting queue, aborted, gets no reply at all in 0.4.6 (its state
  is dropped and `/generate` hangs until the client leaves), `{"text": ""}` with no
  `output_ids` ("Abort before prefill") from 0.4.10 to 0.5.4, and its tokens so far
  ("Abort in waiting queue") from 0.5.5 on. 0.5.23 guards the route with
  `--admin-api-key`, which 0.5.6 does not have.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

OLDEST = (0, 4, 6)


class QueuedAbort(Enum):
    """What the /generate call of a request aborted in the waiting queue gets back."""

    HANG = "hang"  # nothing: the tokenizer manager dropped its state
    BEFORE_PREFILL = "before_prefill"  # {"text": ""}, no output_ids
    SO_FAR = "so_far"  # output_ids so far ([], or a retracted request's)


@dataclass(frozen=True)
class Release:
    number: tuple[int, int, int]

    @classmethod
    def parse(cls, version: str) -> Release:
        """`0.5.6`, `0.4.6.post5`, `0.5.0rc1`: the first three numbers count."""
        found = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
        if found is None:
            raise ValueError(f"version {version!r} is not an SGLang release like 0.5.6")
        number = (int(found[1]), int(found[2]), int(found[3]))
        if number < OLDEST:
            raise ValueError(f"version {version!r}: the stand-in imitates 0.4.6 and later")
        return cls(number)

    @property
    def output_ids(self) -> bool:
        return self.number >= (0, 5, 0)

    @property
    def short_info_routes(self) -> bool:
        """Whether /server_info and /model_info are served beside their /get_ names."""
        return self.number >= (0, 5, 6)

    @property
    def abort_all(self) -> bool:
        return self.number >= (0, 4, 10)

    @property
    def queued_abort(self) -> QueuedAbort:
        if self.number < (0, 4, 10):
            return QueuedAbort.HANG
        return QueuedAbort.BEFORE_PREFILL if self.number < (0, 5, 5) else QueuedAbort.SO_FAR

    @property
    def admin_api_key(self) -> bool:
        return self.number >= (0, 5, 23)

    @property
    def abort_meta_extras(self) -> bool:
        """Whether a waiting-queue abort's meta_info has `weight_version` and
        `e2e_latency` (0.5.23; 0.5.6 has `id`, `finish_reason`, `completion_tokens`)."""
        return self.number >= (0, 5, 23)
