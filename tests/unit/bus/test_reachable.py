"""A new client bootstraps from a broker that answers now: one that drops packets (blackholed,
not down) is passed over in a round trip, not after aiokafka's request timeout."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import pytest

from agl_stream.bus import kafka
from agl_stream.bus.kafka import reachable
from agl_stream.runtime.config import KafkaSettings, load


@contextmanager
def silent_server() -> Iterator[str]:
    """host:port of a listener that never completes a new connection: its accept queue is
    full and never served, so Linux drops every further SYN (a client's connect hangs, as
    with a host whose network drops packets)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(2):  # a backlog of 0 still queues one connection; one more to be sure
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
            fillers.append(filler)
        time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


@asynccontextmanager
async def answering_server() -> AsyncIterator[str]:
    async def hang_up(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


async def test_the_bootstrap_servers_become_those_that_answer() -> None:
    async with answering_server() as first, answering_server() as second:
        with silent_server() as silent:
            settings = load(
                KafkaSettings,
                bootstrap_servers=f"{silent},127.0.0.1:1,{first},{second}",  # :1: refused
                request_timeout_ms=30_000,
            )
            began = time.monotonic()
            chosen = await reachable(settings)
            assert time.monotonic() - began < 1.0
    assert sorted(chosen.bootstrap_servers.split(",")) == sorted([first, second])
    assert chosen.request_timeout_ms == 30_000  # the rest as it was


async def test_with_none_answering_the_settings_stay_after_a_bounded_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Then aiokafka tries them as it would have; the probe cost at most
    REACHABLE_WITHIN_SECONDS, not a request timeout."""
    monkeypatch.setattr(kafka, "REACHABLE_WITHIN_SECONDS", 0.5)
    with silent_server() as silent, silent_server() as other:
        settings = load(
            KafkaSettings, bootstrap_servers=f"{silent},{other}", request_timeout_ms=30_000
        )
        began = time.monotonic()
        assert await reachable(settings) == settings
        assert 0.4 < time.monotonic() - began < 1.5


async def test_one_server_is_not_probed() -> None:
    settings = load(KafkaSettings, bootstrap_servers="127.0.0.1:1")
    assert await reachable(settings) is settings
