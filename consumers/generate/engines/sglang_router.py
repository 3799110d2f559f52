"""The SGLang servers behind SGLang's router (sglang-router), from its worker list.

regen sends generations to a router as to one server (docs/design/sglang.md, "Behind SGLang's
router"); what must reach each server on its own, such as its /metrics, asks the router
which servers it routes to.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson

from regen.consumers.generate.engines.sglang_pool import split_credentials

# sglang-router 0.2 and later list workers at /workers as {"workers": [{"url", ...}]};
# older ones at /list_workers as {"urls": [...]}.
WORKER_LIST_PATHS = ("/workers", "/list_workers")
TIMEOUT_S = 10.0
# The data-parallel rank a --dp-aware router appends to a worker's URL.
DP_RANK_SUFFIX = re.compile(r"@\d+$")


class RouterError(RuntimeError):
    """The URL does not list workers: not a router, unreachable, or refused us."""


async def router_worker_urls(
    router_url: str,
    *,
    session: aiohttp.ClientSession | None = None,
    headers: Mapping[str, str] | None = None,
    timeout_s: float = TIMEOUT_S,
) -> list[str]:
    """The base URLs of the SGLang servers registered with the router at `router_url`,
    each once, in the router's order, healthy or not (its health view lags its checks).

    A router started with --dp-aware lists one entry per data-parallel rank,
    `URL@RANK`; those are one server, and it is listed once. Credentials in
    `router_url` are sent as basic auth (they win over an Authorization in `headers`).
    Raises RouterError when the router cannot be asked or has no worker-list endpoint.
    """
    url, label, auth = split_credentials(router_url)
    sent = dict(headers or {})
    if auth is not None:
        sent["Authorization"] = auth.encode()
    own_session = session is None
    http = session or aiohttp.ClientSession(trust_env=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        for path in WORKER_LIST_PATHS:
            status, body = await _get(http, url + path, sent, timeout, label)
            if status == 404:
                continue
            if status != 200:
                text = body.decode("utf-8", "replace")[:300]
                raise RouterError(f"{label}{path} answered HTTP {status}: {text}")
            return parse_worker_list(body, f"{label}{path}")
    finally:
        if own_session:
            await http.close()
    raise RouterError(
        f"{label} has no worker list ({' or '.join(WORKER_LIST_PATHS)} answer 404): "
        "it is not SGLang's router (a plain SGLang server has neither); pass the "
        "servers themselves with --server"
    )


async def _get(
    http: aiohttp.ClientSession,
    url: str,
    headers: Mapping[str, str],
    timeout: aiohttp.ClientTimeout,
    label: str,
) -> tuple[int, bytes]:
    try:
        async with http.get(url, headers=headers, timeout=timeout) as response:
            return response.status, await response.read()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        # The label, not the URL: aiohttp's messages would carry any credentials.
        raise RouterError(f"cannot ask {label} for its workers: {type(exc).__name__}") from None


def parse_worker_list(body: bytes, where: str) -> list[str]:
    """Server URLs from a /workers or /list_workers body, each once (RouterError if it
    is neither); `where` names the endpoint in the error."""
    try:
        data: Any = orjson.loads(body)
        if "workers" in data:
            entries = [worker["url"] for worker in data["workers"]]
        else:
            entries = list(data["urls"])
        if not all(isinstance(entry, str) for entry in entries):
            raise TypeError("a worker URL is not a string")
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise RouterError(f"{where}: not a worker list: {exc!r}") from None
    # dict: each server once, first seen first.
    return list(dict.fromkeys(DP_RANK_SUFFIX.sub("", entry) for entry in entries))
