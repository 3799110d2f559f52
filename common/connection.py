"""Redis URLs and clients: one way to connect, and secrets kept out of logs.

Every regen process builds its Redis clients here (`client`) and its Celery broker from
the same URL (common.celery_app), so a `sentinel://` URL is followed through a failover
by all of them alike (docs/operations.md, Redis Sentinel).
"""

from __future__ import annotations

from typing import Any, cast
from urllib.parse import parse_qs, urlsplit, urlunsplit

import redis
import redis.sentinel

from regen.common import sentinel_url, settings
from regen.common.sentinel_url import RedisUrlError

# Sentinels answer in milliseconds; a dead one must not hold up asking the next one.
SENTINEL_TIMEOUT_S = 5.0


def redact(url: str) -> str:
    """The URL with any password replaced by '***', safe to print and log."""
    if sentinel_url.is_sentinel(url):  # several entries, each may carry the password
        return ";".join(_redact_one(entry) for entry in sentinel_url.entries(url))
    return _redact_one(url)


def _redact_one(url: str) -> str:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises on a malformed port: then hide all but the scheme)
    except ValueError:
        return f"{url.partition('://')[0]}://***"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    netloc = f"{user}:***@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def is_tls(url: str) -> bool:
    return not sentinel_url.is_sentinel(url) and urlsplit(url).scheme == "rediss"


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


def client(url: str, **options: Any) -> redis.Redis:
    """A client that returns bytes; callers decode what they need. `options` are
    redis-py connection options (e.g. socket_timeout).

    A sentinel:// URL gives a client of the primary the sentinels name: each new
    connection asks them where it is, and one that finds the primary gone or demoted
    (ConnectionError, READONLY) drops and asks again, so a failover looks like a short
    outage (OUTAGE_ERRORS) to every loop that waits those out.
    """
    kwargs: dict[str, Any] = {"health_check_interval": 30, "socket_keepalive": True, **options}
    if not sentinel_url.is_sentinel(url):
        return redis.Redis.from_url(url, **kwargs)
    parsed = sentinel_url.parse(url)
    master = master_name()
    sentinels = redis.sentinel.Sentinel(list(parsed.sentinels), sentinel_kwargs=sentinel_options())
    return sentinels.master_for(
        master,
        redis_class=redis.Redis,
        db=parsed.db,
        username=parsed.username,
        password=parsed.password,
        **kwargs,
    )


def master_name() -> str:
    """REGEN_REDIS_SENTINEL_MASTER; a sentinel URL without it is an error."""
    master = settings.current().redis_sentinel_master
    if not master:
        raise RedisUrlError(
            "a sentinel:// Redis URL needs REGEN_REDIS_SENTINEL_MASTER, the name the "
            "sentinels know the primary by (their `sentinel monitor NAME ...`)"
        )
    return master


def sentinel_options() -> dict[str, Any]:
    """Connection options for the sentinels themselves (not the primary)."""
    options: dict[str, Any] = {
        "socket_timeout": SENTINEL_TIMEOUT_S,
        "socket_connect_timeout": SENTINEL_TIMEOUT_S,
    }
    password = settings.current().redis_sentinel_password
    if password:
        options["password"] = password
    return options


# Errors that say Redis cannot be reached (down, restarting, still loading its AOF, or
# mid-failover), not that a command was wrong: long-running loops wait these out instead
# of exiting. READONLY: a demoted primary still answering a plain redis:// client (a
# sentinel client turns it into a ConnectionError and asks the sentinels again).
# MasterNotFoundError (a ConnectionError): no sentinel names a primary yet.
OUTAGE_ERRORS: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.ReadOnlyError,
    redis.sentinel.MasterNotFoundError,
)


def raise_if_refused(exc: Exception) -> None:
    """Raise `exc`, caught as one of OUTAGE_ERRORS, when it is a refused login: redis-py
    makes AuthenticationError a ConnectionError, but no wait fixes a wrong password,
    so a loop that waits out outages must not wait on it."""
    if isinstance(exc, redis.AuthenticationError):
        raise exc


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
