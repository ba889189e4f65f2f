"""`agl-stream resources publish`: put a resources version on the topic by hand (the LLM
endpoint agents call, a seed prompt template) for runners and algorithms to start from."""

from __future__ import annotations

from typing import Any

import click
from pydantic import ValidationError

from agl_stream.cli.common import (
    AppContext,
    console,
    friendly_errors,
    parse_key_values,
    run,
    text_or_file,
)
from agl_stream.events import LLM, PromptTemplate, TemplateEngine
from agl_stream.events.templates import TemplateError


def _named(value: str, flag: str) -> tuple[str, str]:
    name, sep, rest = value.partition("=")
    if not sep or not name or not rest:
        raise click.BadParameter(f"{value!r} is not NAME=VALUE", param_hint=flag)
    return name, rest


def parse_llm(value: str) -> tuple[str, LLM]:
    """NAME=ENDPOINT@MODEL -> (NAME, LLM)."""
    name, rest = _named(value, "--llm")
    endpoint, sep, model = rest.rpartition("@")
    if not sep or not endpoint or not model:
        raise click.BadParameter(f"{value!r} is not NAME=ENDPOINT@MODEL", param_hint="--llm")
    if not endpoint.startswith(("http://", "https://")):
        raise click.BadParameter(f"endpoint {endpoint!r} is not an http(s) URL", param_hint="--llm")
    return name, LLM(endpoint=endpoint, model=model)


def read_template(value: str, engine: str, flag: str, name: str = "") -> PromptTemplate:
    """TEXT or @FILE as a PromptTemplate whose placeholders read; else a usage error."""
    prompt = PromptTemplate(template=text_or_file(value, flag), engine=TemplateEngine(engine))
    try:
        prompt.placeholders()
    except TemplateError as exc:
        where = f"{name}: " if name else ""
        raise click.BadParameter(f"{where}{exc}", param_hint=flag) from None
    return prompt


def parse_prompt(value: str, engine: str) -> tuple[str, PromptTemplate]:
    """NAME=TEXT or NAME=@FILE -> (NAME, PromptTemplate), its placeholders checked."""
    name, text = _named(value, "--prompt")
    return name, read_template(text, engine, "--prompt", name)


@click.group()
def resources() -> None:
    """Resources versions on the resources topic."""


@resources.command()
@click.argument("resources_id")
@click.option(
    "--llm",
    "llms",
    multiple=True,
    metavar="NAME=ENDPOINT@MODEL",
    help="An OpenAI-compatible endpoint and model (repeatable).",
)
@click.option(
    "--prompt",
    "prompts",
    multiple=True,
    metavar="NAME=TEXT|NAME=@FILE",
    help="A prompt template (repeatable).",
)
@click.option(
    "--engine",
    type=click.Choice(["f_string", "jinja"]),
    default="f_string",
    show_default=True,
    help="Template engine of the --prompt templates.",
)
@click.option(
    "--carry/--no-carry",
    default=True,
    show_default=True,
    help="Keep the latest version's other resources (a checkpoint, say).",
)
@click.option("--metadata", multiple=True, metavar="KEY=VALUE", help="Repeatable.")
@click.pass_obj
@friendly_errors
def publish(
    app: AppContext,
    resources_id: str,
    llms: tuple[str, ...],
    prompts: tuple[str, ...],
    engine: str,
    carry: bool,
    metadata: tuple[str, ...],
) -> None:
    """Publish RESOURCES_ID as the new latest version (its number: one above the highest).

    Example: agl-stream resources publish setup-v1 --llm llm=http://127.0.0.1:8000/v1@policy
    --prompt prompt='Answer briefly: {question}'
    """
    named: dict[str, Any] = dict(parse_llm(v) for v in llms)
    named.update(parse_prompt(v, engine) for v in prompts)
    if not named:
        raise click.UsageError("say what to publish: --llm and/or --prompt")
    meta = parse_key_values(metadata, "--metadata")
    version, created = run(_publish(app, resources_id, named, carry, meta))
    if created:
        console.print(f"published {resources_id} as version {version}", highlight=False)
    else:
        console.print(
            f"{resources_id} was already published with these resources, as version {version}",
            highlight=False,
        )


async def _publish(
    app: AppContext, resources_id: str, named: dict[str, Any], carry: bool, meta: dict[str, str]
) -> tuple[int, bool]:
    from agl_stream.commands.resources import Change, ResourcesConflict, ResourcesPublisher

    try:
        change = Change(resources=named, resources_id=resources_id, carry=carry, metadata=meta)
        async with ResourcesPublisher(app.kafka(), published_by="cli") as publisher:
            event = await publisher.publish(change)
    except ValidationError as exc:
        raise click.UsageError(f"invalid resources: {exc.errors()[0]['msg']}") from None
    except ResourcesConflict as exc:
        raise click.UsageError(str(exc)) from None
    return event.version, resources_id in publisher.created
