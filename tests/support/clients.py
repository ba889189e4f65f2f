"""The clients in other languages under examples/ (Java: kafka-clients and Apache Avro; Go:
franz-go and hamba/avro): building them, and running their commands against a broker."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from agl_stream.runtime.config import KafkaSettings
from tests.support import ROOT

SCHEMAS = ROOT / "schemas"


class ClientFailed(AssertionError):
    """A client's command exited with an error; the message holds what it printed."""


@dataclass(frozen=True)
class Client:
    name: str
    folder: Path
    tools: tuple[str, ...]  # on PATH, to build and run it

    def missing_tools(self) -> str | None:
        """A sentence naming the tools this machine lacks to build the client, or None."""
        missing = [tool for tool in self.tools if shutil.which(tool) is None]
        if not missing:
            return None
        return (
            f"the {self.name} client (examples/{self.folder.name}) needs "
            f"{' and '.join(missing)} on PATH to be built"
        )

    def build(self, scratch: Path) -> Built:
        """Build it (Maven and Go fetch what their caches lack); a build that fails raises."""
        began = time.monotonic()
        if self.name == "java":
            # -B: no colours in a log; the jar names its dependencies in target/lib/.
            _check(["mvn", "-B", "-q", "package"], self.folder)
            argv = [str(self.folder / "agl-stream-java-client")]  # java -jar, with its options
        else:
            binary = scratch / "agl-stream-go-client"
            _check(["go", "build", "-o", str(binary), "."], self.folder)
            argv = [str(binary)]
        return Built(self, argv, time.monotonic() - began)


@dataclass(frozen=True)
class Built:
    client: Client
    argv: list[str]
    build_seconds: float

    async def run(
        self, kafka: KafkaSettings, command: str, *args: str, stdin: bytes | None = None
    ) -> tuple[str, str]:
        """A command against the broker; its standard output and error, or ClientFailed."""
        code, out, err = await self.attempt(kafka, command, *args, stdin=stdin)
        if code != 0:
            raise ClientFailed(f"{self.client.name} client {command} exited {code}:\n{err}")
        return out, err

    async def attempt(
        self, kafka: KafkaSettings, command: str, *args: str, stdin: bytes | None = None
    ) -> tuple[int, str, str]:
        """A command against the broker (the options before the arguments, as Go's flag
        package wants them): its exit status, standard output and standard error."""
        broker = ("--bootstrap-servers", kafka.bootstrap_servers)
        prefix = ("--topic-prefix", kafka.topic_prefix)
        argv = [*self.argv, command, *broker, *prefix, "--schemas", str(SCHEMAS), *args]
        process = await asyncio.create_subprocess_exec(
            *argv, cwd=self.client.folder, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await process.communicate(stdin)
        assert process.returncode is not None
        return process.returncode, out.decode(), err.decode(errors="replace")


CLIENTS = {
    "java": Client("java", ROOT / "examples" / "java-client", ("java", "mvn")),
    "go": Client("go", ROOT / "examples" / "go-client", ("go",)),
}


def _check(argv: list[str], cwd: Path) -> None:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ClientFailed(
            f"{' '.join(argv)} in {cwd} failed ({done.returncode}):\n"
            + (done.stdout + done.stderr)[-4000:]
        )
