"""aiokafka clients built from settings, and offset lookups that hold on any Kafka broker."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.conn import create_conn
from aiokafka.errors import (
    AuthenticationFailedError,
    KafkaConnectionError,
    KafkaError,
    SaslAuthenticationFailed,
)
from aiokafka.producer import sender as aiokafka_sender

from agl_stream.runtime.config import KafkaSettings
from agl_stream.runtime.supervision import Unrecoverable

log = logging.getLogger(__name__)
T = TypeVar("T")

# The most an event's encoded record may hold: under aiokafka's (and Kafka's) default 1 MiB
# request limit. Writers refuse or replace larger events before sending them.
MAX_RECORD_BYTES = 1_000_000


class KafkaCredentialsRefused(KafkaError, Unrecoverable):  # type: ignore[misc]
    """The cluster refused this client's SASL credentials: trying again cannot help, so the
    process stops with the sentence instead of reconnecting in a loop."""

    retriable = False

    def __str__(self) -> str:  # the sentence alone, without KafkaError's class-name prefix
        return str(self.args[0]) if self.args else type(self).__name__


async def refused_credentials(settings: KafkaSettings) -> KafkaCredentialsRefused | None:
    """Why a client could not bootstrap, when the reason is its credentials: aiokafka's
    bootstrap turns every failure into "Unable to bootstrap", so one connection to the first
    broker that answers asks again, and says what the broker said."""
    if settings.sasl_mechanism is None:
        return None
    options = settings.client_options()
    for server in settings.bootstrap_servers.split(","):
        host, _, port = server.rpartition(":")
        try:
            conn = await create_conn(
                host.strip("[]"), int(port), client_id=settings.client_id,
                request_timeout_ms=settings.request_timeout_ms,
                ssl_context=options.get("ssl_context"),
                security_protocol=settings.security_protocol,
                sasl_mechanism=settings.sasl_mechanism,
                sasl_plain_username=settings.sasl_username,
                sasl_plain_password=options.get("sasl_plain_password"),
            )  # fmt: skip
        except (SaslAuthenticationFailed, AuthenticationFailedError) as exc:
            said = str(exc.args[0] if exc.args else "").strip().rstrip(".")
            said = said or type(exc).__name__
            return KafkaCredentialsRefused(
                f"Kafka at {server} refused the {settings.sasl_mechanism} credentials of user "
                f"{settings.sasl_username!r} ({said}); check AGL_STREAM_SASL_USERNAME and "
                "AGL_STREAM_SASL_PASSWORD"
            )
        except (TimeoutError, OSError, KafkaError):
            continue  # not this one's credentials problem: try the next broker
        conn.close()
        return None
    return None


# Credentials checked by this process (a hash of servers, user and password): the first client
# of each asks once before it starts, so refused credentials end the process with one sentence
# before aiokafka's bootstrap logs its own errors and a worker's loops try again.
_accepted: set[str] = set()


async def _start(client: Any, settings: KafkaSettings) -> None:
    if settings.sasl_mechanism is not None:
        secret = settings.sasl_password.get_secret_value() if settings.sasl_password else ""
        key = hashlib.sha256(
            f"{settings.bootstrap_servers}\0{settings.sasl_username}\0{secret}".encode()
        ).hexdigest()
        if key not in _accepted:
            refused = await refused_credentials(settings)
            if refused is not None:
                raise refused
            _accepted.add(key)
    try:
        await client.start()
    except KafkaConnectionError:
        refused = await refused_credentials(settings)  # changed meanwhile (a rotated secret)
        if refused is not None:
            raise refused from None
        raise


@asynccontextmanager
async def admin_client(settings: KafkaSettings) -> AsyncIterator[AIOKafkaAdminClient]:
    options = settings.client_options()
    options.pop("client_id")
    admin = AIOKafkaAdminClient(client_id=f"{settings.client_id}-admin", **options)
    try:
        await _start(admin, settings)
    except BaseException:
        await admin.close()
        raise
    try:
        yield admin
    finally:
        await admin.close()


async def started(
    client: AIOKafkaProducer | AIOKafkaConsumer, settings: KafkaSettings | None = None
) -> None:
    """Start a client; one that fails to start (no broker) is stopped, not left open. With
    the settings, refused credentials are told apart from an unreachable cluster."""
    try:
        if settings is not None:
            await _start(client, settings)
        else:
            await client.start()
    except BaseException:
        await client.stop()
        raise


@asynccontextmanager
async def producer(settings: KafkaSettings, **extra: Any) -> AsyncIterator[AIOKafkaProducer]:
    # Idempotent: a retried send after a lost acknowledgement is written once.
    client = AIOKafkaProducer(
        acks="all", enable_idempotence=True, **{**settings.client_options(), **extra}
    )
    await started(client, settings)
    async with stopping(client):
        yield client


# An idempotent producer retries a batch the broker did not acknowledge without end (aiokafka
# never expires them), and its stop() waits for them: with the broker gone (killed, its disk
# full) a one-shot command would hang. Writers that must answer bound the wait instead.
STOP_AFTER_FAILURE_SECONDS = 5.0


def acknowledgement_seconds(settings: KafkaSettings) -> float:
    """How long a one-shot writer waits for the brokers to acknowledge what it sent: two
    request timeouts (a broker that restarts is back well within it)."""
    return 2 * settings.request_timeout_ms / 1000


async def acknowledged(work: Awaitable[T], settings: KafkaSettings, what: str = "the records") -> T:
    """`work` (sends to wait for, a commit), or KafkaConnectionError with a sentence when the
    brokers do not acknowledge it within acknowledgement_seconds."""
    within = acknowledgement_seconds(settings)
    try:
        return await asyncio.wait_for(work, within)
    except TimeoutError:
        raise KafkaConnectionError(
            f"no broker acknowledged {what} within {within:g} s (is a broker down, or its "
            "disk full?); whether they were written is unknown"
        ) from None


@asynccontextmanager
async def stopping(client: AIOKafkaProducer) -> AsyncIterator[None]:
    """Stop `client` at the end; after a failure within STOP_AFTER_FAILURE_SECONDS, giving up
    on what it still holds (the failure being raised matters, not how the stop went)."""
    try:
        yield
    except BaseException:
        try:
            await asyncio.wait_for(client.stop(), STOP_AFTER_FAILURE_SECONDS)
        except TimeoutError:
            log.warning("a Kafka producer still held unacknowledged records: dropped")
        except Exception as exc:  # noqa: BLE001 - see above
            log.warning("a Kafka producer did not stop cleanly: %r", exc)
        raise
    await client.stop()


@asynccontextmanager
async def consumer(
    settings: KafkaSettings, *topics: str, **extra: Any
) -> AsyncIterator[AIOKafkaConsumer]:
    # read_committed: runners write through transactions (agl_stream/runner/lane.py), and
    # what a fenced or failed runner left in an aborted one must never be read.
    defaults: dict[str, Any] = {
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "isolation_level": "read_committed",
    }
    client = AIOKafkaConsumer(*topics, **{**settings.client_options(), **defaults, **extra})
    await started(client, settings)
    try:
        yield client
    finally:
        # aiokafka 0.14's stop() never returns when called in the same step as assign() or
        # seek(), before the fetcher has run once; one turn of the loop avoids it.
        await asyncio.sleep(0)
        await client.stop()


async def end_offsets(
    settings: KafkaSettings, partitions: Iterable[TopicPartition]
) -> dict[TopicPartition, int]:
    """The offset after the last record of each partition (ListOffsets, latest)."""
    wanted = list(partitions)
    if not wanted:
        return {}
    async with consumer(settings) as client:
        result: dict[TopicPartition, int] = await client.end_offsets(wanted)
        return result


# The wait before asking again when a transaction's first partition is refused with
# CONCURRENT_TRANSACTIONS, which the broker answers between one commit and its markers (a
# millisecond or so on a local broker).
TRANSACTION_RETRY_SECONDS = 0.002


def quick_transaction_retries() -> None:
    """aiokafka waits a fixed 20 ms (its sender's BACKOFF_OVERRIDE) in that case, so a writer
    that commits transactions back to back paid ~20 ms for each: retry after 2 ms instead.
    The constant is aiokafka's module global (0.13 and 0.14 read it per retry)."""
    aiokafka_sender.BACKOFF_OVERRIDE = TRANSACTION_RETRY_SECONDS


async def last_committed(
    settings: KafkaSettings,
    since: Mapping[TopicPartition, int],
    until: Mapping[TopicPartition, int],
    within: float = 15.0,
) -> dict[TopicPartition, int]:
    """The offset of the last committed record in [since, until) of each partition that has
    one: what a transaction that ended between two reads of the ends added (its markers and
    what an abort left are not records a consumer sees)."""
    grown = {tp: (since.get(tp, 0), end) for tp, end in until.items() if end > since.get(tp, 0)}
    if not grown:
        return {}
    last: dict[TopicPartition, int] = {}
    deadline = asyncio.get_running_loop().time() + within
    async with consumer(settings) as client:
        client.assign(list(grown))
        for tp, (start, _) in grown.items():
            client.seek(tp, start)
        left = set(grown)
        while left:
            if asyncio.get_running_loop().time() > deadline:
                log.warning("could not read %s to their ends within %.0f s", sorted(left), within)
                break
            batches = await client.getmany(*left, timeout_ms=1000)
            for tp in list(left):
                for record in batches.get(tp, []):
                    if record.offset < grown[tp][1]:
                        last[tp] = record.offset
                if await client.position(tp) >= grown[tp][1]:
                    left.discard(tp)
    return last


async def retrying(attempt: Callable[[], Awaitable[T]], what: str, within: float = 60.0) -> T:
    """Run `attempt` again while it fails with a retriable Kafka error (a node of the
    cluster down for a moment, a coordinator or leader moving), with backoff, for up to
    `within` seconds; then, or on any other error, raise."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    delay = 0.2
    while True:
        try:
            return await attempt()
        except KafkaError as exc:
            if not exc.retriable or loop.time() + delay > deadline:
                raise
            log.warning("%s failed (%r); trying again in %.1f s", what, exc, delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)
