"""Process agents, in any language: one process per attempt, started with the attempt's
environment (Agent Lightning 1.0's protocol):

- `AGL_OPENAI_BASE_URL` (and `OPENAI_BASE_URL`): the attempt's OpenAI base URL on the
  runner's gateway, for its LLM resource (the only one, or the one named `llm`); `AGL_MODEL`
  (and `OPENAI_MODEL`) its model;
- `AGL_EVENT_URL`: where it POSTs events and rewards (`agl_stream/gateway/events.py`),
  recorded as spans of the attempt;
- `AGL_KEY` (and `OPENAI_API_KEY`): the attempt's bearer token; the attempt's URLs refuse any
  other, and other attempts' URLs refuse this one;
- `AGL_TASK_INPUT`: the task input as JSON (also written to its standard input);
  `AGL_RESOURCES`: every resource of the attempt as JSON; `AGL_ROLLOUT_ID`, `AGL_ATTEMPT_ID`,
  `AGL_ATTEMPT_NUMBER`, `AGL_MODE`, `AGL_RESOURCES_ID`.

Exit status 0 is a succeeded attempt, anything else a failed one (its stderr's end says why);
a timeout, an unresponsive agent or a cancel stops the whole process group (SIGTERM, then
SIGKILL). Standard output and error are kept up to `output_limit` bytes each (their ends) on
the attempt's `agl.process` span; output counts as progress for the unresponsiveness watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import signal
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from opentelemetry.trace import Status, StatusCode

from agl_stream.agent.api import AgentResult, LitAgent, NamedResources, Rollout
from agl_stream.agent.tracing import AttemptRecorder, current_recorder, tracer
from agl_stream.events import LLM, Checkpoint, PromptTemplate

PROCESS_SPAN = "agl.process"
OUTPUT_LIMIT = 64 * 1024
ENV_VALUE_LIMIT = 64 * 1024  # Linux refuses one environment string over 128 KiB
STOP_GRACE_SECONDS = 0.4  # SIGTERM to SIGKILL: the runner waits about a second for the agent
RESOURCE_TYPES: Mapping[type, str] = {
    LLM: "llm",
    PromptTemplate: "prompt_template",
    Checkpoint: "checkpoint",
}

log = logging.getLogger(__name__)


class ProcessFailed(RuntimeError):
    """The agent's process exited with a status other than 0."""


class OutputTail:
    """The last `limit` bytes of a stream, and how many bytes it had in all."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.total = 0
        self._tail = bytearray()

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        self._tail += chunk
        if len(self._tail) > self.limit:
            del self._tail[: len(self._tail) - self.limit]

    def text(self) -> str:
        return self._tail.decode("utf-8", errors="replace")


class ProcessAgent(LitAgent):
    """Runs `command` once per attempt (see the module's docstring for its environment)."""

    keyed_gateway: ClassVar[bool] = True

    def __init__(
        self,
        command: Sequence[str] | str,
        *,
        output_limit: int = OUTPUT_LIMIT,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        try:
            argv = shlex.split(command) if isinstance(command, str) else list(command)
        except ValueError as exc:
            raise ValueError(f"cannot split the command {command!r} into words: {exc}") from None
        if not argv:
            raise ValueError("a process agent needs a command to run")
        self.argv = argv
        self.output_limit = output_limit
        self.cwd = cwd
        self.env = dict(env or {})

    def __repr__(self) -> str:
        return f"ProcessAgent({shlex.join(self.argv)!r})"

    async def rollout_async(
        self, task: Any, resources: NamedResources, rollout: Rollout
    ) -> AgentResult:
        if rollout.event_url is None or rollout.key is None:
            raise RuntimeError(
                "a process agent needs the runner's gateway for its URLs (run the runner "
                "without --no-gateway)"
            )
        task_json = json.dumps(task)
        with tracer().start_as_current_span(PROCESS_SPAN) as span:
            span.set_attribute("agl.process.command", shlex.join(self.argv))
            stdout, stderr = OutputTail(self.output_limit), OutputTail(self.output_limit)
            try:
                code = await self._run(
                    task_json, attempt_environment(task_json, resources, rollout), stdout, stderr
                )
            except BaseException:
                span.set_status(Status(StatusCode.ERROR, "stopped before it exited"))
                raise
            finally:
                _describe(span, stdout, stderr)
            span.set_attribute("agl.process.exit_code", code)
            if code != 0:
                reason = _exit_reason(code, stderr)
                span.set_status(Status(StatusCode.ERROR, reason))
                raise ProcessFailed(reason)
        return None

    async def _run(
        self, task_json: str, attempt_env: Mapping[str, str], stdout: OutputTail, stderr: OutputTail
    ) -> int:
        process = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=self.cwd,
            env={**os.environ, **self.env, **attempt_env},
            start_new_session=True,  # its own process group: stopped whole, children too
        )
        recorder = current_recorder.get()
        assert process.stdout is not None
        assert process.stderr is not None
        readers = [
            asyncio.create_task(_read(process.stdout, stdout, recorder)),
            asyncio.create_task(_read(process.stderr, stderr, recorder)),
            asyncio.create_task(_write_input(process, task_json.encode() + b"\n")),
        ]
        try:
            code = await process.wait()
            # A child it left behind may hold the pipes open: read what is there, briefly.
            _, late = await asyncio.wait(readers, timeout=1.0)
            for reader in late:
                reader.cancel()
            return code
        except BaseException:
            await _stop(process)
            raise
        finally:
            for reader in readers:
                reader.cancel()
            await asyncio.gather(*readers, return_exceptions=True)


def attempt_environment(
    task_json: str, resources: NamedResources, rollout: Rollout
) -> dict[str, str]:
    """The AGL_* variables of one attempt (and the OPENAI_* ones its SDKs read)."""
    assert rollout.event_url is not None
    assert rollout.key is not None
    env = {
        "AGL_ROLLOUT_ID": rollout.rollout_id,
        "AGL_ATTEMPT_ID": rollout.attempt_id,
        "AGL_ATTEMPT_NUMBER": str(rollout.attempt_number),
        "AGL_MODE": rollout.mode.value,
        "AGL_RESOURCES_ID": rollout.resources_id or "",
        "AGL_EVENT_URL": rollout.event_url,
        "AGL_KEY": rollout.key,
        "OPENAI_API_KEY": rollout.key,
    }
    llm = _main_llm(resources)
    if llm is not None:
        env.update(AGL_OPENAI_BASE_URL=llm.endpoint, OPENAI_BASE_URL=llm.endpoint)
        env.update(AGL_MODEL=llm.model, OPENAI_MODEL=llm.model)
    described = {
        name: {
            "resource_type": RESOURCE_TYPES.get(type(r), type(r).__name__),
            **r.model_dump(mode="json"),
        }
        for name, r in resources.items()
    }
    for name, value in (("AGL_TASK_INPUT", task_json), ("AGL_RESOURCES", json.dumps(described))):
        if len(value.encode()) <= ENV_VALUE_LIMIT:
            env[name] = value
        else:
            log.warning(
                "attempt %s: %s is over %d bytes, left out of the environment",
                rollout.attempt_id,
                name,
                ENV_VALUE_LIMIT,
            )
    return env


def _main_llm(resources: NamedResources) -> LLM | None:
    llms = {name: r for name, r in resources.items() if isinstance(r, LLM)}
    if len(llms) == 1:
        return next(iter(llms.values()))
    return llms.get("llm")


async def _read(
    stream: asyncio.StreamReader, into: OutputTail, recorder: AttemptRecorder | None
) -> None:
    while chunk := await stream.read(65536):
        into.add(chunk)
        if recorder is not None:
            recorder.touch()


async def _write_input(process: asyncio.subprocess.Process, data: bytes) -> None:
    assert process.stdin is not None
    # An agent that never reads its standard input, or exits first, is not an error.
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        process.stdin.write(data)
        await process.stdin.drain()
        process.stdin.close()


async def _stop(process: asyncio.subprocess.Process) -> None:
    """SIGTERM to the process group, SIGKILL after STOP_GRACE_SECONDS."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(process.wait()), STOP_GRACE_SECONDS)


def _describe(span: Any, stdout: OutputTail, stderr: OutputTail) -> None:
    for name, tail in (("stdout", stdout), ("stderr", stderr)):
        span.set_attribute(f"agl.process.{name}", tail.text())
        span.set_attribute(f"agl.process.{name}_bytes", tail.total)


def _exit_reason(code: int, stderr: OutputTail) -> str:
    if code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with status {code}"
    last = stderr.text().strip()[-2000:]
    return f"the agent process {how}" + (f"; its stderr ends: {last}" if last else "")
