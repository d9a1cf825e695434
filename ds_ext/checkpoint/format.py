"""seekspeed's checkpoint file: a snapshot taken on the training thread, written later.

A file is an uncompressed header followed by one zstd frame (or raw bytes)::

    b"SSCKPT01" | u32 header length | header (JSON: codec, tensor table, skeleton size)
    frame: skeleton pickle | tensor 0 bytes | tensor 1 bytes | ...

The skeleton is the state dict pickled with every tensor replaced by its index in the
table, so Python objects (optimizer hyper-parameters, the DeepSpeed config, client
state) are frozen at snapshot time like the tensors. With ``byte_group`` the bytes of a
floating tensor are regrouped before compression, byte 0 of every element, then byte
1, ... (within runs of ``GROUP_ELEMENTS`` elements): the sign/exponent bytes, which
vary little, end up next to each other, which is what zstd compresses well (ZipNN).
"""

import contextlib
import hashlib
import io
import json
import os
import pickle
import struct

import numpy as np
import torch

from . import safe_pickle

MAGIC = b"SSCKPT01"
GROUP_ELEMENTS = 1 << 22          # byte-grouping runs: 4M elements (16 MB of fp32) at a time
_IO_CHUNK = 16 << 20
_GROUPABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class CorruptCheckpointError(OSError):
    """A checkpoint file does not match its manifest or cannot be decoded."""


class Snapshot:
    """``skeleton`` (pickle bytes) and the CPU copies of the tensors it refers to."""

    def __init__(self, skeleton, tensors, table):
        self.skeleton, self.tensors, self.table = skeleton, tensors, table

    @property
    def nbytes(self):
        return len(self.skeleton) + sum(t.numel() * t.element_size() for t in self.tensors)


class _Pickler(pickle.Pickler):

    def __init__(self, file, take):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._take = take

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor):
            return ("tensor", self._take(obj))
        return None


class BufferPool:
    """The previous snapshot's copies, reused when the next one has the same tensors
    (same file, position, shape and dtype): no fresh allocation (page faults, or pinned
    memory registration on CUDA) on every save."""

    def __init__(self):
        self._buffers = {}

    def get(self, key, like):
        buf = self._buffers.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            pin = like.is_cuda
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buf
        return buf


def snapshot(state, *, pool=None, key=""):
    """Copy every tensor of ``state`` to CPU memory now (``pool`` buffers when given) and
    pickle the rest; the result no longer changes when training goes on."""
    tensors, table, index_of = [], [], {}
    keep_alive = []
    copies_on_device = False

    def take(t):
        idx = index_of.get(id(t))
        if idx is not None:
            return idx
        keep_alive.append(t)
        src = t.detach()
        if pool is not None:
            buf = pool.get((key, len(tensors)), src)
        else:
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu")
        nonlocal copies_on_device
        if src.device.type != "cpu":
            buf.copy_(src, non_blocking=buf.is_pinned())
            copies_on_device = True
        else:
            buf.copy_(src)
        idx = len(tensors)
        index_of[id(t)] = idx
        tensors.append(buf)
        table.append({"dtype": str(src.dtype).removeprefix("torch."), "shape": list(src.shape),
                      "param": isinstance(t, torch.nn.Parameter), "requires_grad": bool(t.requires_grad)})
        return idx

    out = io.BytesIO()
    _Pickler(out, take).dump(state)
    if copies_on_device:
        torch.cuda.synchronize()
    return Snapshot(out.getvalue(), tensors, table)


class _HashingWriter:

    def __init__(self, raw):
        self.raw, self.sha, self.size = raw, hashlib.sha256(), 0

    def write(self, data):
        self.sha.update(data)
        self.size += memoryview(data).nbytes
        return self.raw.write(data)

    def flush(self):
        self.raw.flush()


def _byte_view(t):
    return t.reshape(-1).view(torch.uint8)


def _grouped(t):
    return t.dtype in _GROUPABLE


def _iter_payload(t, byte_group):
    """Byte chunks of tensor ``t`` as stored (regrouped when ``byte_group``)."""
    size = t.element_size()
    flat = _byte_view(t)
    if not (byte_group and _grouped(t)):
        step = _IO_CHUNK
        for i in range(0, flat.numel(), step):
            yield flat[i:i + step].numpy()
        return
    run = GROUP_ELEMENTS * size
    raw = flat.numpy()
    for i in range(0, raw.size, run):       # numpy's transposing copy is ~7x torch's for uint8 here
        yield np.ascontiguousarray(raw[i:i + run].reshape(-1, size).T)


def write(path, snap, *, codec="zstd", level=3, threads=0, byte_group=True):
    """Write ``snap`` to ``path`` and fsync it. Returns (bytes on disk, sha256 hex)."""
    header = json.dumps({"codec": codec, "level": level, "byte_group": byte_group, "group_elements": GROUP_ELEMENTS,
                         "skeleton_bytes": len(snap.skeleton), "tensors": snap.table}).encode()
    with open(path, "wb") as raw:
        out = _HashingWriter(raw)
        out.write(MAGIC + struct.pack("<I", len(header)) + header)
        if codec == "zstd":
            import zstandard
            cctx = zstandard.ZstdCompressor(level=level, threads=threads, write_checksum=True)
            sink = cctx.stream_writer(out, closefd=False, write_size=_IO_CHUNK)
        else:
            sink = out
        sink.write(snap.skeleton)
        for t in snap.tensors:
            for chunk in _iter_payload(t, byte_group):
                sink.write(chunk)
        if sink is not out:
            sink.close()          # ends the frame; closefd=False leaves ``raw`` open
        raw.flush()
        os.fsync(raw.fileno())
    return out.size, out.sha.hexdigest()


def is_seekspeed_file(path):
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def file_sha256(path):
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_IO_CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def verify(path, *, size, sha256=None):
    """Raise CorruptCheckpointError naming ``path`` unless it has ``size`` bytes and
    (when given) the ``sha256`` digest the manifest recorded."""
    try:
        actual = os.path.getsize(path)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: missing (the manifest lists it)") from None
    if actual != size:
        raise CorruptCheckpointError(f"{path}: {actual:,} bytes, the manifest says {size:,} (truncated or "
                                     f"overwritten)")
    if sha256 is None:
        return
    digest = file_sha256(path)
    if digest != sha256:
        raise CorruptCheckpointError(f"{path}: checksum mismatch (sha256 {digest[:12]}..., manifest "
                                     f"{sha256[:12]}...): the file is corrupt")


def _read_exact(stream, view, path):
    got = 0
    while got < len(view):
        n = stream.readinto(view[got:])
        if not n:
            raise CorruptCheckpointError(f"{path}: ends early (truncated)")
        got += n


class _Unpickler(safe_pickle.Unpickler):
    """The skeleton's unpickler: tensors by index, globals only from safe_pickle.ALLOWED."""

    def __init__(self, file, tensors):
        super().__init__(file)
        self._tensors = tensors

    def persistent_load(self, pid):
        kind, idx = pid
        if kind != "tensor":
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        return self._tensors[idx]


def _open(raw, path, *, read_size=_IO_CHUNK):
    """(header, payload stream) of the file open as ``raw``."""
    if raw.read(len(MAGIC)) != MAGIC:
        raise CorruptCheckpointError(f"{path}: not a seekspeed checkpoint file")
    try:
        (hlen, ) = struct.unpack("<I", raw.read(4))
        header = json.loads(raw.read(hlen))
    except (struct.error, ValueError) as exc:
        raise CorruptCheckpointError(f"{path}: unreadable header ({exc})") from None
    if header["codec"] == "zstd":
        import zstandard
        return header, zstandard.ZstdDecompressor().stream_reader(raw, read_size=read_size)
    return header, raw


@contextlib.contextmanager
def _decoding(path):
    """Any failure while decoding becomes a CorruptCheckpointError naming ``path``."""
    try:
        yield
    except CorruptCheckpointError:
        raise
    except Exception as exc:
        raise CorruptCheckpointError(f"{path}: cannot be decoded ({type(exc).__name__}: {exc})") from None


def read_skeleton(path):
    """The skeleton pickle of ``path`` (bytes), read without its tensors (and without
    reading far past it: a check of many files reads little of each)."""
    with open(path, "rb") as raw:
        header, stream = _open(raw, path, read_size=1 << 16)
        with _decoding(path):
            skeleton = bytearray(header["skeleton_bytes"])
            _read_exact(stream, memoryview(skeleton), path)
    return bytes(skeleton)


def read(path, *, map_location=None):
    """The state dict stored in ``path`` (tensors on CPU, or moved to ``map_location``
    when it is a device or device string). The skeleton is unpickled with
    safe_pickle's allow-list: a global outside it raises safe_pickle.RefusedGlobal."""
    with open(path, "rb") as raw:
        header, stream = _open(raw, path)
        with _decoding(path):
            skeleton = bytearray(header["skeleton_bytes"])
            _read_exact(stream, memoryview(skeleton), path)
            tensors = [_read_tensor(stream, spec, header, path) for spec in header["tensors"]]
    device = map_location if isinstance(map_location, (str, torch.device)) else None
    if device is not None and torch.device(device).type != "cpu":
        tensors = [t.to(device) for t in tensors]
    return _Unpickler(io.BytesIO(skeleton), tensors).load()


def _read_tensor(stream, spec, header, path):
    dtype = getattr(torch, spec["dtype"])
    t = torch.empty(spec["shape"], dtype=dtype)
    flat = _byte_view(t)
    size = t.element_size()
    if header["byte_group"] and _grouped(t):
        run = header["group_elements"] * size
        raw = flat.numpy()
        scratch = np.empty(min(run, raw.size), dtype=np.uint8)
        for i in range(0, raw.size, run):
            n = min(run, raw.size - i)
            part = scratch[:n]
            _read_exact(stream, memoryview(part), path)
            raw[i:i + n].reshape(-1, size)[...] = part.reshape(size, -1).T
    else:
        _read_exact(stream, memoryview(flat.numpy()), path)
    if spec["param"]:
        return torch.nn.Parameter(t, requires_grad=spec["requires_grad"])
    return t.requires_grad_(spec["requires_grad"]) if t.is_floating_point() else t
