"""The Celery app every regen process shares, and the broker settings that keep delivery safe.

All processes on one broker must agree on the visibility timeout, the lease on a
delivered chunk (kombu's sweep, run by every consumer, restores an unacked message whose
lease has not been renewed for that long), so it is read from one place:
REGEN_VISIBILITY_TIMEOUT, else common.defaults (common.settings).
"""

from __future__ import annotations

import orjson
from celery import Celery
from kombu import serialization

from regen.common import defaults, sentinel_url, settings
from regen.common.connection import is_tls, master_name, sentinel_options, tls_options

GENERATE_TASK = "regen.generate_chunk"

# Chunks travel as JSON written and read by orjson, under a content type of their own:
# kombu's json serializer calls a Python hook for every object it decodes, and Celery
# decodes each task body twice (its strategy looks into it, then the task's tracer),
# which took ~5% of a generate worker's CPU. Messages enqueued as "application/json"
# by earlier versions are still accepted. docs/design/delivery.md, "JSON, never pickle".
CHUNK_SERIALIZER = "regen-json"
CHUNK_CONTENT_TYPE = "application/x-regen+json"
serialization.register(
    CHUNK_SERIALIZER,
    orjson.dumps,
    orjson.loads,
    content_type=CHUNK_CONTENT_TYPE,
    content_encoding="utf-8",
)


def broker_transport_options() -> dict[str, object]:
    configured = settings.current()
    return {
        "visibility_timeout": configured.visibility_timeout_s,
        "unacked_restore_interval": configured.restore_interval_s,
        "unacked_restore_throttle": configured.restore_throttle,
        "unacked_mutex_expire": defaults.UNACKED_MUTEX_EXPIRE_S,
        # Fail fast on a half-open connection instead of hanging a publish forever.
        "socket_timeout": 60,
        "socket_connect_timeout": 10,
        "health_check_interval": 30,
    }


def broker(redis_url: str) -> tuple[str, dict[str, object]]:
    """The broker URL and transport options for regen's Redis URL.

    A sentinel URL goes to kombu's sentinel transport with the primary's name
    (`master_name`) and the sentinels' own options (`sentinel_kwargs`), rewritten so each
    entry carries the login and database: kombu reads them off the first entry only
    (common/sentinel_url.py), and regen's own clients must reach the same database.
    """
    options = broker_transport_options()
    if not sentinel_url.is_sentinel(redis_url):
        return redis_url, options
    parsed = sentinel_url.parse(redis_url)
    options.update(master_name=master_name(), sentinel_kwargs=sentinel_options())
    return parsed.broker_url(), options


def make_app(redis_url: str) -> Celery:
    broker_url, transport_options = broker(redis_url)
    app = Celery("regen", broker=broker_url, set_as_current=False)
    app.conf.update(
        # JSON only: a pickle in Redis would run code on every worker (docs/design/delivery.md,
        # "JSON, never pickle").
        task_serializer=CHUNK_SERIALIZER,
        accept_content=["json", CHUNK_SERIALIZER],
        result_serializer="json",
        task_ignore_result=True,
        result_backend=None,
        # Ack after the results are handed off; a killed worker's chunk comes back.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        # A chunk keeps running across a Redis blip: its lease says who holds it, and a
        # worker that lost it drops its results (docs/design/delivery.md, Delivery protocol). The
        # thread pool could not cancel a running task anyway.
        worker_cancel_long_running_tasks_on_connection_loss=False,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        broker_transport_options=transport_options,
        # Events on, so Flower and `celery events` see the workers.
        worker_send_task_events=True,
        task_send_sent_event=True,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
    )
    if is_tls(redis_url):
        app.conf.broker_use_ssl = tls_options(redis_url)
    return app
