"""Whether and where a worker exports its own traces and metrics by OTLP: the standard
OTEL_* variables, and Agent Lightning's AGENT_LIGHTNING_OTLP_ENDPOINT (pure: read from a
mapping, so every rule is tested without a process).

Export is off unless an endpoint is set. Headers, timeout, compression, certificates and the
trace sampler are read by OpenTelemetry's exporter and SDK themselves (OTEL_EXPORTER_OTLP_*,
OTEL_TRACES_SAMPLER); the service name and resource attributes by its resource detector.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from agl_stream.runtime.config import ConfigError

PROTOCOL = "http/protobuf"
SIGNALS = ("traces", "metrics")
TRACES_PATH = "/v1/traces"


@dataclass(frozen=True)
class OtlpSettings:
    """Where each signal goes (None: not exported) and how it is batched."""

    traces_endpoint: str | None
    metrics_endpoint: str | None
    metric_interval_seconds: float = 60.0  # OTEL_METRIC_EXPORT_INTERVAL
    span_queue: int = 2048  # OTEL_BSP_MAX_QUEUE_SIZE
    span_batch: int = 512  # OTEL_BSP_MAX_EXPORT_BATCH_SIZE
    span_delay_seconds: float = 5.0  # OTEL_BSP_SCHEDULE_DELAY
    endpoint_variable: str = "OTEL_EXPORTER_OTLP_ENDPOINT"  # the one that turned it on


def agent_lightning_otlp_endpoint(environ: Mapping[str, str] | None = None) -> str | None:
    """AGENT_LIGHTNING_OTLP_ENDPOINT as Agent Lightning uses it: the URL its tracers send
    traces to (a store's /v1/traces, or a collector's), None when unset or empty."""
    value = (os.environ if environ is None else environ).get("AGENT_LIGHTNING_OTLP_ENDPOINT")
    return (value or "").strip() or None


def otlp_settings(environ: Mapping[str, str] | None = None) -> OtlpSettings | None:
    """The export this environment asks for, None when none; a setting agl-stream cannot
    honour raises ConfigError naming the variable."""
    env = os.environ if environ is None else environ
    if _get(env, "OTEL_SDK_DISABLED").lower() == "true":
        return None
    endpoints = {signal: _endpoint(env, signal) for signal in SIGNALS}
    if all(e is None for e in endpoints.values()):
        return None
    for signal in SIGNALS:
        if endpoints[signal] is not None:
            _check_protocol(env, signal)
            if not _exporter_on(env, signal):
                endpoints[signal] = None
    if all(e is None for e in endpoints.values()):
        return None
    return OtlpSettings(
        traces_endpoint=endpoints["traces"][0] if endpoints["traces"] else None,
        metrics_endpoint=endpoints["metrics"][0] if endpoints["metrics"] else None,
        metric_interval_seconds=_millis(env, "OTEL_METRIC_EXPORT_INTERVAL", 60_000),
        span_queue=_count(env, "OTEL_BSP_MAX_QUEUE_SIZE", 2048),
        span_batch=_count(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512),
        span_delay_seconds=_millis(env, "OTEL_BSP_SCHEDULE_DELAY", 5000),
        endpoint_variable=next(e[1] for e in endpoints.values() if e is not None),
    )


def _get(env: Mapping[str, str], name: str) -> str:
    return env.get(name, "").strip()


def _endpoint(env: Mapping[str, str], signal: str) -> tuple[str, str] | None:
    """(URL, the variable it came from), by the OTLP/HTTP rules: the signal's own variable
    as it is; the base endpoint with /v1/<signal> appended; Agent Lightning's traces URL
    as it is for traces, and beside it (/v1/metrics in place of /v1/traces) for metrics."""
    own = f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"
    if url := _get(env, own):
        return _url(url, own), own
    if base := _get(env, "OTEL_EXPORTER_OTLP_ENDPOINT"):
        return f"{_url(base, 'OTEL_EXPORTER_OTLP_ENDPOINT').rstrip('/')}/v1/{signal}", (
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
    agl = agent_lightning_otlp_endpoint(env)
    if agl is None:
        return None
    url = _url(agl, "AGENT_LIGHTNING_OTLP_ENDPOINT").rstrip("/")
    base = url.removesuffix(TRACES_PATH)
    if signal == "traces" and base != url:
        return url, "AGENT_LIGHTNING_OTLP_ENDPOINT"
    return f"{base}/v1/{signal}", "AGENT_LIGHTNING_OTLP_ENDPOINT"


def _url(value: str, variable: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise ConfigError(
            f"Invalid setting {variable} {value!r}: expected an http:// or https:// URL "
            "(agl-stream exports OTLP over HTTP, e.g. http://collector:4318)."
        )
    return value


def _check_protocol(env: Mapping[str, str], signal: str) -> None:
    own = f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL"
    for variable in (own, "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = _get(env, variable)
        if protocol and protocol != PROTOCOL:
            raise ConfigError(
                f"Invalid setting {variable} {protocol!r}: agl-stream's workers export OTLP "
                f"as {PROTOCOL} only; set {PROTOCOL} (and the collector's HTTP port, 4318)."
            )
        if protocol:
            return  # the signal's own setting wins over the general one


def _exporter_on(env: Mapping[str, str], signal: str) -> bool:
    """OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER: otlp (the default) or none; other
    exporters listed beside otlp are not agl-stream's to run and are left alone."""
    variable = f"OTEL_{signal.upper()}_EXPORTER"
    names = {n.strip().lower() for n in _get(env, variable).split(",") if n.strip()} or {"otlp"}
    if "none" in names:
        return False
    if "otlp" not in names:
        raise ConfigError(
            f"Invalid setting {variable} {_get(env, variable)!r}: agl-stream exports its "
            f"workers' {signal} by otlp (or not at all: none)."
        )
    return True


def _count(env: Mapping[str, str], variable: str, default: int) -> int:
    value = _get(env, variable)
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number <= 0:
        raise ConfigError(f"Invalid setting {variable} {value!r}: expected a positive integer.")
    return number


def _millis(env: Mapping[str, str], variable: str, default: int) -> float:
    return _count(env, variable, default) / 1000
