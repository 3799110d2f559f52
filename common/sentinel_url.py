"""Redis Sentinel URLs in Celery's form, read once for regen's own clients and for kombu.

`sentinel://[USER:PASSWORD@]HOST:PORT;sentinel://HOST2:PORT;...[/DB]`: one entry per
sentinel, separated by `;`. The password (on any entry) is the primary's, as for Celery;
the database is a trailing `/N` (on any entry; entries that name two differ are an error).
kombu reads the password and database from the first entry only, so `broker_url()`
writes them onto every entry: regen's clients and Celery's then reach the same database.
The name the sentinels know the primary by comes from REGEN_REDIS_SENTINEL_MASTER
(common.settings), not the URL, as Celery takes it from a transport option.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

SCHEME = "sentinel"
# The port a sentinel listens on unless told (Redis's own default for `--sentinel`).
DEFAULT_PORT = 26379


class RedisUrlError(ValueError):
    """A Redis URL regen cannot use; its text is a one-line explanation."""


def is_sentinel(url: str) -> bool:
    return url.strip().lower().startswith(f"{SCHEME}://")


@dataclass(frozen=True)
class SentinelUrl:
    sentinels: tuple[tuple[str, int], ...]
    db: int = 0
    username: str | None = None
    password: str | None = None

    def broker_url(self) -> str:
        """The URL to hand kombu: every entry with the login and the database."""
        login = ""
        if self.password is not None or self.username is not None:
            user = quote(self.username or "", safe="")
            login = f"{user}:{quote(self.password or '', safe='')}@"
        return ";".join(
            f"{SCHEME}://{login}{_host(host)}:{port}/{self.db}" for host, port in self.sentinels
        )


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host  # an IPv6 address


def entries(url: str) -> list[str]:
    """The URL's entries, each with its scheme (Celery also allows `sentinel://a;b:26379`)."""
    parts = [part.strip() for part in url.strip().split(";") if part.strip()]
    return [part if "://" in part else f"{SCHEME}://{part}" for part in parts]


def parse(url: str) -> SentinelUrl:
    sentinels: list[tuple[str, int]] = []
    dbs: set[int] = set()
    users: set[str] = set()
    passwords: set[str] = set()
    for entry in entries(url):
        try:
            parts = urlsplit(entry)
            port = parts.port or DEFAULT_PORT
        except ValueError as exc:  # a port that is not a number
            raise RedisUrlError(f"bad sentinel URL entry ({exc})") from None
        if parts.scheme.lower() != SCHEME:
            raise RedisUrlError(
                f"every entry of a sentinel URL must be sentinel://, not {parts.scheme}://"
            )
        if not parts.hostname:
            raise RedisUrlError("a sentinel URL entry has no host")
        if parts.query or parts.fragment:
            raise RedisUrlError(
                "a sentinel URL takes no ?options (TLS to sentinels is not supported)"
            )
        path = parts.path.strip("/")
        if path:
            if not path.isdigit():
                raise RedisUrlError(f"a sentinel URL's database must be a number, not {path!r}")
            dbs.add(int(path))
        if parts.username:
            users.add(unquote(parts.username))
        if parts.password is not None:
            passwords.add(unquote(parts.password))
        sentinels.append((parts.hostname, port))
    if not sentinels:
        raise RedisUrlError("a sentinel URL names no sentinel")
    for what, values in (("databases", dbs), ("users", users), ("passwords", passwords)):
        if len(values) > 1:
            raise RedisUrlError(f"the entries of the sentinel URL give different {what}")
    return SentinelUrl(
        sentinels=tuple(sentinels),
        db=dbs.pop() if dbs else 0,
        username=users.pop() if users else None,
        password=passwords.pop() if passwords else None,
    )
