"""The compiled ops a run needs, built once per environment, and no launch left waiting
on a build in silence.

DeepSpeed builds its ops on first use (on the CPU accelerator: FusedAdam and the
shared-memory all-reduce; elsewhere whatever a config's optimizer needs) with
torch.utils.cpp_extension, as ds_ext/comm/kernels.py builds seekspeed's own. torch
guards a build with a ``lock`` file in the build directory and waits, without limit
and without a word, for it to disappear; a process killed during the build (a job
preempted on a new node, a kill test that started early) leaves it behind, and every
later launch of that user waits forever.

- ``use_environment_root()``: builds go under ``TORCH_EXTENSIONS_DIR`` when it is set,
  else, inside a virtual environment, under ``<venv>/torch_extensions`` (the build is
  of that environment's torch and DeepSpeed, so two environments never share one);
  otherwise under torch's default, ``~/.cache/torch_extensions``.
- ``build_guard(name)``: held around every load that may build. It takes an flock on
  ``<build dir>.seekspeed-lock`` (the kernel releases it when its holder dies; on a
  shared file system every node that locks it sees it), waiting with a progress line
  (after ``FIRST_LINE_S``, then every ``WAIT_LINE_S``) while a live build holds it. Holding it, a torch ``lock`` that
  no process on this machine has held open for ``UNHELD_S`` is a dead build's: it is
  removed with one line saying so, and the build runs again (ninja rebuilds what the dead one left half
  done). A ``lock`` that a process here holds open (a build outside seekspeed) is
  waited for, with the same progress line.
- ``load_deepspeed_ops(names)``: DeepSpeed's op builders by class name, each loaded
  under the guard, saying so when it has to build.

``python launch/build_ops.py`` builds every op a run can need (launch/setup_env.sh runs it
once when it makes the environment), so a launch finds them built.
"""

import contextlib
import fcntl
import os
import socket
import sys
import time

WAIT_LINE_S = 15.0
# ranks of a node load the same built op one after another, each for a moment: a wait says
# so only once it has lasted this long
FIRST_LINE_S = 2.0
POLL_S = 0.05
# a lock nobody holds must stay so this long before it is taken for a dead build's: torch's
# FileBaton closes the file, then removes it, and a removal between the two would fail its build
UNHELD_S = 1.0
LOCK_SUFFIX = ".seekspeed-lock"


def _stderr(message):
    print(message, file=sys.stderr, flush=True)


def environment_root():
    """Where this environment's builds go when TORCH_EXTENSIONS_DIR is not set: inside
    the virtual environment, or None outside one (torch's default then)."""
    if sys.prefix != sys.base_prefix:
        return os.path.join(sys.prefix, "torch_extensions")
    return None


def use_environment_root():
    """Point torch (and so DeepSpeed) at this environment's build directory unless
    TORCH_EXTENSIONS_DIR already says where. Returns the root in use (None: torch's
    default)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    root = environment_root()
    if root is not None:
        try:
            os.makedirs(root, exist_ok=True)
        except OSError:            # a read-only environment: torch's default then
            return None
        os.environ["TORCH_EXTENSIONS_DIR"] = root
    return root


def build_directory(name):
    """torch's build directory for extension ``name`` (it creates it)."""
    from torch.utils.cpp_extension import _get_build_directory
    return _get_build_directory(name, verbose=False)


def _holders(path):
    """Processes on this machine (that this one may look at) holding ``path`` open."""
    target = os.path.realpath(path)
    found = []
    try:
        pids = os.listdir("/proc")
    except OSError:               # no /proc to look at: nothing seen holds it
        return found
    for pid in pids:
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        fd_dir = f"/proc/{pid}/fd"
        try:
            for fd in os.listdir(fd_dir):
                try:
                    if os.readlink(os.path.join(fd_dir, fd)) == target:
                        found.append(int(pid))
                        break
                except OSError:
                    continue
        except OSError:
            continue
    return found


class _Waiting:
    """A progress line once a wait has lasted FIRST_LINE_S, then every WAIT_LINE_S."""

    def __init__(self, what, log):
        self.what, self.log = what, log
        self.began = time.monotonic()
        self.next_line = self.began + FIRST_LINE_S

    def tick(self, detail=""):
        now = time.monotonic()
        if now >= self.next_line:
            self.log(f"ops: waiting for {self.what}{detail}, {now - self.began:.0f} s so far")
            self.next_line = now + WAIT_LINE_S


def _owner(fd):
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        return ""
    return f" ({text})" if text else ""


def _lock(fd, name, path, log):
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    waiting = _Waiting(f"the build of {name} by another process", log)
    while True:
        waiting.tick(_owner(fd) + f"; it holds {path}")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(POLL_S)


def _clear_dead_build(baton, name, log):
    """torch's lock ``baton``: removed when no process here holds it (its build died),
    waited for while one does."""
    waiting, unheld_since = None, None
    while os.path.exists(baton):
        holders = _holders(baton)
        if not holders:
            unheld_since = unheld_since or time.monotonic()
            if time.monotonic() - unheld_since < UNHELD_S:
                time.sleep(POLL_S)
                continue
            try:
                os.remove(baton)
                log(f"ops: removed {baton}, left by a build of {name} that was killed (no process holds it); "
                    f"building {name} again")
            except FileNotFoundError:
                pass
            return
        unheld_since = None
        waiting = waiting or _Waiting(f"the build of {name} by process {', '.join(map(str, holders))}", log)
        waiting.tick(f" (torch's lock {baton})")
        time.sleep(POLL_S)


@contextlib.contextmanager
def build_guard(name, *, log=_stderr):
    """Exclusive right to build (or load) extension ``name``: see the module docstring."""
    directory = build_directory(name)
    path = directory.rstrip("/") + LOCK_SUFFIX
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _lock(fd, name, path, log)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        _clear_dead_build(os.path.join(directory, "lock"), name, log)
        yield directory
    finally:
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        os.close(fd)          # releases the flock


def is_built(name):
    """Whether extension ``name`` has a built library in its build directory."""
    return os.path.exists(os.path.join(build_directory(name), f"{name}.so"))


def _preinstalled(builder):
    """DeepSpeed installed with the op built in (DS_BUILD_OPS=1): it imports it, as
    OpBuilder.load decides, and builds nothing."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops
    return bool(installed_ops.get(builder.name, False)) and accelerator_name == get_accelerator()._name


def load_deepspeed_ops(names, *, log=_stderr):
    """Load DeepSpeed's op builders ``names`` (class names such as "FusedAdamBuilder")
    for this accelerator, each under ``build_guard``; returns the modules."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder.builder import OpBuilder
    modules = []
    for builder_name in names:
        builder = get_accelerator().create_op_builder(builder_name)
        if builder is None:
            raise RuntimeError(f"DeepSpeed has no {builder_name} for the {get_accelerator().device_name()} "
                               f"accelerator")
        if builder.name in OpBuilder._loaded_ops or _preinstalled(builder):
            modules.append(builder.load(verbose=False))        # loaded, or compiled into DeepSpeed's wheel
            continue
        with build_guard(builder.name, log=log) as directory:
            began = time.monotonic()
            building = not is_built(builder.name)
            if building:
                log(f"ops: building DeepSpeed's {builder.name} op in {directory} (once per environment; about a "
                    f"minute)")
            modules.append(builder.load(verbose=False))
            if building:
                log(f"ops: {builder.name} built in {time.monotonic() - began:.0f} s")
    return modules


def run_ops(compiled_ops):
    """The DeepSpeed op builders a run loads on this accelerator: the shared-memory
    all-reduce DeepSpeed's CPU backend starts with, and those its optimizer needs
    (``compiled_ops``, from the config check)."""
    from deepspeed.accelerator import get_accelerator
    cpu = get_accelerator().device_name() == "cpu"
    return (("ShareMemCommBuilder",) if cpu else ()) + tuple(n for n in compiled_ops if n != "ShareMemCommBuilder")
