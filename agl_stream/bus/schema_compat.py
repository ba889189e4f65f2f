"""Avro schema resolution rules, as a checker: can data written with one schema be read with
another? Pure functions over parsed JSON schemas (no fastavro), so the failure says why.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

PRIMITIVES = frozenset({"null", "boolean", "int", "long", "float", "double", "bytes", "string"})
PROMOTIONS = {
    "int": {"long", "float", "double"},
    "long": {"float", "double"},
    "float": {"double"},
    "string": {"bytes"},
    "bytes": {"string"},
}

Schema = Any  # a str, a list (union) or a dict, as in JSON


def _collect_names(schema: Schema, namespace: str, names: dict[str, Schema]) -> None:
    if isinstance(schema, list):
        for branch in schema:
            _collect_names(branch, namespace, names)
        return
    if not isinstance(schema, dict):
        return
    kind = schema.get("type")
    if kind in ("record", "error", "enum", "fixed"):
        full = _full_name(schema["name"], schema.get("namespace", namespace))
        names[full] = schema
        names.setdefault(full.rsplit(".", 1)[-1], schema)
        inner_ns = full.rsplit(".", 1)[0] if "." in full else ""
        for f in schema.get("fields", []):
            _collect_names(f["type"], inner_ns, names)
    elif kind == "array":
        _collect_names(schema["items"], namespace, names)
    elif kind == "map":
        _collect_names(schema["values"], namespace, names)
    elif isinstance(kind, dict | list):
        _collect_names(kind, namespace, names)


def _full_name(name: str, namespace: str | None) -> str:
    return name if "." in name or not namespace else f"{namespace}.{name}"


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


class _Resolver:
    def __init__(self, writer_names: Mapping[str, Schema], reader_names: Mapping[str, Schema]):
        self.w_names = writer_names
        self.r_names = reader_names
        self.seen: set[tuple[str, str]] = set()

    def _deref(self, schema: Schema, names: Mapping[str, Schema]) -> Schema:
        while True:
            if isinstance(schema, str) and schema not in PRIMITIVES:
                schema = names.get(schema, names.get(_short(schema), schema))
            elif isinstance(schema, dict) and _is_wrapper(schema):
                # {"type": "long", "logicalType": ...} resolves as its underlying type
                schema = schema["type"]
            else:
                return schema

    @staticmethod
    def _kind(schema: Schema) -> str:
        if isinstance(schema, list):
            return "union"
        if isinstance(schema, str):
            return schema
        return str(schema["type"])

    def errors(self, writer: Schema, reader: Schema, path: str) -> list[str]:
        writer = self._deref(writer, self.w_names)
        reader = self._deref(reader, self.r_names)
        wk, rk = self._kind(writer), self._kind(reader)
        if wk == "union":
            out: list[str] = []
            for branch in writer:
                out += self.errors(branch, reader, path)
            return out
        if rk == "union":
            for branch in reader:
                if not self.errors(writer, branch, path):
                    return []
            return [
                f"{path}: writer type {_describe(writer)} matches no branch of the reader's union"
            ]
        if wk in PRIMITIVES or rk in PRIMITIVES:
            if wk == rk or rk in PROMOTIONS.get(wk, set()):
                return []
            return [f"{path}: writer type {wk} cannot be read as {rk}"]
        if wk != rk:
            return [f"{path}: writer type {wk} cannot be read as {rk}"]
        if wk in ("record", "error", "enum", "fixed"):
            w_name, r_name = _short(writer["name"]), _short(reader["name"])
            aliases = {_short(a) for a in reader.get("aliases", [])}
            if w_name != r_name and w_name not in aliases:
                return [f"{path}: named type {w_name} cannot be read as {r_name}"]
        if wk == "array":
            return self.errors(writer["items"], reader["items"], f"{path}[]")
        if wk == "map":
            return self.errors(writer["values"], reader["values"], f"{path}{{}}")
        if wk == "fixed":
            if writer["size"] != reader["size"]:
                return [f"{path}: fixed size {writer['size']} cannot be read as {reader['size']}"]
            return []
        if wk == "enum":
            missing = [s for s in writer["symbols"] if s not in reader["symbols"]]
            if missing and "default" not in reader:
                return [
                    f"{path}: enum symbols {missing} unknown to the reader, which has no default"
                ]
            return []
        return self._record_errors(writer, reader, path)

    def _record_errors(self, writer: Schema, reader: Schema, path: str) -> list[str]:
        key = (writer["name"], reader["name"])
        if key in self.seen:  # recursive type: already being checked further up
            return []
        self.seen.add(key)
        written = {f["name"]: f for f in writer["fields"]}
        for f in writer["fields"]:
            for alias in f.get("aliases", []):
                written.setdefault(alias, f)
        out: list[str] = []
        for field in reader["fields"]:
            source = written.get(field["name"])
            if source is None:
                for alias in field.get("aliases", []):
                    source = source or written.get(alias)
            where = f"{path}.{field['name']}" if path else field["name"]
            if source is None:
                if "default" not in field:
                    out.append(
                        f"{where}: reader field is missing from the writer and has no default"
                    )
                continue
            out += self.errors(source["type"], field["type"], where)
        return out


def _is_wrapper(schema: dict[str, Any]) -> bool:
    inner = schema.get("type")
    return (isinstance(inner, str) and inner in PRIMITIVES) or isinstance(inner, dict | list)


def _describe(schema: Schema) -> str:
    if isinstance(schema, dict):
        return str(schema.get("name", schema.get("type")))
    return str(schema)


def resolution_errors(writer: Schema, reader: Schema) -> list[str]:
    """Why data written with `writer` cannot be read with `reader`; empty when it can."""
    w_names: dict[str, Schema] = {}
    r_names: dict[str, Schema] = {}
    _collect_names(writer, "", w_names)
    _collect_names(reader, "", r_names)
    root = _short(writer["name"]) if isinstance(writer, dict) and "name" in writer else ""
    return _Resolver(w_names, r_names).errors(writer, reader, root)


def compatibility_errors(old: Mapping[str, Schema], new: Mapping[str, Schema]) -> list[str]:
    """Everything that stops the new set from reading old data, or old readers from reading
    new data. Removing an event type is an error; adding one is not."""
    out: list[str] = []
    for event_type, old_schema in sorted(old.items()):
        if event_type not in new:
            out.append(f"{event_type}: removed, but released data of this type must stay readable")
            continue
        out += [
            f"new readers of old data: {e}" for e in resolution_errors(old_schema, new[event_type])
        ]
        out += [
            f"old readers of new data: {e}" for e in resolution_errors(new[event_type], old_schema)
        ]
    return out
