"""`python -m agl_stream.projection`: one projector with the AGL_STREAM_* settings and its
defaults, until SIGTERM or Ctrl-C. The store facade starts its projector this way: without the
CLI's imports it is running in a fraction of `agl-stream worker projector`'s start-up."""

from __future__ import annotations

import asyncio
import logging
import sys

from agl_stream.projection.projector import Projector, ProjectorConfig
from agl_stream.runtime.config import ConfigError, DatabaseSettings, KafkaSettings, load
from agl_stream.runtime.gc_tuning import tune_for_throughput
from agl_stream.runtime.supervision import stop_on_signals


async def main() -> None:
    tune_for_throughput()
    projector = Projector(load(KafkaSettings), load(DatabaseSettings), ProjectorConfig())
    await projector.run(stop_on_signals())


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(main())
    except ConfigError as exc:
        sys.exit(f"the projector cannot start: {exc}")
