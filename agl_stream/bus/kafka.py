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
    KafkaTimeoutError,
    SaslAuthenticationFailed,
)
from aiokafka.producer import sender as aiokafka_sender

from agl_stream.runtime.causes import causes
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


# How long a new client's bootstrap waits for a broker to accept a connection before it
# leaves the choice to aiokafka (a healthy broker accepts in a round trip), and how long it
# waits for the others once one has.
REACHABLE_WITHIN_SECONDS = 3.0
REACHABLE_GRACE_SECONDS = 0.01


async def reachable(settings: KafkaSettings) -> KafkaSettings:
    """The settings with the bootstrap servers that accept a connection now: the first to
    accept, and any other that does within REACHABLE_GRACE_SECONDS of it.

    aiokafka bootstraps from the servers in a random order and gives each the whole request
    timeout to connect. A broker whose network drops packets (blackholed, not down: nothing
    refuses the connection) would cost a new client that timeout in one start out of N;
    racing the connections costs a round trip. A broker that accepts but does not answer (a
    frozen process) stays in, with the others, as before. With one server, or when none
    accepts within REACHABLE_WITHIN_SECONDS, the settings as they are."""
    servers = settings.bootstrap_servers.split(",")
    if len(servers) < 2:
        return settings
    within = min(settings.request_timeout_ms / 1000, REACHABLE_WITHIN_SECONDS)
    answered = await _accepting(servers, within, REACHABLE_GRACE_SECONDS)
    if not answered:
        return settings
    return settings.model_copy(update={"bootstrap_servers": ",".join(answered)})


async def _accepting(servers: list[str], within: float, grace: float) -> list[str]:
    """The servers that accept a TCP connection, in the order they did: those within `grace`
    of the first, which must do so within `within`."""

    async def connect(server: str) -> str:
        host, _, port = server.rpartition(":")
        _, writer = await asyncio.open_connection(host.strip("[]"), int(port))
        writer.close()
        return server

    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    pending = {asyncio.create_task(connect(server)) for server in servers}
    answered: list[str] = []
    try:
        while pending and loop.time() < deadline:
            done, pending = await asyncio.wait(
                pending, timeout=deadline - loop.time(), return_when=asyncio.FIRST_COMPLETED
            )
            # Refused, unreachable or unknown: not a server to start from.
            answered += [task.result() for task in done if task.exception() is None]
            if answered:
                deadline = min(deadline, loop.time() + grace)
        return answered
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


# The metadata age of a client kept idle between uses (the runner's admin client and fold
# reader, for its takeovers). Such a client learns that leaders and coordinators moved only
# from its own metadata refreshes, every 5 minutes by default: after a broker went silent it
# would still send to it, and wait a request timeout for each (aiokafka's end offsets even
# give up at the moment their request would time out, before it fails over, every time).
IDLE_METADATA_AGE_MS = 5_000


@asynccontextmanager
async def admin_client(settings: KafkaSettings, **extra: Any) -> AsyncIterator[AIOKafkaAdminClient]:
    options = (await reachable(settings)).client_options()
    options.pop("client_id")
    admin = AIOKafkaAdminClient(client_id=f"{settings.client_id}-admin", **options, **extra)
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
    options = (await reachable(settings)).client_options()
    client = AIOKafkaProducer(acks="all", enable_idempotence=True, **{**options, **extra})
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
    brokers do not acknowledge it within acknowledgement_seconds, or a connection closed under
    it (aiokafka's sender then dies with "Unexpected error during batch delivery")."""
    within = acknowledgement_seconds(settings)
    try:
        return await asyncio.wait_for(work, within)
    except TimeoutError:
        raise KafkaConnectionError(
            f"no broker acknowledged {what} within {within:g} s (is a broker down, or its "
            "disk full?); whether they were written is unknown"
        ) from None
    except KafkaConnectionError:
        raise
    except KafkaError as exc:
        lost = lost_connection(exc)
        if lost is None:
            raise
        raise KafkaConnectionError(
            f"a broker's connection closed before it acknowledged {what} ({lost}; is a broker "
            "down, or its disk full?); whether they were written is unknown"
        ) from exc


def lost_connection(exc: BaseException) -> BaseException | None:
    """The lost connection (KafkaConnectionError, ConnectionError) among the causes of `exc`,
    if one is."""
    return next(
        (e for e in causes(exc) if isinstance(e, KafkaConnectionError | ConnectionError)), None
    )


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
    options = (await reachable(settings)).client_options()
    client = AIOKafkaConsumer(*topics, **{**options, **defaults, **extra})
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
# millisecond or so on a local broker: the store's transactions met it in about a third of
# them, and each paid the whole wait; 1 ms rather than 2 took ~10% off its writes' p50).
TRANSACTION_RETRY_SECONDS = 0.001


def quick_transaction_retries() -> None:
    """aiokafka waits a fixed 20 ms (its sender's BACKOFF_OVERRIDE) in that case, so a writer
    that commits transactions back to back paid ~20 ms for each: retry after 1 ms instead.
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


async def retrying(
    attempt: Callable[[], Awaitable[T]],
    what: str,
    within: float = 60.0,
    unless: Callable[[KafkaError], bool] = lambda _: False,
) -> T:
    """Run `attempt` again while it fails with a retriable Kafka error (a node of the
    cluster down for a moment, a coordinator or leader moving), with backoff, for up to
    `within` seconds; then, or on any other error (or one `unless` picks out), raise. A
    client's own wait that ran out (KafkaTimeoutError, which aiokafka does not mark
    retriable) counts as retriable: a long-lived client whose metadata still names a broker
    that went silent waits on it until its metadata is refreshed (IDLE_METADATA_AGE_MS),
    then goes where the leaders are now."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    delay = 0.2
    while True:
        try:
            return await attempt()
        except KafkaError as exc:
            retriable = exc.retriable or isinstance(exc, KafkaTimeoutError)
            if not retriable or unless(exc) or loop.time() + delay > deadline:
                raise
            log.warning("%s failed (%r); trying again in %.1f s", what, exc, delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 5.0)


def known_position(consumer: AIOKafkaConsumer, tp: TopicPartition) -> int | None:
    """The consumer's position in `tp` if it has one now (None: not assigned, or not known
    yet). aiokafka's position() waits for an unknown one, up to a request timeout and again
    (a broker away: a read loop stalled); this reads the fetcher's state as it stands, from
    aiokafka's internals (0.14, the version pyproject.toml allows)."""
    try:
        state = consumer._subscription.subscription.assignment.state_value(tp)
    except AttributeError:  # no subscription or assignment (yet, or any more)
        return None
    if state is None or not state.has_valid_position:
        return None
    return int(state.position)
