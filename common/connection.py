"""Redis URLs and clients: one way to connect, and secrets kept out of logs."""

from __future__ import annotations

from typing import Any, cast
from urllib.parse import parse_qs, urlsplit, urlunsplit

import redis

from regen.common import settings


def redact(url: str) -> str:
    """The URL with any password replaced by '***', safe to print and log."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    netloc = f"{user}:***@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def is_tls(url: str) -> bool:
    return urlsplit(url).scheme == "rediss"


def tls_options(url: str) -> dict[str, object]:
    """kombu/Celery's `broker_use_ssl` dict for a rediss:// URL.

    Celery refuses a rediss URL without `ssl_cert_reqs`; regen defaults to verifying the
    server certificate (CERT_REQUIRED) and lets the URL's query override it.
    """
    import ssl

    query = {k: v[-1] for k, v in parse_qs(urlsplit(url).query).items()}
    reqs = {
        "required": ssl.CERT_REQUIRED,
        "cert_required": ssl.CERT_REQUIRED,
        "optional": ssl.CERT_OPTIONAL,
        "cert_optional": ssl.CERT_OPTIONAL,
        "none": ssl.CERT_NONE,
        "cert_none": ssl.CERT_NONE,
    }
    options: dict[str, object] = {
        "ssl_cert_reqs": reqs.get(query.get("ssl_cert_reqs", "required").lower(), ssl.CERT_REQUIRED)
    }
    for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
        if name in query:
            options[name] = query[name]
    return options


def client(url: str) -> redis.Redis:
    """A client that returns bytes; callers decode what they need."""
    return redis.Redis.from_url(url, health_check_interval=30, socket_keepalive=True)


# Errors that say Redis cannot be reached (down, restarting, still loading its AOF), not
# that a command was wrong: long-running loops wait these out instead of exiting.
OUTAGE_ERRORS: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError)


# client() replies are bytes, but redis-py's stubs type them as bytes | str whatever the
# client: these tell the type checker what a set or hash reply really holds.
def bytes_set(reply: Any) -> set[bytes]:
    return cast("set[bytes]", reply)


def bytes_hash(reply: Any) -> dict[bytes, bytes]:
    return cast("dict[bytes, bytes]", reply)


def resolve_url(url: str | None) -> str:
    """The Redis URL to use: the option, else REGEN_REDIS_URL, else the embedded server.

    The embedded server is started (or reused) on demand, so a single-host run needs no
    Redis set-up at all.
    """
    if url:
        return url
    configured = settings.current().redis_url
    if configured:
        return configured
    from regen.common.embedded_redis import EmbeddedRedis

    return EmbeddedRedis.from_env().ensure_running()
