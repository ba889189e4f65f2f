"""Checkpoints in an S3-compatible object store (AWS S3, MinIO, SeaweedFS, Ceph...), through
boto3: the storage behind `--checkpoint-dir s3://bucket/prefix`.

A step is a "directory" of objects under `prefix/step-000012/`; it counts as stored once its
trainer.json is, which is uploaded last (the object-store form of the local store's rename).
A trainer writes each step on local disk first (a cache), then uploads it; whoever reads a
checkpoint (a resumed trainer, a runner's or `serve`'s model) downloads it into its cache once.
Credentials and the endpoint come from boto3's own settings: AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL (for a store that is not AWS), AWS_DEFAULT_REGION, or
an instance/pod role. The cache is AGL_STREAM_CHECKPOINT_CACHE (default
~/.cache/agl-stream/checkpoints).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import urlparse

SCHEMES = ("s3",)
CACHE_VARIABLE = "AGL_STREAM_CHECKPOINT_CACHE"
T = TypeVar("T")


class StorageError(OSError):
    """The object store refused or could not be reached; the message names the location."""


class RemoteStorage(Protocol):
    """What the checkpoint store needs of a place that is not a local directory."""

    @property
    def location(self) -> str: ...
    def uri(self, name: str) -> str: ...
    def name_of(self, uri: str) -> str | None: ...
    def names(self, marker: str) -> list[str]: ...
    def upload(self, local: Path, name: str, last: str) -> None: ...
    def download(self, name: str, local: Path) -> None: ...
    def read_text(self, name: str, file: str) -> str: ...
    def delete(self, name: str, first: str) -> None: ...


def is_remote(location: str) -> bool:
    return urlparse(location).scheme in SCHEMES


def cache_root() -> Path:
    configured = os.environ.get(CACHE_VARIABLE)
    base = Path(configured) if configured else Path.home() / ".cache" / "agl-stream" / "checkpoints"
    return base.expanduser().resolve()


def cache_dir(location: str) -> Path:
    """Where a remote location's steps are kept on this machine."""
    parsed = urlparse(location)
    return cache_root() / parsed.scheme / parsed.netloc / parsed.path.strip("/")


def storage(location: str) -> RemoteStorage:
    parsed = urlparse(location)
    if parsed.scheme == "s3":
        return S3Storage(location)
    raise ValueError(f"checkpoint location {location!r}: no storage for {parsed.scheme}://")


def local_copy(uri: str) -> Path:
    """A remote step directory on this machine, downloaded into the cache unless a whole copy
    is there already (a download is renamed into place when complete)."""
    parsed = urlparse(uri)
    parent, _, name = parsed.path.strip("/").rpartition("/")
    remote = storage(f"{parsed.scheme}://{parsed.netloc}/{parent}")
    target = cache_dir(remote.location) / name
    if not target.is_dir():
        remote.download(name, target)
    return target


@dataclass
class S3Storage:
    location: str  # s3://bucket/prefix
    _s3: Any = field(default=None, init=False, repr=False, compare=False)

    @property
    def bucket(self) -> str:
        return urlparse(self.location).netloc

    @property
    def prefix(self) -> str:
        path = urlparse(self.location).path.strip("/")
        return f"{path}/" if path else ""

    def __post_init__(self) -> None:
        if not self.bucket:
            raise ValueError(f"checkpoint location {self.location!r}: write s3://BUCKET/PREFIX")

    def uri(self, name: str) -> str:
        return f"s3://{self.bucket}/{self.prefix}{name}"

    def name_of(self, uri: str) -> str | None:
        """The step name `uri` points at when it is one of this location's, else None."""
        head = f"s3://{self.bucket}/{self.prefix}"
        rest = uri.rstrip("/").removeprefix(head) if uri.startswith(head) else None
        return rest if rest and "/" not in rest else None

    # -- reading ----------------------------------------------------------------------------

    def _objects(self, prefix: str) -> Iterator[str]:
        paginator = self._client().get_paginator("list_objects_v2")
        for page in self._call(lambda: list(paginator.paginate(Bucket=self.bucket, Prefix=prefix))):
            for item in page.get("Contents", []):
                yield str(item["Key"])

    def names(self, marker: str) -> list[str]:
        """Names of the steps whose `marker` object is stored (the whole ones)."""
        found = []
        for key in self._objects(self.prefix):
            name, _, file = key.removeprefix(self.prefix).partition("/")
            if file == marker:
                found.append(name)
        return found

    def read_text(self, name: str, file: str) -> str:
        key = f"{self.prefix}{name}/{file}"
        body = self._call(lambda: self._client().get_object(Bucket=self.bucket, Key=key)["Body"])
        return str(body.read().decode())

    def download(self, name: str, local: Path) -> None:
        """Every object of the step into `local` (written beside it, then renamed)."""
        head = f"{self.prefix}{name}/"
        keys = list(self._objects(head))
        if not keys:
            raise StorageError(f"{self.uri(name)} holds no objects")
        staging = local.with_name(f"{local.name}.partial-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        client = self._client()
        for key in keys:
            target = staging / key.removeprefix(head)
            target.parent.mkdir(parents=True, exist_ok=True)
            self._call(partial(client.download_file, self.bucket, key, str(target)))
        try:
            os.rename(staging, local)
        except OSError:  # another process put a whole copy there first
            shutil.rmtree(staging, ignore_errors=True)
            if not local.is_dir():
                raise

    # -- writing ----------------------------------------------------------------------------

    def upload(self, local: Path, name: str, last: str) -> None:
        """Every file under `local` to the step's objects, `last` after all others."""
        client = self._client()
        files = sorted(p for p in local.rglob("*") if p.is_file())
        files.sort(key=lambda p: p.name == last)  # stable: `last` goes last
        for path in files:
            key = f"{self.prefix}{name}/{path.relative_to(local).as_posix()}"
            self._call(partial(client.upload_file, str(path), self.bucket, key))

    def delete(self, name: str, first: str) -> None:
        """Remove the step: `first` (its marker) before the rest, so it stops counting first."""
        client = self._client()
        head = f"{self.prefix}{name}/"
        keys = sorted(self._objects(head), key=lambda k: k != f"{head}{first}")
        for key in keys:
            self._call(partial(client.delete_object, Bucket=self.bucket, Key=key))

    # -- boto3 ------------------------------------------------------------------------------

    def _client(self) -> Any:
        if self._s3 is None:
            try:
                import boto3
            except ImportError:
                raise ValueError(
                    f"checkpoint location {self.location!r} needs boto3: "
                    "pip install 'agl-stream[s3]'"
                ) from None
            # A session of its own: boto3's default one keeps the credentials it first read.
            self._s3 = boto3.session.Session().client("s3")
        return self._s3

    def _call(self, action: Callable[[], T]) -> T:
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return action()
        except Boto3Error as exc:  # a transfer (upload_file, download_file) that failed
            raise StorageError(f"{self.location}: {exc}") from None
        except ClientError as exc:
            error = exc.response.get("Error", {})
            raise StorageError(
                f"{self.location}: the object store answered {error.get('Code', '?')} "
                f"({error.get('Message') or exc})"
            ) from None
        except BotoCoreError as exc:
            raise StorageError(f"{self.location}: {exc}") from None


def read_json(remote: RemoteStorage, name: str, file: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(remote.read_text(name, file))
    return loaded
