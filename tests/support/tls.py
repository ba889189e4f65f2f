"""A throwaway certificate authority and broker certificate for the TLS tests (openssl)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TestCertificates:
    ca: Path  # PEM: the CA certificate clients trust
    broker: Path  # PEM: the broker's private key (PKCS#8, unencrypted) and certificate


def make_certificates(directory: Path, hosts: tuple[str, ...] = ("127.0.0.1",)) -> TestCertificates:
    """A CA and a broker certificate for `hosts` (IP addresses), valid for two days."""
    directory.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.pem", "-days", "2", "-subj", "/CN=agl-stream test CA")  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "broker.key", "-out",
            "broker.csr", "-subj", f"/CN={hosts[0]}")  # fmt: skip
    names = ",".join([*(f"IP:{h}" for h in hosts), "DNS:localhost"])
    (directory / "san.cnf").write_text(f"subjectAltName={names}\n")
    openssl("x509", "-req", "-in", "broker.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "broker.crt", "-days", "2",
            "-extfile", "san.cnf")  # fmt: skip
    broker = directory / "broker.pem"
    broker.write_text(
        (directory / "broker.key").read_text() + (directory / "broker.crt").read_text()
    )
    broker.chmod(0o600)
    return TestCertificates(directory / "ca.pem", broker)
