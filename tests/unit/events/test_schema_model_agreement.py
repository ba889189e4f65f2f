"""Every pydantic event model mirrors its Avro schema field by field: same names in the same
order, same types, same optionality and defaults."""

from __future__ import annotations

import types
import typing
import uuid
from datetime import datetime
from enum import StrEnum
from typing import Any, Union, get_args, get_origin

import pytest
from pydantic import AwareDatetime, BaseModel
from pydantic_core import PydanticUndefined

from agl_stream.bus.schema_registry import load_current
from agl_stream.events import EVENT_TYPES
from agl_stream.events.base import utc_now

CURRENT = load_current()
GENERATED = {uuid.uuid4, utc_now}
PRIMITIVE_TYPES = {"string": str, "long": int, "int": int, "double": float, "boolean": bool}


def _strip(annotation: Any) -> Any:
    while get_origin(annotation) is typing.Annotated:
        annotation = get_args(annotation)[0]
    return annotation


def _union_members(annotation: Any) -> list[Any]:
    annotation = _strip(annotation)
    if get_origin(annotation) in (Union, types.UnionType):
        out: list[Any] = []
        for arg in get_args(annotation):
            out += _union_members(arg)
        return out
    return [annotation]


def _matches(annotation: Any, avro: Any, names: dict[str, Any], where: str) -> bool:
    try:
        check(annotation, avro, names, where)
    except AssertionError:
        return False
    return True


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def check(annotation: Any, avro: Any, names: dict[str, Any], where: str) -> None:
    annotation = _strip(annotation)
    if isinstance(avro, str) and avro in names:
        avro = names[avro]
    if isinstance(avro, list):
        # Order may differ (str | None against ["null", "string"]); each branch must match
        # exactly one member.
        members = _union_members(annotation)
        assert len(members) == len(avro), f"{where}: union {avro} vs {annotation}"
        for branch in avro:
            matches = [m for m in members if _matches(m, branch, names, where)]
            assert len(matches) == 1, f"{where}: union branch {branch} matches {matches}"
        return
    if avro == "null":
        assert annotation is type(None), f"{where}: null vs {annotation}"
        return
    if isinstance(avro, str):
        assert avro in PRIMITIVE_TYPES, f"{where}: unknown named type {avro}"
        expected = PRIMITIVE_TYPES[avro]
        assert annotation is expected, f"{where}: {avro} vs {annotation}"
        return
    logical = avro.get("logicalType")
    if logical == "uuid":
        assert annotation is uuid.UUID, where
        return
    if logical == "timestamp-micros":
        assert annotation in (datetime, AwareDatetime), f"{where}: timestamp vs {annotation}"
        return
    kind = avro["type"]
    if kind in ("record", "enum"):
        names[avro["name"]] = avro
    if kind == "array":
        assert get_origin(annotation) in (tuple, list), f"{where}: array vs {annotation}"
        check(get_args(annotation)[0], avro["items"], names, f"{where}[]")
    elif kind == "map":
        assert get_origin(annotation) is dict, f"{where}: map vs {annotation}"
        key, value = get_args(annotation)
        assert key is str, where
        check(value, avro["values"], names, f"{where}{{}}")
    elif kind == "enum":
        assert issubclass(annotation, StrEnum), f"{where}: enum vs {annotation}"
        assert annotation.__name__ == _short(avro["name"]), where
        assert [m.value for m in annotation] == avro["symbols"], f"{where}: symbols differ"
    elif kind == "record":
        assert issubclass(annotation, BaseModel), f"{where}: record vs {annotation}"
        assert annotation.__name__ == _short(avro["name"]), (
            f"{where}: {annotation} vs {avro['name']}"
        )
        check_record(annotation, avro, names)
    else:
        check(annotation, kind, names, where)


def check_record(model: type[BaseModel], avro: dict[str, Any], names: dict[str, Any]) -> None:
    model_fields = model.model_fields
    assert list(model_fields) == [f["name"] for f in avro["fields"]], model.__name__
    for field in avro["fields"]:
        info = model_fields[field["name"]]
        where = f"{model.__name__}.{field['name']}"
        check(info.annotation, field["type"], names, where)
        has_avro_default = "default" in field
        if info.default_factory in GENERATED:
            # Filled in when the event is made (ids, times): always on the wire.
            assert not has_avro_default, f"{where}: a generated field needs no Avro default"
            continue
        assert has_avro_default == (not info.is_required()), f"{where}: default presence differs"
        if has_avro_default and info.default is not PydanticUndefined:
            default = info.default
            if isinstance(default, StrEnum):
                default = default.value
            elif isinstance(default, tuple):
                default = list(default)
            elif isinstance(default, BaseModel):
                default = default.model_dump(mode="json")
            assert default == field["default"], (
                f"{where}: default {default!r} vs {field['default']!r}"
            )
        if has_avro_default and info.default_factory is not None:
            produced = info.default_factory()  # type: ignore[call-arg]
            if isinstance(produced, BaseModel):
                produced = produced.model_dump(mode="json")
            assert produced == field["default"], (
                f"{where}: default {produced!r} vs {field['default']!r}"
            )


@pytest.mark.parametrize("event_type", sorted(EVENT_TYPES))
def test_model_mirrors_schema(event_type: str) -> None:
    check_record(EVENT_TYPES[event_type], dict(CURRENT[event_type].schema), {})


def test_every_schema_has_a_model_and_every_model_a_schema() -> None:
    assert set(CURRENT) == set(EVENT_TYPES)
