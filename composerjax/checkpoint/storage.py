"""Where checkpoints live: a local folder, or an object store (``s3://``, ``gs://``) reached through fsspec.

orbax writes a checkpoint as a folder and makes it whole with a rename; object stores have no
rename, so a remote checkpoint is written the way Composer uploads one: orbax saves it into a
local *staging* folder, every file is then uploaded under ``<uri>/<name>/``, and only then the
*marker* object ``<uri>/<name>/.composerjax-complete``, a manifest of the files with the clock
the checkpoint recorded. A checkpoint without its marker (an upload cut short, by SIGKILL or
anything else) is never listed or loaded, so the bucket's previous checkpoints stay the newest
complete ones. Reading downloads the files the marker names into a local folder and loads that.

:func:`storage_for` picks the store for a ``save_folder``/``load_path``; :class:`LocalFolder` and
:class:`RemoteFolder` offer the same operations to :class:`~composerjax.checkpoint.checkpointer.Checkpointer`.

Credentials and endpoints are fsspec's (``s3fs``: the ``AWS_*`` variables, including
``AWS_ENDPOINT_URL`` for an S3-compatible server; ``gcsfs``: Google's application default
credentials). ``COMPOSERJAX_CHECKPOINT_STAGING`` sets the staging folder's root.

Example:
    >>> storage_for("runs/x/checkpoints").remote, storage_for("s3://bucket/runs/x").uri
    (False, 's3://bucket/runs/x')
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Any

from composerjax.checkpoint.writer import (
    REPLACED,
    CheckpointInfo,
    list_checkpoints,
    point_latest,
    remove_checkpoint,
)
from composerjax.parallel import dist

__all__ = ["MARKER", "SCHEMES", "LocalFolder", "RemoteFolder", "filesystem", "is_remote", "storage_for"]

#: URI scheme -> (fsspec protocol, the package that implements it).
SCHEMES = {"s3": ("s3", "s3fs"), "gs": ("gcs", "gcsfs")}
#: The object, uploaded last, that makes a remote checkpoint complete: a JSON manifest of its files.
MARKER = ".composerjax-complete"
_ORBAX_TMP = ".orbax-checkpoint-tmp"  # orbax's folder for a checkpoint it is still writing
_ACCEPTED = "a local folder, 's3://bucket/path' or 'gs://bucket/path'"


def is_remote(value: Any) -> bool:
    """Whether a ``save_folder``/``load_path`` names an object store (``scheme://...``) rather than a local folder.

    Example:
        >>> is_remote("s3://bucket/run"), is_remote("/tmp/run")
        (True, False)
    """
    return isinstance(value, (str, os.PathLike)) and "://" in os.fspath(value)


def storage_for(location: str | os.PathLike[str], field: str = "save_folder") -> LocalFolder | RemoteFolder:
    """The store of ``location``: a :class:`RemoteFolder` for ``s3://``/``gs://``, else a :class:`LocalFolder`.

    Raises:
        ValueError: another scheme (``ftp://``), or no bucket; naming ``field``.

    Example:
        >>> storage_for("gs://bucket/a/b/", "load_path").uri
        'gs://bucket/a/b'
    """
    text = os.fspath(location)
    if not is_remote(text):
        return LocalFolder(text)
    scheme, _, rest = text.partition("://")
    if scheme not in SCHEMES:
        raise ValueError(f"{field}={text!r}: unsupported scheme {scheme + '://'!r}; expected {_ACCEPTED}")
    bucket, _, prefix = rest.strip("/").partition("/")
    if not bucket:
        raise ValueError(f"{field}={text!r}: no bucket; expected {_ACCEPTED}")
    return RemoteFolder(scheme, bucket, prefix.strip("/"), field)


def filesystem(scheme: str, field: str = "save_folder", location: str = "") -> Any:
    """A new fsspec file system for ``scheme`` ('s3', 'gs'), listings uncached (other processes write too).

    Raises:
        ImportError: the package for the scheme (``s3fs``, ``gcsfs``) is not installed, naming ``field``.

    Example::

        filesystem("s3").ls("bucket/runs")
    """
    import fsspec

    protocol, package = SCHEMES[scheme]
    try:
        __import__(package)
    except ImportError as error:
        raise ImportError(f"{field}={location or scheme + '://'!r} needs the {package!r} package for {scheme}:// "
                          f"URIs: pip install {package} (or composerjax[{scheme if scheme == 's3' else 'gcs'}])"
                          ) from error
    return fsspec.filesystem(protocol, use_listings_cache=False, skip_instance_cache=True)


class LocalFolder:
    """A save folder on a local (or mounted) file system: orbax writes straight into it.

    Example:
        >>> import tempfile
        >>> LocalFolder(tempfile.mkdtemp()).list()
        []
    """

    remote = False

    def __init__(self, folder: str) -> None:
        self.folder = self.staging = self.uri = os.path.abspath(folder)

    def path(self, name: str) -> str:
        """Where checkpoint ``name`` is (or will be)."""
        return os.path.join(self.folder, name)

    def list(self, cache: dict[str, Any] | None = None) -> list[CheckpointInfo]:
        """The complete checkpoints, oldest first by recorded clock."""
        return list_checkpoints(self.folder, cache)

    def holds(self, name: str) -> bool:
        """Whether anything of that name is in the folder (a checkpoint, a link, a file)."""
        return os.path.lexists(self.path(name))

    def remove(self, info: CheckpointInfo) -> None:
        remove_checkpoint(info.path)

    def set_aside(self, name: str, listed: bool) -> None:
        """Make way for a new checkpoint ``name``; the old one (``listed``) loads under its name until then."""
        path = self.path(name)
        if os.path.isdir(path + REPLACED):
            remove_checkpoint(path + REPLACED)
        if listed:
            os.replace(path, path + REPLACED)
        else:
            remove_checkpoint(path)

    def drop_aside(self, name: str) -> None:
        if os.path.isdir(self.path(name) + REPLACED):
            remove_checkpoint(self.path(name) + REPLACED)

    def point_latest(self, link: str, target: str) -> None:
        point_latest(self.folder, link, target)

    def landed(self, name: str, batch: int, weights_only: bool) -> bool:
        """Whether the save of ``name`` is complete (orbax renamed its folder into place)."""
        return os.path.isdir(self.path(name))

    def prepare(self, name: str) -> None:
        """Nothing to do before orbax writes ``name`` here (the Checkpointer clears the way itself)."""

    def committed(self, name: str) -> None:
        """A verified save of ``name``: drop the copy it replaced."""
        self.drop_aside(name)

    def readable(self, info: CheckpointInfo) -> CheckpointInfo:
        """A local folder orbax can read ``info`` from: itself."""
        return info

    def close(self) -> None:
        """Nothing to clean up."""


class RemoteFolder:
    """A save folder in an object store: orbax writes into a local staging folder, then the files are uploaded.

    The layout under ``uri``: ``<name>/...`` (orbax's files), ``<name>/.composerjax-complete``
    (the marker, written last), and ``latest`` (an object holding the newest verified checkpoint's
    name). Uploads run on process 0 in orbax's writer thread, after every process wrote its
    part and before orbax reports the save finished; every process then checks the marker, so
    all of them take the same view of whether the save happened.

    Args:
        scheme: ``'s3'`` or ``'gs'``.
        bucket: the bucket.
        prefix: the folder inside the bucket ('' for its root).
        field: the argument it came from, for messages.

    Example:
        >>> RemoteFolder("s3", "bucket", "runs/x").path("ep1-ba8")
        's3://bucket/runs/x/ep1-ba8'
    """

    remote = True

    def __init__(self, scheme: str, bucket: str, prefix: str, field: str = "save_folder") -> None:
        self.scheme, self.bucket, self.prefix, self.field = scheme, bucket, prefix, field
        self.uri = self.folder = f"{scheme}://{bucket}" + (f"/{prefix}" if prefix else "")
        root = os.environ.get("COMPOSERJAX_CHECKPOINT_STAGING") or os.path.join(
            tempfile.gettempdir(), f"composerjax-staging-{os.getuid() if hasattr(os, 'getuid') else 0}")
        # The same on every process of a host: orbax's processes write their parts of one folder.
        self.staging = os.path.join(os.path.abspath(root), scheme, bucket, *prefix.split("/"))
        self._fs: Any = None
        self._downloads: str | None = None
        self._markers: dict[str, tuple[Any, CheckpointInfo]] = {}

    @property
    def fs(self) -> Any:
        """The fsspec file system (created on first use)."""
        if self._fs is None:
            self._fs = filesystem(self.scheme, self.field, self.uri)
        return self._fs

    def key(self, *parts: str) -> str:
        """The fsspec path (no scheme) of ``parts`` under the folder."""
        return "/".join([self.bucket, *([self.prefix] if self.prefix else []), *parts])

    def path(self, name: str) -> str:
        return f"{self.uri}/{name}"

    # -- listing ---------------------------------------------------------------------------------
    def list(self, cache: dict[str, Any] | None = None) -> list[CheckpointInfo]:
        """The complete checkpoints (those with a marker), oldest first by recorded clock."""
        try:
            found = self.fs.glob(self.key("*", MARKER), detail=True)
        except FileNotFoundError:
            return []
        infos = {}
        for key, detail in found.items():
            name = key.rstrip("/").split("/")[-2]
            tag = (detail.get("ETag") or detail.get("etag") or detail.get("md5Hash"), detail.get("size"),
                   detail.get("LastModified") or detail.get("updated"))
            seen = self._markers.get(name)
            if seen is None or seen[0] != tag:
                try:
                    record = json.loads(self.fs.cat_file(key))
                    seen = (tag, CheckpointInfo(name, self.path(name), int(record["batch"]),
                                                bool(record.get("weights_only")), bool(record.get("rotate", True)),
                                                int(record.get("committed_ns", 0))))
                except (OSError, ValueError, TypeError, KeyError):  # gone meanwhile, or not ours: not listed
                    continue
                self._markers[name] = seen
            infos[name] = seen[1]
        listed = []
        for name, info in infos.items():
            if name.endswith(REPLACED):
                if name[: -len(REPLACED)] in infos:  # its replacement is complete
                    continue
                info = info._replace(name=name[: -len(REPLACED)])
            listed.append(info)
        return sorted(listed, key=lambda info: (info.batch, info.committed_ns, info.name))

    def holds(self, name: str) -> bool:
        """False: in a bucket only a listed (complete) checkpoint takes a name; a cut-short upload's files do not."""
        return False

    def landed(self, name: str, batch: int, weights_only: bool) -> bool:
        """Whether the marker of ``name`` is there and records this save (its batch and kind)."""
        try:
            record = json.loads(self.fs.cat_file(self.key(name, MARKER)))
        except (OSError, ValueError):
            return False
        return record.get("batch") == batch and bool(record.get("weights_only")) == weights_only

    # -- writing ---------------------------------------------------------------------------------
    def prepare(self, name: str) -> None:
        """Clear what an earlier run left of ``name`` in the staging folder (process 0, before orbax writes it)."""
        for leftover in _staged(self.staging, name):
            shutil.rmtree(leftover, ignore_errors=True)

    def upload_staged(self, name: str, record: dict[str, Any]) -> None:
        """Upload the checkpoint orbax has written to the staging folder as ``name`` (see :meth:`upload`).

        Called before orbax renames its temporary folder into place (async) or after (sync):
        whichever of the two is there.
        """
        staged = [path for path in _staged(self.staging, name) if not path.endswith(REPLACED)]
        if len(staged) != 1:
            raise FileNotFoundError(f"checkpoint {name}: expected one staged copy in {self.staging!r}, found "
                                    f"{[os.path.basename(path) for path in staged]}")
        self.upload(staged[0], name, record)

    def committed(self, name: str) -> None:
        """A verified save of ``name``: drop the copy it replaced, and the staged copy (the bucket has it)."""
        self.drop_aside(name)
        self.prepare(name)

    def upload(self, local: str, name: str, record: dict[str, Any]) -> None:
        """Upload folder ``local`` as checkpoint ``name``: a cut-short upload's leftovers out, the files, the marker."""
        if self.fs.exists(self.key(name)):
            self.fs.rm(self.key(name), recursive=True)
        files = []
        for root, _, names in os.walk(local):
            files += [os.path.relpath(os.path.join(root, item), local) for item in names]
        files = sorted(file.replace(os.sep, "/") for file in files)
        if not files:
            raise FileNotFoundError(f"{local!r} holds no files to upload")
        self.fs.put([os.path.join(local, file) for file in files], [self.key(name, file) for file in files])
        sizes = {file: os.path.getsize(os.path.join(local, file)) for file in files}
        marker = {**record, "name": name, "committed_ns": time.time_ns(), "files": sizes}
        self.fs.pipe_file(self.key(name, MARKER), json.dumps(marker).encode())

    def remove(self, info: CheckpointInfo) -> None:
        """Delete a checkpoint: its marker first, so a half-deleted one is never listed."""
        self._remove_name(info.path.rsplit("/", 1)[-1])

    def _remove_name(self, name: str) -> None:
        try:
            self.fs.rm_file(self.key(name, MARKER))
        except FileNotFoundError:
            pass
        if self.fs.exists(self.key(name)):
            self.fs.rm(self.key(name), recursive=True)
        self._markers.pop(name, None)

    def set_aside(self, name: str, listed: bool) -> None:
        """Copy checkpoint ``name`` (if ``listed``) to ``<name>.composerjax-replaced``, marker last; delete ``name``."""
        self._remove_name(name + REPLACED)
        if listed:
            marker = self.fs.cat_file(self.key(name, MARKER))
            for file in json.loads(marker).get("files", {}):
                self.fs.copy(self.key(name, file), self.key(name + REPLACED, file))
            self.fs.pipe_file(self.key(name + REPLACED, MARKER), marker)
        self._remove_name(name)

    def drop_aside(self, name: str) -> None:
        self._remove_name(name + REPLACED)

    def point_latest(self, link: str, target: str) -> None:
        """Write the ``link`` object holding ``target``'s name (one PUT: readers see the old or the new name)."""
        self.fs.pipe_file(self.key(link), (target + "\n").encode())

    # -- reading ---------------------------------------------------------------------------------
    def locate(self) -> tuple[str, str | None]:
        """``(folder uri, name)`` for this URI as a ``load_path``: a checkpoint, a ``latest`` object, or a folder.

        Raises:
            FileNotFoundError: nothing is stored under the URI.
        """
        parent, _, last = self.uri.rpartition("/")
        key = self.key()
        if self.prefix and self.fs.exists(f"{key}/{MARKER}"):
            return parent, last
        if self.prefix and self.fs.isfile(key):
            target = self.fs.cat_file(key)[:4096].decode("utf-8", "replace").strip()
            if target and "/" not in target:
                return parent, target
        if not self.fs.exists(key):
            raise FileNotFoundError(f"{self.field}={self.uri!r} does not exist; expected a save_folder, one "
                                    "checkpoint inside it, or its latest object")
        return self.uri, None

    def readable(self, info: CheckpointInfo) -> CheckpointInfo:
        """``info`` downloaded into a local folder (reused while its marker is unchanged), for orbax to read.

        Raises:
            FileNotFoundError: the checkpoint is gone, or a file the marker names could not be downloaded whole.
        """
        if not info.path.startswith(self.uri + "/"):
            return info  # already local
        stored = info.path.rsplit("/", 1)[-1]
        if self._downloads is None:
            self._downloads = tempfile.mkdtemp(prefix=f"composerjax-download-{dist.process_index()}-")
        local = os.path.join(self._downloads, f"{stored}-{info.committed_ns}")
        if not os.path.isdir(local):
            files = json.loads(self.fs.cat_file(self.key(stored, MARKER)))["files"]
            partial = local + ".part"
            shutil.rmtree(partial, ignore_errors=True)
            targets = [os.path.join(partial, *file.split("/")) for file in files]
            for target in targets:
                os.makedirs(os.path.dirname(target), exist_ok=True)
            self.fs.get([self.key(stored, file) for file in files], targets)
            short = [file for file, target in zip(files, targets)
                     if not os.path.isfile(target) or os.path.getsize(target) != files[file]]
            if short:
                raise FileNotFoundError(f"{info.path}: {len(short)} file(s) did not download whole: {short[:5]}")
            os.replace(partial, local)
        return info._replace(path=local)

    def close(self) -> None:
        """Delete what was downloaded for reading."""
        if self._downloads is not None:
            shutil.rmtree(self._downloads, ignore_errors=True)
            self._downloads = None


def _staged(staging: str, name: str) -> list[str]:
    """The folders of ``staging`` holding checkpoint ``name``: orbax's final one and its temporary ones."""
    try:
        entries = os.listdir(staging)
    except OSError:
        return []
    return [os.path.join(staging, entry) for entry in sorted(entries)
            if entry == name or entry.startswith(name + _ORBAX_TMP)]
