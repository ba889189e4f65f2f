"""An exception's chain of causes (pure)."""

from __future__ import annotations

from collections.abc import Iterator


def causes(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then what it was raised from or during (`__cause__`, else `__context__`), each
    once."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__
