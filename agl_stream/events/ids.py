"""The one rule for ids that come from outside (rollout, attempt, worker, resources, session,
record ids): 1 to MAX_ID_LENGTH characters, every one printable (no NUL, no control or
format character, no lone surrogate). PostgreSQL indexes them, logs and terminals print
them, and URLs carry them; an id that breaks the rule is refused where it enters, with a
sentence naming the field, and a record already on a topic that holds one is dead-lettered by
its consumers (the event models check it on decoding). Pure code.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator

# Characters, not bytes: 256 four-byte characters (1 KiB) keep a composite key of three ids
# under PostgreSQL's limit for a B-tree index row (2,704 bytes).
MAX_ID_LENGTH = 256


def id_problem(value: object) -> str | None:
    """Why `value` is not a valid id, as the end of a sentence ("... must ..."); None if it is."""
    if not isinstance(value, str):
        return f"must be text, not {type(value).__name__}"
    if not value:
        return "must not be empty"
    if len(value) > MAX_ID_LENGTH:
        return f"must be at most {MAX_ID_LENGTH} characters long (it has {len(value):,})"
    if not value.isprintable():
        bad = next(c for c in value if not c.isprintable())
        where = value.index(bad)
        return (
            f"must hold printable characters only (character {where + 1} is "
            f"U+{ord(bad):04X}, which is not)"
        )
    return None


def check_id(value: str) -> str:
    """`value` if it is a valid id; ValueError with the reason otherwise (pydantic names the
    field)."""
    problem = id_problem(value)
    if problem is not None:
        raise ValueError(f"an id {problem}")
    return value


def require_id(field: str, value: object) -> str:
    """`value` if it is a valid id; ValueError naming `field` otherwise (for entrances that
    check an id before any event is built: a URL path, a CLI argument)."""
    problem = id_problem(value)
    if problem is not None:
        raise ValueError(f"{field} {problem}")
    assert isinstance(value, str)
    return value


Id = Annotated[str, AfterValidator(check_id)]
