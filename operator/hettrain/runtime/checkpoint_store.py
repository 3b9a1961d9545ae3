"""Where checkpoints live: an fsspec filesystem (a local / PVC path or ``s3://bucket/prefix``).

Layout under the job's root (the operator already appends the per-job subdirectory to the URI)::

    step-12/rank-00003.safetensors   this rank's pieces (checkpoint_format)
    step-12/rank-00003.json          this rank's piece manifest (written after its data)
    step-12/manifest.json            all ranks' manifests merged by rank 0
    step-12/COMMITTED                the commit marker, written LAST
    latest                                 "step-12" (a hint for humans; never trusted)

**Atomic publish**: a checkpoint exists for readers only when its ``COMMITTED`` marker does;
rank 0 writes it after every rank's manifest is present and merged. On a local filesystem the
ranks write into ``step-N.tmp/`` and rank 0 renames it to ``step-N/`` before writing the
marker (so a half-written step never even has its final name); object stores have no atomic
rename and rely on the marker alone.

**Small objects appear whole** (:meth:`CheckpointStore.write_bytes`: the rank manifests that
rank 0 polls for, ``manifest.json``, the marker): on a local / PVC filesystem they are written
under a temporary name in the same directory (``<name>.<random>.partial``) and renamed into
place, so a reader never sees a file that exists but is still empty or half-written; on an
object store one PUT is atomic already. Rank 0's wait for the rank manifests
(:meth:`CheckpointStore.wait_for_json`) still counts a manifest that does not parse as "not
there yet" (and says so if it never completes), as polling is the design there.

**Retention** deletes all but the newest ``keep`` committed checkpoints (marker first, so a
half-deleted one is invisible) and any incomplete one older than the newest committed.

Credentials come only from the environment (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``
/ ``AWS_SESSION_TOKEN``, ``AWS_ENDPOINT_URL`` for S3-compatible stores), injected by the operator
from the Secret ``spec.checkpoint.secretRef``; they never appear in a URI, log or error.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
import uuid
from dataclasses import dataclass
from urllib.parse import urlparse

import fsspec

COMMITTED = "COMMITTED"
MANIFEST = "manifest.json"
LATEST = "latest"
PARTIAL = ".partial"  # suffix of a small object being written (local filesystems)
POLL_S = 0.05
STEP_RE = re.compile(r"^step-(\d+)(\.tmp)?$")
URI_FIELD = "spec.checkpoint.uri (env HETTRAIN_CHECKPOINT_URI)"
SECRET_FIELD = "spec.checkpoint.secretRef"
ENV_ENDPOINT = "AWS_ENDPOINT_URL"
SCHEMES = ("", "file", "s3")


class CheckpointStorageError(RuntimeError):
    """The checkpoint storage cannot be used (bad URI, missing bucket, wrong credentials)."""


def step_dir(step: int) -> str:
    """The directory name of step ``step``."""
    return f"step-{step}"


def redact(uri: str) -> str:
    """``uri`` without any ``user:password@`` part (safe for logs and errors)."""
    p = urlparse(uri)
    if p.username or p.password:
        return p._replace(netloc=p.hostname or "").geturl()
    return uri


@dataclass
class CheckpointStore:
    """The job's checkpoint directory on one fsspec filesystem."""

    fs: fsspec.AbstractFileSystem
    root: str
    uri: str
    local: bool

    @classmethod
    def open(cls, uri: str) -> CheckpointStore:
        """The store at ``uri`` (a path, ``file://`` or ``s3://bucket/prefix``)."""
        if not uri:
            raise CheckpointStorageError(f"{URI_FIELD} is empty: set a directory or s3:// URI")
        parsed = urlparse(uri)
        if parsed.scheme not in SCHEMES:
            raise CheckpointStorageError(
                f"{URI_FIELD}={redact(uri)!r}: scheme {parsed.scheme!r} unsupported; use a path "
                "(a PVC via spec.checkpoint.pvc), file:// or s3://bucket/prefix")
        if parsed.username or parsed.password:
            raise CheckpointStorageError(
                f"{URI_FIELD}={redact(uri)!r}: credentials in the URI are refused; put them in "
                f"the Secret named by {SECRET_FIELD}")
        if parsed.scheme == "s3":
            if not parsed.netloc:
                raise CheckpointStorageError(f"{URI_FIELD}={uri!r}: no bucket; use "
                                             "s3://bucket/prefix")
            try:
                import s3fs
            except ImportError as e:  # pragma: no cover - the runtime extra installs it
                raise CheckpointStorageError("s3:// checkpoints need the s3fs package "
                                             "(pip install hettrain[runtime])") from e
            kwargs: dict = {"use_listings_cache": False, "skip_instance_cache": True}
            if os.environ.get(ENV_ENDPOINT):
                kwargs["client_kwargs"] = {"endpoint_url": os.environ[ENV_ENDPOINT]}
            fs = s3fs.S3FileSystem(**kwargs)
            root = f"{parsed.netloc}/{parsed.path.strip('/')}".rstrip("/")
            return cls(fs, root, uri, local=False)
        path = parsed.path if parsed.scheme == "file" else uri
        return cls(fsspec.filesystem("file"), os.path.abspath(path), uri, local=True)

    # -- paths ---------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        """A path under the root."""
        return "/".join([self.root, *parts])

    def staging(self, step: int) -> str:
        """Where the ranks write step ``step`` (its final directory on object stores)."""
        return self.path(step_dir(step) + (".tmp" if self.local else ""))

    def final(self, step: int) -> str:
        """The published directory of step ``step``."""
        return self.path(step_dir(step))

    # -- errors --------------------------------------------------------------------------
    def error(self, action: str, exc: BaseException) -> CheckpointStorageError:
        """A one-line storage error naming the spec fields to fix (no secrets)."""
        text = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        hint = ("check that the bucket exists, the endpoint is reachable and the credentials "
                f"in the Secret named by {SECRET_FIELD} are valid" if not self.local else
                "check that the path (the PVC of spec.checkpoint.pvc) exists and is writable "
                "by the container user")
        return CheckpointStorageError(f"{URI_FIELD}={redact(self.uri)!r}: cannot {action} "
                                      f"({text}); {hint}")

    def probe(self) -> None:
        """Fail fast: create the root, write and delete a probe object."""
        probe = self.path(f".probe-{os.getpid()}")
        try:
            if self.local:
                self.fs.makedirs(self.root, exist_ok=True)
            self.fs.pipe_file(probe, b"ok")
            self.fs.rm_file(probe)
        except Exception as e:
            raise self.error("write a probe object", e) from None

    # -- listing -------------------------------------------------------------------------
    def _entries(self) -> list[tuple[int, bool, str]]:
        """``(step, staging, path)`` of every step directory under the root."""
        try:
            if not self.fs.exists(self.root):
                return []
            names = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:  # an object store's prefix emptied since exists() (another
            return []              # rank's probe object, written and removed meanwhile)
        except Exception as e:
            raise self.error("list checkpoints", e) from None
        out = []
        for p in names:
            m = STEP_RE.match(p.rstrip("/").rsplit("/", 1)[-1])
            if m:
                out.append((int(m.group(1)), bool(m.group(2)), p.rstrip("/")))
        return sorted(out)

    def committed_steps(self) -> list[int]:
        """Steps of every complete (committed) checkpoint, ascending."""
        return [s for s, staging, p in self._entries()
                if not staging and self.fs.exists(f"{p}/{COMMITTED}")]

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.committed_steps()
        return steps[-1] if steps else None

    # -- writing -------------------------------------------------------------------------
    def write_bytes(self, path: str, data: bytes) -> None:
        """Write a small object so that readers see all of it or nothing: locally under a
        temporary name in the same directory, then an atomic rename (a plain write creates
        the file empty first, and a poller would read it so); on object stores one PUT."""
        try:
            if not self.local:
                self.fs.pipe_file(path, data)
                return
            tmp = f"{path}.{uuid.uuid4().hex}{PARTIAL}"
            try:
                self.fs.pipe_file(tmp, data)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.remove(tmp)
                raise
        except Exception as e:
            raise self.error(f"write {path.rsplit('/', 2)[-2:]}", e) from None

    def clean_incomplete(self, below: int | None = None) -> list[str]:
        """Delete incomplete step directories (all, or those older than step ``below``);
        call only when no save is in progress for them. Returns what was removed."""
        removed = []
        committed = set(self.committed_steps())
        for step, staging, p in self._entries():
            if (staging or step not in committed) and (below is None or step < below):
                self.fs.rm(p, recursive=True)
                removed.append(p)
        return removed

    def wait_for_json(self, paths: list[str], timeout: float, what: str) -> list[dict]:
        """Poll until every path holds a complete JSON object (the other ranks' manifests);
        returns them in order. A file that exists but does not parse yet (a writer without
        atomic rename, in the middle of its write) counts as not there yet."""
        deadline = time.monotonic() + timeout
        found: dict[str, dict] = {}
        while True:
            for p in paths:
                if p not in found and (doc := self._read_json(p)) is not None:
                    found[p] = doc
            pending = [p for p in paths if p not in found]
            if not pending:
                return [found[p] for p in paths]
            if time.monotonic() >= deadline:
                first = pending[0]
                state = "present but incomplete (not valid JSON)" if self.fs.exists(first) \
                    else "missing"
                raise CheckpointStorageError(
                    f"{what}: {len(pending)} rank(s) did not finish within {timeout:.0f} s "
                    f"(first: {first.rsplit('/', 1)[-1]}, {state}); the checkpoint stays "
                    "unpublished")
            time.sleep(POLL_S)

    def _read_json(self, path: str) -> dict | None:
        """The JSON object at ``path``; None while it is missing, empty or partial."""
        try:
            data = self.fs.cat_file(path)
        except FileNotFoundError:
            return None
        except Exception as e:
            raise self.error(f"read {path.rsplit('/', 2)[-2:]}", e) from None
        try:
            doc = json.loads(data)
        except ValueError:  # empty or cut short (JSONDecodeError, UnicodeDecodeError)
            return None
        return doc if isinstance(doc, dict) else None

    def publish(self, step: int, manifest: bytes) -> str:
        """Write the merged manifest, move staging to final (local), then the commit marker."""
        staging, final = self.staging(step), self.final(step)
        self.write_bytes(f"{staging}/{MANIFEST}", manifest)
        if self.local and staging != final:
            if self.fs.exists(final):
                self.fs.rm(final, recursive=True)
            os.replace(staging, final)
        self.write_bytes(f"{final}/{COMMITTED}", str(step).encode())
        self.write_bytes(self.path(LATEST), step_dir(step).encode())
        return final

    def retain(self, keep: int) -> list[int]:
        """Delete all but the newest ``keep`` committed checkpoints (marker first) and the
        incomplete ones older than the newest committed; returns the deleted steps."""
        steps = self.committed_steps()
        drop = steps[:-keep] if keep > 0 else []
        for s in drop:
            p = self.final(s)
            self.fs.rm_file(f"{p}/{COMMITTED}")
            self.fs.rm(p, recursive=True)
        if steps:
            self.clean_incomplete(below=steps[-1])
        return drop
