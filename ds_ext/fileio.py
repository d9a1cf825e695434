"""Writing a file so that readers see the old one or the new one, never a part of it.

    with atomic_open(path, "w", newline="") as f:     # a stream (csv, a figure, a copy)
        writer = csv.writer(f)
        ...
    atomic_write(path, data)                          # bytes or str at once

The data goes to a temporary file beside ``path`` (same directory, so the rename
never crosses a file system), which replaces ``path`` by rename when the block ends
without an error, and is removed when it raises. The new file gets the permissions a
plain ``open`` gives (0666 less the umask), not ``mkstemp``'s 0600.

Durability is the caller's choice: ``fsync=True`` flushes the contents to disk before
the rename (after a crash: the old file or the whole new one, never an empty one);
``fsync_dir=True`` also fsyncs the directory after it, so the rename itself survives a
crash (what a checkpoint's ``latest`` and manifest need).
"""

import contextlib
import os
import secrets

_MODES = ("w", "wb")


def fsync_directory(path):
    """fsync the directory ``path``: the renames and new names in it reach the disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create_beside(path):
    directory, name = os.path.split(os.path.abspath(path))
    while True:
        tmp = os.path.join(directory, f".{name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), tmp
        except FileExistsError:
            continue


@contextlib.contextmanager
def atomic_open(path, mode="w", *, fsync=False, fsync_dir=False, **open_kwargs):
    """A file object open for writing (``mode`` "w" or "wb"; ``open_kwargs`` as
    ``open``'s: encoding, newline, ...) whose contents replace ``path`` when the
    block ends without an error; see the module docstring for ``fsync`` and
    ``fsync_dir``."""
    if mode not in _MODES:
        raise ValueError(f"atomic_open writes a whole new file: mode must be one of {_MODES}, got {mode!r}")
    path = os.fspath(path)
    fd, tmp = _create_beside(path)
    try:
        f = os.fdopen(fd, mode, **open_kwargs)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    try:
        with f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if fsync_dir:
        fsync_directory(os.path.dirname(os.path.abspath(path)))


def atomic_write(path, data, *, fsync=False, fsync_dir=False):
    """Replace ``path`` with ``data`` (bytes, or str written as text, as ``open(path, "w")``
    would) atomically."""
    binary = isinstance(data, (bytes, bytearray, memoryview))
    with atomic_open(path, "wb" if binary else "w", fsync=fsync, fsync_dir=fsync_dir) as f:
        f.write(data)
