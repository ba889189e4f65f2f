"""Versioned resources that agents run with and algorithms improve."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, Field

from agl_stream.events.base import MAX_LONG, Event, Record
from agl_stream.events.ids import Id
from agl_stream.events.templates import placeholders, render

# A version published with metadata pin_only=true (an algorithm's candidate under evaluation)
# runs only in tasks that pin it: it never becomes the latest version.
PIN_ONLY = "pin_only"

_CONTENT_HASH = re.compile(r"^sha256:[0-9a-f]{64}$")


def _content_hash(value: str) -> str:
    if not _CONTENT_HASH.match(value):
        raise ValueError("content_hash must look like sha256:<64 lowercase hex digits>")
    return value


class TemplateEngine(StrEnum):
    F_STRING = "f_string"
    JINJA = "jinja"
    POML = "poml"


class LLM(Record):
    """An OpenAI-compatible endpoint serving a model."""

    endpoint: str = Field(min_length=1)
    model: str = Field(min_length=1)
    sampling_parameters: dict[str, float] = Field(default_factory=dict)


class PromptTemplate(Record):
    template: str
    engine: TemplateEngine = TemplateEngine.F_STRING

    def format(self, **values: Any) -> str:
        """The template filled in (f_string or jinja); raises TemplateError when it cannot be."""
        return render(self.template, self.engine.value, values)

    def placeholders(self) -> frozenset[str]:
        return placeholders(self.template, self.engine.value)


class Checkpoint(Record):
    """Model weights by reference; the bytes never travel on a topic. `format` is
    "safetensors" (a whole Hugging Face model directory) or "peft" (a LoRA adapter directory,
    applied to the model that `base_uri` names, whose content `base_content_hash` pins)."""

    uri: str = Field(min_length=1)
    content_hash: Annotated[str, AfterValidator(_content_hash)]
    format: str = "safetensors"
    base_uri: str | None = None
    base_content_hash: Annotated[str, AfterValidator(_content_hash)] | None = None


Resource = LLM | PromptTemplate | Checkpoint


class ResourcesPublished(Event):
    key_field: ClassVar[str] = "resources_id"

    resources_id: Id
    version: int = Field(ge=0, le=MAX_LONG)
    resources: dict[str, Resource]
    published_by: str | None = None
    parent_resources_id: Id | None = None
    metadata: dict[str, str] = Field(default_factory=dict)

    @property
    def pin_only(self) -> bool:
        return self.metadata.get(PIN_ONLY) == "true"
