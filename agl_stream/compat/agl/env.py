"""Agent Lightning's environment variables where agl-stream has the matching concept.

- `AGL_SERVER_HOST`, `AGL_SERVER_PORT`: where Agent Lightning's store server listens (and its
  execution strategies' clients connect): `agl-stream store`'s --host and --port default to
  them, then to the host and port of `AGENT_LIGHTNING_STORE_URL`, then 127.0.0.1:4747.
- `AGENT_LIGHTNING_STORE_URL`: the store server's URL that Agent Lightning's clients (its
  LightningStoreClient, the headless runners of its examples) are given.
- `AGENT_LIGHTNING_OTLP_ENDPOINT`: where such clients export OTLP/HTTP traces; unset, the
  store URL's /v1/traces, which `agl-stream store` serves.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 4747


class EnvError(ValueError):
    """An environment variable's value cannot be used; the message names it."""


@dataclass(frozen=True)
class ServerAddress:
    host: str
    port: int


def server_address(env: Mapping[str, str] | None = None) -> ServerAddress:
    """Where `agl-stream store` listens by default, from Agent Lightning's variables."""
    env = os.environ if env is None else env
    host, port = DEFAULT_HOST, DEFAULT_PORT
    url = env.get("AGENT_LIGHTNING_STORE_URL", "").strip()
    if url:
        parts = urlsplit(url)
        try:
            url_port = parts.port
        except ValueError:
            url_port = None
            parts = parts._replace(netloc="")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise EnvError(
                f"AGENT_LIGHTNING_STORE_URL={url!r} is not an http(s) URL with a host "
                "(expected e.g. http://127.0.0.1:4747)"
            )
        host, port = parts.hostname, url_port or (443 if parts.scheme == "https" else 80)
    host = env.get("AGL_SERVER_HOST", "").strip() or host
    raw_port = env.get("AGL_SERVER_PORT", "").strip()
    if raw_port:
        if not raw_port.isdigit() or not 0 <= int(raw_port) <= 65535:
            raise EnvError(f"AGL_SERVER_PORT={raw_port!r} is not a port number (0-65535)")
        port = int(raw_port)
    return ServerAddress(host, port)


def store_url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    return f"http://{shown}:{port}"


def otlp_endpoint(env: Mapping[str, str] | None = None) -> str | None:
    """AGENT_LIGHTNING_OTLP_ENDPOINT, else the store URL's /v1/traces, else None."""
    env = os.environ if env is None else env
    explicit = env.get("AGENT_LIGHTNING_OTLP_ENDPOINT", "").strip()
    if explicit:
        return explicit
    url = env.get("AGENT_LIGHTNING_STORE_URL", "").strip()
    return f"{url.rstrip('/')}/v1/traces" if url else None
