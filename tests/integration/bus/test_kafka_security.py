"""The embedded Apache Kafka with SASL/SCRAM over TLS: with the right credentials a runner
claims and runs rollouts through transactions as on a plaintext broker, and `status` shows
the user but never the password; with a wrong password a worker and `topics apply` stop at
once with one sentence naming the user and the setting to check, after a couple of
authentication attempts (no retry storm); no password appears in any log, the broker's
included."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from agl_stream.bus.topic_admin import apply_topics
from agl_stream.commands.enqueue import RolloutOptions, enqueue
from agl_stream.embedded import kafka_node
from agl_stream.embedded.kafka_node import BrokerSecurity, KafkaNode
from agl_stream.embedded.process import pick_ports
from agl_stream.runtime.config import KafkaSettings, load
from tests.support.runs import wait_terminal
from tests.support.tls import make_certificates

pytestmark = pytest.mark.slow

USER, PASSWORD = "alice", "alice-" + uuid.uuid4().hex
ADMIN_PASSWORD = "broker-" + uuid.uuid4().hex
FAILED_AUTH = "Failed authentication with"


class SecureBroker:
    def __init__(self, home: Path, node: KafkaNode, ca: Path) -> None:
        self.home, self.node, self.ca = home, node, ca

    @property
    def log(self) -> Path:
        return self.node.log(self.home)

    def environment(self, password: str) -> dict[str, str]:
        return {
            **os.environ,
            "AGL_STREAM_BOOTSTRAP_SERVERS": f"127.0.0.1:{self.node.port}",
            "AGL_STREAM_SECURITY_PROTOCOL": "SASL_SSL",
            "AGL_STREAM_SASL_MECHANISM": "SCRAM-SHA-256",
            "AGL_STREAM_SASL_USERNAME": USER,
            "AGL_STREAM_SASL_PASSWORD": password,
            "AGL_STREAM_SSL_CAFILE": str(self.ca),
            "AGL_STREAM_TOPIC_PREFIX": f"s{uuid.uuid4().hex[:8]}.",
        }

    def settings(self, password: str, prefix: str) -> KafkaSettings:
        return load(
            KafkaSettings,
            bootstrap_servers=f"127.0.0.1:{self.node.port}", topic_prefix=prefix,
            security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-256",
            sasl_username=USER, sasl_password=SecretStr(password), ssl_cafile=self.ca,
        )  # fmt: skip

    def failed_authentications(self) -> int:
        return self.log.read_text(errors="replace").count(FAILED_AUTH)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureBroker]:
    home = tmp_path_factory.mktemp("secure-kafka")
    certificates = make_certificates(home / "tls")
    security = BrokerSecurity(
        keystore=certificates.broker, truststore=certificates.ca,
        users=(("broker", ADMIN_PASSWORD), (USER, PASSWORD)),
    )  # fmt: skip
    port, controller = pick_ports(2, 33_000, 34_000)
    node = KafkaNode(1, port, controller)
    kafka_node.write_config(node, [node], home, security)
    kafka_node.format_storage([node], home, "c2VjdXJlLWthZmthLXQ", security)
    pid = kafka_node.start(node, home)
    try:
        kafka_node.wait_ready({1: pid}, [node], home, secured=True)
        yield SecureBroker(home, node, certificates.ca)
    finally:
        kafka_node.stop_node(pid)


def agl(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agl_stream.cli.main", *args],
        env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


async def test_the_right_credentials_work_and_no_log_shows_a_password(
    broker: SecureBroker, tmp_path: Path
) -> None:
    """A runner process (verbose) runs rollouts through transactions over SASL_SSL; then its
    output, `status` and the broker's log are searched for the passwords."""
    env = broker.environment(PASSWORD)
    kafka = broker.settings(PASSWORD, env["AGL_STREAM_TOPIC_PREFIX"])
    await apply_topics(kafka)
    ids = await enqueue(kafka, [{"spans": 2} for _ in range(6)], RolloutOptions())
    log = tmp_path / "runner.log"
    with log.open("w") as out:
        runner = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agl_stream.cli.main", "worker", "runner",
            "--agent", "tests.support.agents:behave", "--heartbeat", "1", "--concurrency", "6",
            "-v", env=env, stdout=out, stderr=out,
        )  # fmt: skip
    try:
        h = await wait_terminal(kafka, ids, 90)
    finally:
        runner.terminate()
        assert await asyncio.wait_for(runner.wait(), 60) == 0, log.read_text()
    assert all((f := h.final(r)) is not None and f.status == "succeeded" for r in ids)
    for r in ids:
        (finished,) = h.finished[r]
        assert finished.span_count >= 2 and len(h.spans[finished.attempt_id]) == finished.span_count

    shown = await asyncio.to_thread(agl, "status", env=env)
    output = shown.stdout + shown.stderr
    assert "SCRAM-SHA-256 as alice" in output, output
    texts = {"status": output, "runner": log.read_text(errors="replace")}
    for path in (broker.home / "logs").glob("*"):
        texts[path.name] = path.read_text(errors="replace")
    for name, text in texts.items():
        for secret in (PASSWORD, ADMIN_PASSWORD):
            assert secret not in text, f"a password in {name}"


def test_a_wrong_password_stops_with_one_sentence(broker: SecureBroker) -> None:
    env = broker.environment("not-" + PASSWORD)
    before = broker.failed_authentications()
    for command in (
        ("topics", "apply"),
        ("worker", "runner", "--agent", "tests.support.agents:behave", "-v"),
    ):
        done = agl(*command, env=env)
        assert done.returncode == 1, (command, done.stdout, done.stderr)
        said = " ".join(done.stderr.split())  # one sentence, as the console wrapped it
        assert said == (
            f"error: Kafka at 127.0.0.1:{broker.node.port} refused the SCRAM-SHA-256 "
            "credentials of user 'alice' (Authentication failed during authentication due to "
            "invalid credentials with SASL mechanism SCRAM-SHA-256); check "
            "AGL_STREAM_SASL_USERNAME and AGL_STREAM_SASL_PASSWORD"
        ), (command, done.stderr)
        assert "not-" + PASSWORD not in done.stdout + done.stderr
    # One authentication per command: asked once, refused, stopped; nothing in a loop.
    assert broker.failed_authentications() - before == 2
