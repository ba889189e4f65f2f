"""Prompt templates: the placeholders they name, and rendering them (pure code).

Two engines are rendered here: `f_string` (Python's str.format with named placeholders) and
`jinja` (needs the jinja2 package). A POML template is stored and versioned like any other,
but an agent renders it with the poml package itself.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Any


class TemplateError(ValueError):
    """A template that cannot be read or filled; the message says why."""


def placeholders(template: str, engine: str = "f_string") -> frozenset[str]:
    """The names a template fills in (for f-strings, the part before any . or [)."""
    if engine == "f_string":
        return _fstring_names(template)
    if engine == "jinja":
        jinja2, meta = _jinja()
        try:
            parsed = jinja2.Environment().parse(template)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(
                f"not a valid jinja template: {exc.message} (line {exc.lineno})"
            ) from None
        return frozenset(meta.find_undeclared_variables(parsed))
    raise TemplateError(
        f"{engine} templates are not rendered by agl-stream; render them with the {engine} package"
    )


def render(template: str, engine: str, values: Mapping[str, Any]) -> str:
    """The template filled with `values`; a placeholder with no value is an error."""
    missing = sorted(placeholders(template, engine) - set(values))
    if missing:
        raise TemplateError(f"no value for placeholder(s) {', '.join(missing)}")
    if engine == "jinja":
        jinja2, _ = _jinja()
        env = jinja2.Environment(undefined=jinja2.StrictUndefined)
        return str(env.from_string(template).render(**values))
    try:
        return template.format_map(dict(values))
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as exc:
        raise TemplateError(f"could not fill the template: {type(exc).__name__}: {exc}") from None


def _fstring_names(template: str) -> frozenset[str]:
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise TemplateError(
            f"not a valid f-string template: {exc} (write a literal brace as {{{{ or }}}})"
        ) from None
    names = set()
    for field in fields:
        name = field.split(".", 1)[0].split("[", 1)[0]
        if not name or name.isdigit():
            raise TemplateError(
                f"placeholder {{{field}}} has no name: a task fills placeholders by name"
            )
        names.add(name)
    return frozenset(names)


def _jinja() -> tuple[Any, Any]:
    try:
        import jinja2
        from jinja2 import meta
    except ImportError:
        raise TemplateError("jinja templates need the jinja2 package: pip install jinja2") from None
    return jinja2, meta
