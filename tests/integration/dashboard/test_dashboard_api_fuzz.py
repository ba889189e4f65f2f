"""The dashboard's JSON API against its own OpenAPI description, by schemathesis: generated
requests (valid and invalid) to every operation of a live server over a real read model, with
a token configured. No 5xx, status codes and bodies as described, invalid input refused with a
4xx, valid input accepted. The event stream (/api/live) never ends, so it is left out."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import hypothesis
import pytest
import schemathesis
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from agl_stream.dashboard.server import Dashboard
from agl_stream.queries import ReadModel
from agl_stream.runtime.config import DatabaseSettings, KafkaSettings
from tests.support.projection import projector_in_process
from tests.support.runs import queue, runner_in_process

TOKEN = "fuzzing-token-0123456789"


async def _fill(kafka: KafkaSettings, database: DatabaseSettings) -> None:
    """A few rollouts of each ending, so that generated ids and filters meet real rows."""
    async with projector_in_process(kafka, database), runner_in_process(kafka):
        done = await queue(kafka, [{"reward": 0.5}, {"fail_on_attempts": [1]}, {"spans": 3}])
        async with ReadModel.open(database) as model:
            await model.wait_for_rollouts(done, within=60)


@pytest.fixture
def live_api(kafka: KafkaSettings, database: DatabaseSettings) -> Iterator[schemathesis.BaseSchema]:
    """The server on a loop of its own in a thread (schemathesis calls it synchronously)."""
    loop = asyncio.new_event_loop()
    started: asyncio.Future[str] = loop.create_future()
    stop = asyncio.Event()

    async def serve() -> None:
        await _fill(kafka, database)
        server = Dashboard(database, kafka, token=TOKEN)
        started.set_result(await server.start())
        try:
            await stop.wait()
        finally:
            await server.stop()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    url = asyncio.run_coroutine_threadsafe(asyncio.wait_for(asyncio.shield(started), 120), loop)
    base = url.result(timeout=150)
    schema = schemathesis.openapi.from_url(
        f"{base}/api/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    schema.config.update(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"})
    try:
        yield schema.exclude(path="/api/live")
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_the_api_keeps_its_description(
    live_api: schemathesis.BaseSchema, mode: GenerationMode
) -> None:
    operations = [result.ok() for result in live_api.get_all_operations()]
    assert len(operations) >= 9
    exercised = []
    for operation in operations:

        @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
        @hypothesis.settings(
            max_examples=25, deadline=None, derandomize=True, database=None,
            suppress_health_check=list(hypothesis.HealthCheck),
        )  # fmt: skip
        def keeps_it(case: schemathesis.Case) -> None:
            # Cursors are opaque: a made-up one is refused (400), as it should be.
            made_up = bool(case.query and "cursor" in case.query)
            case.call_and_validate(excluded_checks=[positive_data_acceptance] if made_up else [])

        try:
            keeps_it()
        except hypothesis.errors.Unsatisfiable:
            # No input of this operation breaks its description (no parameters, or only
            # free strings): nothing negative to send.
            assert mode is GenerationMode.NEGATIVE, operation.label
            continue
        exercised.append(operation.label)
    assert len(exercised) >= (9 if mode is GenerationMode.POSITIVE else 5), exercised
