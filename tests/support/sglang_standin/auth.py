"""SGLang's API keys (`--api-key`, `--admin-api-key`), as its auth middleware decides
(0.5.23 `srt/utils/auth.py` `decide_request_auth`; 0.5.6 `add_api_key_middleware`).

- Health and metrics answer without a key (`/health*`, `/metrics*`: probes and scrapers
  carry no secrets), and so do the stand-in's own test-only `/_...` routes.
- `/abort_request` is ADMIN_OPTIONAL: with an admin key it takes that key alone (the
  api key is refused), else the api key when there is one.
- Every other route takes the api key when there is one (an admin key alone leaves
  them open).

A refusal is HTTP 401 `{"error": "Unauthorized"}`. The bearer must read exactly
`Bearer KEY`, as 0.5.6 compares it (0.5.23 also takes a lower-case `bearer`).
"""

from __future__ import annotations

import secrets

OPEN_PREFIXES = ("/health", "/metrics", "/_")
ADMIN_OPTIONAL = frozenset({"/abort_request"})
UNAUTHORIZED = {"error": "Unauthorized"}


def allowed(
    path: str, authorization: str | None, api_key: str | None, admin_api_key: str | None
) -> bool:
    """Whether a request to `path` with this Authorization header gets through."""
    if path.startswith(OPEN_PREFIXES):
        return True
    expected = admin_api_key if path in ADMIN_OPTIONAL and admin_api_key else api_key
    if expected is None:
        return True
    # Bytes: compare_digest refuses a str with characters beyond ASCII.
    return authorization is not None and secrets.compare_digest(
        authorization.encode(), f"Bearer {expected}".encode()
    )
