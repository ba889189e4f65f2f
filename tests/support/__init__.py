"""What tests share: agents, fixtures' helpers, payloads, strategies, golden events."""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent  # this folder: agents, scripts, payloads
ROOT = SUPPORT.parents[1]  # the repository: examples/, deploy/, docs/
