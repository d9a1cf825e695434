"""What lies in a checkpoint directory, and the file-system steps that make a
checkpoint appear whole or not at all.

    save_dir/
      latest                      tag of the newest committed checkpoint (replaced atomically)
      global_step200/             committed: manifest.json lists every file, size and sha256
      .staging-global_step300/    being written (or torn by a crash): never loaded
      .trash-global_step100/      being deleted by retention

A checkpoint becomes visible only by renaming its complete staging directory (every
rank's files fsynced, manifest written) to its tag; a crash at any moment leaves either
the old state or the new one. DeepSpeed's own checkpoints (no manifest) are read too:
the one its ``latest`` file names counts as complete, unverified.
"""

import dataclasses
import json
import os
import re
import shutil
import time

from ds_ext.fileio import atomic_write, fsync_directory

from .format import CorruptCheckpointError, verify

MANIFEST = "manifest.json"
LATEST = "latest"
STAGING = ".staging-"
TRASH = ".trash-"
FORMAT_NAME = "seekspeed-checkpoint"


@dataclasses.dataclass
class Checkpoint:
    tag: str
    path: str
    step: int | None
    manifest: dict | None      # None: DeepSpeed's own format (no manifest)

    @property
    def kind(self):
        return "seekspeed" if self.manifest is not None else "deepspeed"


def step_of(tag):
    m = re.fullmatch(r"global_step(\d+)", tag)
    return int(m.group(1)) if m else None


def write_atomic(path, data):
    """Write ``data`` (bytes) to ``path`` so that readers see the old file or the new
    one, never a mix, and the new one survives a crash: temporary file, fsync, rename,
    fsync of the directory. (One name for the manifest and ``latest`` writes, which
    tests/checkpoint_worker.py traces.)"""
    atomic_write(path, data, fsync=True, fsync_dir=True)


def read_manifest(directory):
    """The manifest in ``directory``; None when it has none; CorruptCheckpointError when
    it cannot be parsed."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"{path}: unreadable manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME or "files" not in manifest:
        raise CorruptCheckpointError(f"{path}: not a {FORMAT_NAME} manifest")
    return manifest


def read_latest(save_dir):
    try:
        with open(os.path.join(save_dir, LATEST)) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def list_checkpoints(save_dir):
    """Committed checkpoints in ``save_dir``, oldest first, and the reasons others were
    left out as ``(checkpoints, problems)``: a directory with an unreadable manifest is
    a problem; staging and trash directories are not checkpoints at all."""
    found, problems = [], []
    if not save_dir or not os.path.isdir(save_dir):
        return found, problems
    latest = read_latest(save_dir)
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name)
        if name.startswith(".") or not os.path.isdir(path):
            continue
        try:
            manifest = read_manifest(path)
        except CorruptCheckpointError as exc:
            problems.append(str(exc))
            continue
        if manifest is not None:
            found.append(Checkpoint(name, path, manifest.get("global_step", step_of(name)), manifest))
        elif name == latest:
            found.append(Checkpoint(name, path, step_of(name), None))
    found.sort(key=lambda c: (c.step if c.step is not None else -1, (c.manifest or {}).get("committed_at", 0)))
    return found, problems


def verify_checkpoint(ckpt, *, full=True):
    """Raise CorruptCheckpointError naming the first file that is missing, of the wrong
    size or (``full``) of the wrong checksum."""
    if ckpt.manifest is None:
        return
    for rel, entry in sorted(ckpt.manifest["files"].items()):
        verify(os.path.join(ckpt.path, rel), size=entry["size"], sha256=entry["sha256"] if full else None)


def newest_complete(save_dir, *, full=True, log=print):
    """The newest checkpoint in ``save_dir`` that verifies, or None. Every one that is
    passed over is reported through ``log`` with its reason."""
    found, problems = list_checkpoints(save_dir)
    for problem in problems:
        log(f"checkpoint skipped: {problem}")
    for ckpt in reversed(found):
        try:
            verify_checkpoint(ckpt, full=full)
        except CorruptCheckpointError as exc:
            log(f"checkpoint {ckpt.tag} skipped: {exc}")
            continue
        return ckpt
    return None


class LatestNotUpdated(OSError):
    """The checkpoint was committed (renamed into place) but ``latest`` could not be replaced."""


def publish(staging, *, save_dir, tag, manifest, update_latest=True):
    """Make ``staging`` (every file already fsynced) the committed checkpoint ``tag``:
    manifest, rename into place, then ``latest``. A committed checkpoint of the same
    tag is replaced (moved aside first, put back if the new one cannot take its place,
    deleted after). Raises LatestNotUpdated when only the last step failed."""
    write_atomic(os.path.join(staging, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True).encode())
    final = os.path.join(save_dir, tag)
    aside = None
    if os.path.exists(final):
        aside = os.path.join(save_dir, f"{TRASH}{tag}.{os.getpid()}.{time.monotonic_ns()}")
        os.rename(final, aside)
    try:
        os.rename(staging, final)
    except OSError:
        if aside is not None:
            os.rename(aside, final)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    try:
        fsync_directory(save_dir)
        if update_latest:
            write_atomic(os.path.join(save_dir, LATEST), tag.encode())
    except OSError as exc:
        raise LatestNotUpdated(f"'latest' was not updated ({exc})") from None
    return final


def remove(path):
    """Delete a checkpoint directory so that no half-deleted one is ever taken for a
    checkpoint: rename it out of sight first."""
    parent, name = os.path.split(path.rstrip("/"))
    aside = os.path.join(parent, f"{TRASH}{name}.{os.getpid()}.{time.monotonic_ns()}")
    os.rename(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def expired(save_dir, *, keep_last):
    """Committed seekspeed checkpoints beyond the newest ``keep_last`` (0 keeps all).
    The newest complete checkpoint is never among them; DeepSpeed's own are never
    touched."""
    if keep_last <= 0:
        return []
    ours = [c for c in list_checkpoints(save_dir)[0] if c.kind == "seekspeed"]
    return ours[:-keep_last] if len(ours) > keep_last else []


def clean_stale(save_dir, *, keep=()):
    """Remove staging and trash directories left by crashed runs (not those in ``keep``)."""
    removed = []
    if not os.path.isdir(save_dir):
        return removed
    for name in os.listdir(save_dir):
        path = os.path.join(save_dir, name)
        if (name.startswith(STAGING) or name.startswith(TRASH)) and name not in keep and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
    return removed
