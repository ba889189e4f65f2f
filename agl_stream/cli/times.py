"""Times on the command line: ISO 8601 ("2026-11-21T08:00", "2026-11-21 08:00+01:00") or
an age ("90s", "15m", "2h", "7d" ago). Naive times are UTC."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

import click

_AGE = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhd])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def parse_time(text: str, now: datetime | None = None) -> datetime:
    """An ISO time or an age; ValueError with a sentence otherwise."""
    match = _AGE.match(text.strip())
    if match:
        amount, unit = float(match.group(1)), match.group(2)
        try:
            return (now or datetime.now(UTC)) - timedelta(**{_UNITS[unit]: amount})
        except OverflowError:  # before the year 1, or more days than timedelta holds
            raise ValueError(
                f"{_shown(text)} is too long ago: the earliest time is the year 1"
            ) from None
    try:
        value = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"{_shown(text)} is not a time: give ISO 8601 (2026-11-21T08:00:00Z) or an age "
            "such as 30m, 2h or 7d"
        ) from None
    value = value if value.tzinfo else value.replace(tzinfo=UTC)
    try:
        value.astimezone(UTC)  # what the database compares; 0001-01-01T00:00+01:00 has none
    except OverflowError:
        raise ValueError(
            f"{_shown(text)} is out of range: in UTC it is before the year 1 or after 9999"
        ) from None
    return value


def _shown(text: str) -> str:
    return repr(text if len(text) <= 40 else f"{text[:40]}...")


class TimeParam(click.ParamType[datetime]):
    name = "TIME"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> datetime:
        if isinstance(value, datetime):
            return value
        try:
            return parse_time(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


TIME = TimeParam()
