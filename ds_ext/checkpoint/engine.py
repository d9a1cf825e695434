"""An asynchronous zstd CheckpointEngine for DeepSpeed, DeepSpeed's own torch.save
engine with restricted loading, and the engine mixin that drives them.

DeepSpeed calls ``create``, ``makedirs`` and ``save`` (once per file) from
``engine.save_checkpoint`` and ``load`` from ``engine.load_checkpoint``; this engine
takes a snapshot of each state dict on the training thread and leaves serialising,
compressing, writing and fsync to a background thread. It reports itself as
*decoupled* so that DeepSpeed does not write ``latest`` itself: the checkpoint becomes
visible only when every rank has written and fsynced its files into the staging
directory, which ranks learn from a small all-reduce made after each training step
while a save is in flight (``poll``); rank 0 then writes the manifest, renames the
staging directory into place and replaces ``latest`` atomically (see catalog.py).

At most one save is in flight per rank; when the next one is due, ``when_busy``
decides: ``wait`` for the previous one, or ``skip`` the new one. A failed write (disk
full, say) removes the staging directory on every rank and, per ``on_error``, stops
training with the error or logs it and goes on; the previous checkpoint is untouched.

Both engines load through load.py (seekspeed's and DeepSpeed's formats, unpickled with
safe_pickle's allow-list): ``RestrictedTorchCheckpointEngine`` is DeepSpeed's
TorchCheckpointEngine with that ``load``, installed for ``checkpoint.engine:
"deepspeed"``. Before DeepSpeed reads a checkpoint, rank 0 checks every file of it
(manifest, and the globals each names, statically) and every rank stops together with
its one-line error when one is refused, so no rank is left waiting in a collective.
"""

import os
import queue
import shutil
import sys
import threading
import time

import torch
import torch.distributed as tdist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from ds_ext.fileio import fsync_directory

from . import catalog, format as fmt, load as loader
from .load import CheckpointError

__all__ = ["AsyncCheckpointEngine", "AsyncCheckpointing", "CheckpointError", "RestrictedTorchCheckpointEngine",
           "install"]


class _Job:
    """One checkpoint as this rank sees it."""

    def __init__(self, *, save_dir, tag, step, update_latest):
        self.save_dir, self.tag, self.step, self.update_latest = save_dir, tag, step, update_latest
        self.final = os.path.join(save_dir, tag)
        self.staging = os.path.join(save_dir, catalog.STAGING + tag)
        self.files = {}                   # relative path -> {"size", "sha256", "raw_bytes"}
        self.error = None
        self.cancelled = False
        self.done = threading.Event()     # all of this rank's files written and fsynced (or failed)
        self.began = time.perf_counter()
        self.snapshot_s = 0.0
        self.write_s = 0.0
        self.raw_bytes = 0


class AsyncCheckpointEngine(CheckpointEngine):

    def __init__(self, section, *, group=None, log=print):
        super().__init__(None)
        self.name = "SeekspeedAsyncCheckpointEngine"
        self.section = section
        self.group = group
        self.rank = tdist.get_rank()
        self.world_size = tdist.get_world_size()
        self.log = log if self.rank == 0 else (lambda msg: None)
        self.history = []                 # one record per checkpoint: committed, skipped or failed
        self._job = None
        self._pool = fmt.BufferPool()
        self._queue = queue.Queue()
        self._thread = None
        self._manifests = {}
        self._verified = None             # a checkpoint directory whose every file resolve() has hashed

    # -- DeepSpeed's CheckpointEngine interface ------------------------------------------------

    def is_decoupled(self):
        return True       # DeepSpeed must not write 'latest'; the commit is ours

    def get_commit_info(self):
        return None       # nothing for DeepSpeedEngine.step to commit

    def preserves_storage_sharing(self):
        return False      # the snapshot copies each tensor (views are not cloned first)

    def create(self, info):
        job = self._job
        assert job is not None and job.tag == info.tag, \
            "AsyncCheckpointEngine: save through a seekspeed engine's save_checkpoint, which begins the save"

    def makedirs(self, path, exist_ok=False):
        # the checkpoint's own directory goes to staging; DeepSpeed also makes save_dir itself
        os.makedirs(self._staged(path) if self._inside(path) else path, exist_ok=True)

    def save(self, state_dict, path):
        job = self._job
        rel = os.path.relpath(self._staged(path), job.staging)
        start = time.perf_counter()
        snap = fmt.snapshot(state_dict, pool=self._pool, key=rel)
        job.snapshot_s += time.perf_counter() - start
        self._submit(self._write, job, rel, snap)

    def load(self, path, map_location=None):
        directory = os.path.dirname(os.path.abspath(path))
        return loader.load_file(path, map_location=map_location, manifest=self._manifest(directory),
                                verify="none" if directory == self._verified else "full")

    def commit(self, info):
        self.seal()
        return True

    def cleanup(self):
        # DeepSpeedEngine.destroy calls this, also from its __del__. At interpreter exit the daemon
        # writer thread runs no more, so waiting for it would block for ever (rank 0 of a run under
        # the deepspeed launcher never exited); the trainer has waited for every save by then
        if sys.is_finalizing():
            return
        self.wait()

    # -- seekspeed's side: collective calls, every rank in the same order ------------------------

    @property
    def in_flight(self):
        return self._job is not None

    def begin(self, *, save_dir, tag, step, update_latest=True):
        """Start checkpoint ``tag``. Settles a save still in flight per ``when_busy``;
        False when this checkpoint is skipped."""
        if self._job is not None:
            previous = self._job.tag
            if self.section.when_busy == "skip":
                self.poll()
                if self._job is not None:
                    self.log(f"checkpoint {tag} skipped: {previous} is still being written "
                             f"(checkpoint.when_busy = skip)")
                    self.history.append({"tag": tag, "status": "skipped", "step": step})
                    return False
            else:
                start = time.perf_counter()
                self.wait()
                self.log(f"checkpoint {tag}: waited {time.perf_counter() - start:.2f} s for {previous} to finish "
                         f"writing (checkpoint.when_busy = wait)")
        job = _Job(save_dir=save_dir, tag=tag, step=step, update_latest=update_latest)
        error = None
        if self.rank == 0:
            try:
                os.makedirs(save_dir, exist_ok=True)
                catalog.clean_stale(save_dir)
                os.makedirs(job.staging)
            except OSError as exc:
                error = f"cannot create {job.staging}: {exc}"
        error = self._from_rank0(error)
        if error is not None:
            raise CheckpointError(f"checkpoint {tag}: {error}; check seekspeed.checkpoint.dir")
        self._job = job
        return True

    def seal(self):
        """Every file of the current checkpoint has been handed over."""
        if self._job is not None:
            self._submit(self._finish, self._job)

    def fail(self, error):
        """The current checkpoint cannot be completed on this rank (the next poll removes it)."""
        if self._job is not None and self._job.error is None:
            self._job.error = error

    def poll(self, *, block=False):
        """One round of agreement on the save in flight (an all-reduce of two ints):
        commit it when every rank has written its files, remove it everywhere when any
        rank failed. ``block``: wait for this rank's writes first, so the round
        settles it."""
        job = self._job
        if job is None:
            return
        if block:
            job.done.wait()
        # "done" before "error": the writer sets the error first, so a done rank's error is already visible
        done = job.done.is_set()
        flags = torch.tensor([job.error is not None, not done], dtype=torch.int64)
        tdist.all_reduce(flags, op=tdist.ReduceOp.MAX, group=self.group)
        failed, writing = flags.tolist()
        if failed:
            return self._abort(job)
        if writing:
            return
        parts = self._gather({"files": job.files, "snapshot_s": job.snapshot_s, "write_s": job.write_s})
        error, record = None, None
        if self.rank == 0:
            files = {}
            for part in parts:
                files.update(part["files"])
            manifest = {"format": catalog.FORMAT_NAME, "version": 1, "tag": job.tag, "global_step": job.step,
                        "world_size": self.world_size, "committed_at": time.time(),
                        "compression": self.section.compression, "zstd_level": self.section.zstd_level,
                        "byte_group": self.section.byte_group,
                        "files": {rel: {"size": f["size"], "sha256": f["sha256"]} for rel, f in files.items()}}
            try:
                catalog.publish(job.staging, save_dir=job.save_dir, tag=job.tag, manifest=manifest,
                                update_latest=job.update_latest)
            except catalog.LatestNotUpdated as exc:      # committed; only the pointer is stale
                self.log(f"warning: checkpoint {job.tag} is committed but {exc}; resume finds it anyway")
            except OSError as exc:
                error = f"cannot commit {job.final}: {exc}"
            record = {"tag": job.tag, "step": job.step, "path": job.final, "files": len(files),
                      "raw_bytes": sum(f["raw_bytes"] for f in files.values()),
                      "disk_bytes": sum(f["size"] for f in files.values()),
                      "snapshot_s": max(p["snapshot_s"] for p in parts), "write_s": max(p["write_s"] for p in parts),
                      "commit_after_s": time.perf_counter() - job.began}
        error, record = self._from_rank0((error, record))
        if error is not None:
            if self.rank == 0:
                self._remove(job.staging)
            return self._failed(job, error)
        self._job = None
        self.history.append(record | {"status": "committed"})
        self.log(f"checkpoint {job.tag} committed {record['commit_after_s']:.2f} s after it began: "
                 f"{record['files']} files, {record['raw_bytes'] / 1e6:,.1f} MB -> {record['disk_bytes'] / 1e6:,.1f} MB "
                 f"on disk ({self._codec()}); training blocked {record['snapshot_s']:.3f} s for the snapshot")
        if self.rank == 0:
            for old in catalog.expired(job.save_dir, keep_last=self.section.keep_last):
                if old.tag != job.tag:
                    self._submit(self._retire, old.path)

    def wait(self):
        """Block until the save in flight is committed or has failed (collective)."""
        while self._job is not None:
            self.poll(block=True)
        if self._thread is not None:          # and for retention's deletions
            drained = threading.Event()
            self._queue.put((drained.set, ()))
            drained.wait()

    def committed(self):
        return [h for h in self.history if h["status"] == "committed"]

    # -- internals ----------------------------------------------------------------------------

    def _codec(self):
        s = self.section
        if s.compression == "none":
            return "uncompressed"
        return f"zstd {s.zstd_level}" + (", byte-grouped" if s.byte_group else "")

    def _inside(self, path):
        """``path`` is the current checkpoint's directory or lies inside it."""
        job = self._job
        return job is not None and (os.path.abspath(path) + os.sep).startswith(os.path.abspath(job.final) + os.sep)

    def _staged(self, path):
        job = self._job
        if not self._inside(path):
            raise CheckpointError(f"checkpoint {job.tag}: DeepSpeed wrote {os.path.abspath(path)} outside the "
                                  f"checkpoint's directory {os.path.abspath(job.final)}; this engine only stages "
                                  f"files inside it")
        return os.path.join(os.path.abspath(job.staging), os.path.relpath(os.path.abspath(path),
                                                                          os.path.abspath(job.final)))

    def _submit(self, fn, *args):
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="seekspeed-checkpoint-writer", daemon=True)
            self._thread.start()
        self._queue.put((fn, args))

    def _run(self):
        while True:
            fn, args = self._queue.get()
            try:
                fn(*args)
            except Exception as exc:          # the writer must outlive any one task, or wait() would hang
                job = next((a for a in args if isinstance(a, _Job)), None)
                if job is not None and job.error is None:
                    job.error = f"rank {self.rank}: {type(exc).__name__}: {exc}"
                if job is not None and fn == self._finish:
                    job.done.set()

    def _write(self, job, rel, snap):
        if job.error is not None or job.cancelled:
            return
        path = os.path.join(job.staging, rel)
        start = time.perf_counter()
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            size, sha = fmt.write(path, snap, codec=self.section.compression, level=self.section.zstd_level,
                                  threads=self.section.zstd_threads, byte_group=self.section.byte_group)
            job.files[rel] = {"size": size, "sha256": sha, "raw_bytes": snap.nbytes}
        except Exception as exc:
            job.error = f"rank {self.rank} writing {path}: {exc}"
            try:
                os.unlink(path)
            except OSError:
                pass
        job.write_s += time.perf_counter() - start

    def _finish(self, job):
        try:
            if job.error is None and not job.cancelled:
                for root, _, _ in os.walk(job.staging):
                    fsync_directory(root)
        except OSError as exc:
            job.error = f"rank {self.rank} syncing {job.staging}: {exc}"
        job.done.set()

    def _retire(self, path):
        try:
            catalog.remove(path)
            self.log(f"checkpoint {os.path.basename(path)} removed (checkpoint.keep_last = {self.section.keep_last})")
        except OSError as exc:
            self.log(f"warning: could not remove old checkpoint {path}: {exc}")

    def _abort(self, job):
        job.cancelled = True
        job.done.wait()                   # this rank's writer is off the staging directory
        errors = [e for e in self._gather(job.error) if e is not None]
        tdist.barrier(group=self.group)   # every writer is
        if self.rank == 0:
            self._remove(job.staging)
        return self._failed(job, "; ".join(errors))

    def _remove(self, path):
        shutil.rmtree(path, ignore_errors=True)

    def _failed(self, job, error):
        self._job = None
        self.history.append({"tag": job.tag, "step": job.step, "status": "failed", "error": error})
        previous = catalog.read_latest(job.save_dir)
        kept = f"the previous checkpoint ({previous}) is intact" if previous else "no earlier checkpoint exists"
        message = f"checkpoint {job.tag} failed and was removed ({error}); {kept}"
        if self.section.on_error == "stop":
            raise CheckpointError(f"{message}; free space or fix the path, then resume "
                                  f"(or set checkpoint.on_error to \"continue\")")
        self.log(f"warning: {message}; training goes on (checkpoint.on_error = continue)")

    def _gather(self, obj):
        out = [None] * self.world_size
        tdist.all_gather_object(out, obj, group=self.group)
        return out

    def _from_rank0(self, obj):
        box = [obj]
        tdist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _manifest(self, directory):
        if directory not in self._manifests:
            try:
                self._manifests[directory] = catalog.read_manifest(directory)
            except fmt.CorruptCheckpointError as exc:
                raise CheckpointError(str(exc)) from None
        return self._manifests[directory]

    def resolve(self, load_dir):
        """The tag every rank loads: the newest checkpoint in ``load_dir`` that verifies
        (rank 0 checks, every rank gets its answer); None when there is none."""
        ckpt = None
        full = self.section.verify == "full"
        if self.rank == 0:
            ckpt = catalog.newest_complete(load_dir, full=full, log=self.log)
        tag = self._from_rank0(None if ckpt is None else ckpt.tag)
        self._manifests.clear()
        # rank 0 just hashed every file of it: load() need not read them twice there
        self._verified = os.path.abspath(ckpt.path) if ckpt is not None and full else None
        return tag


class RestrictedTorchCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch.save engine (``checkpoint.engine: "deepspeed"``) whose ``load``
    goes through load.py: DeepSpeed's own loads the file with
    torch.load(weights_only=False), which runs whatever code a crafted file names."""

    def __init__(self, config_params=None, *, group=None):
        super().__init__(config_params)
        self.name = "SeekspeedRestrictedTorchCheckpointEngine"
        self.group = group

    def load(self, path, map_location=None):
        return loader.load_file(path, map_location=map_location)


def check_before_load(load_dir, tag, *, group, every_node=False):
    """Rank 0 (``every_node``: each node's local rank 0, for node-local checkpoint
    storage) checks every file of checkpoint ``tag``: manifest sizes, the globals each
    names. Every rank raises the first CheckpointError (or UnsafeCheckpointError)
    found, together (collective)."""
    error = None
    if tdist.get_rank() == 0 or (every_node and int(os.environ.get("LOCAL_RANK", "0")) == 0):
        try:
            loader.open_tag(load_dir, tag).check()
        except CheckpointError as exc:
            error = exc
    errors = [None] * tdist.get_world_size(group=group)
    tdist.all_gather_object(errors, error, group=group)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


class AsyncCheckpointing:
    """Engine mixin: ``save_checkpoint`` and ``load_checkpoint`` as DeepSpeed's, plus
    the begin/seal/poll calls the asynchronous engine needs and the check before a
    load."""

    def _async_checkpoints(self):
        engine = getattr(self, "checkpoint_engine", None)
        return engine if isinstance(engine, AsyncCheckpointEngine) else None

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        client_state = {} if client_state is None else client_state     # DeepSpeed's default, not shared
        ckpt = self._async_checkpoints()
        if ckpt is None:
            return self._save_then_point_latest(save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
                                                exclude_frozen_parameters=exclude_frozen_parameters)
        if not save_dir:
            raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        if not ckpt.begin(save_dir=save_dir, tag=tag, step=self.global_steps, update_latest=save_latest):
            return False
        try:
            super().save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
                                    exclude_frozen_parameters=exclude_frozen_parameters)
        except BaseException as exc:
            ckpt.fail(f"rank {ckpt.rank}: {type(exc).__name__}: {exc}")
            raise
        finally:
            ckpt.seal()
        return True

    def _save_then_point_latest(self, save_dir, *, tag, client_state, save_latest, exclude_frozen_parameters):
        """DeepSpeed's own save, with ``latest`` written by this engine: DeepSpeed's rank 0
        writes it right after its own files, before the barrier that waits for the other
        ranks' (a rank killed while still writing would leave ``latest`` naming a torn
        checkpoint), and truncates it in place (a kill there leaves it empty). Here rank 0
        replaces it atomically once DeepSpeed's closing barrier has seen every rank's files
        written, so ``latest`` only ever names a complete checkpoint."""
        saved = super().save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False,
                                        exclude_frozen_parameters=exclude_frozen_parameters)
        if save_latest and self.global_rank == 0:
            tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
            catalog.write_atomic(os.path.join(save_dir, catalog.LATEST), tag.encode())
        return saved

    def load_checkpoint(self, load_dir, tag=None, *args, **kwargs):
        ckpt = getattr(self, "checkpoint_engine", None)
        if isinstance(ckpt, AsyncCheckpointEngine):
            ckpt.wait()
            if tag is None:
                tag = ckpt.resolve(load_dir)
                if tag is None:
                    return None, None
        elif isinstance(ckpt, RestrictedTorchCheckpointEngine) and tag is None:
            tag = catalog.read_latest(load_dir)       # as DeepSpeed reads it
            if tag is None:
                return super().load_checkpoint(load_dir, None, *args, **kwargs)   # DeepSpeed's warning, (None, None)
        if isinstance(ckpt, (AsyncCheckpointEngine, RestrictedTorchCheckpointEngine)):
            check_before_load(load_dir, tag, group=ckpt.group, every_node=self.use_node_local_storage())
        if self._bf16_optimizer_without_zero() and kwargs.get("load_optimizer_states", True) \
                and not kwargs.get("load_module_only", False):
            return self._load_bf16_without_zero(load_dir, tag, *args, **kwargs)
        return super().load_checkpoint(load_dir, tag, *args, **kwargs)

    def _bf16_optimizer_without_zero(self):
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
        return isinstance(self.optimizer, BF16_Optimizer) and not self.zero_optimization()

    def _load_bf16_without_zero(self, load_dir, tag, *args, **kwargs):
        """DeepSpeed 0.19.8 builds its BF16 optimizer for a bf16 pipeline under ZeRO stage 0
        and saves its state per data-parallel rank (bf16_zero_pp_rank_*), as under ZeRO 1,
        but loads it only when ZeRO is on: otherwise it hands the model file's single state
        dict to BF16_Optimizer.load_state_dict, which indexes it by rank (KeyError: 0), so
        no such run could resume. Here the engine loads everything but the optimizer, then
        the optimizer from those files, as DeepSpeed does under ZeRO 1."""
        load_path, client_states = super().load_checkpoint(load_dir, tag, *args,
                                                           **(kwargs | {"load_optimizer_states": False}))
        if load_path is not None and not self._load_zero_checkpoint(load_dir, tag, load_optimizer_states=True):
            raise CheckpointError(f"{os.path.join(load_dir, tag)}: DeepSpeed's BF16 optimizer state "
                                  f"(bf16_zero_pp_rank_*_optim_states.pt) is missing; resume from a checkpoint "
                                  f"that has it, or start a new run")
        return load_path, client_states

    def train_batch(self, *args, **kwargs):
        loss = super().train_batch(*args, **kwargs)
        ckpt = self._async_checkpoints()
        if ckpt is not None and ckpt.in_flight:
            ckpt.poll()
        return loss


def install(engine, section, *, log=print):
    """Give ``engine`` the checkpoint engine ``section`` (a ``seekspeed.checkpoint``
    section) names. Collective (creates a gloo group)."""
    if engine.load_universal_checkpoint():
        # base_optimizer.load_hp_checkpoint_state_from_checkpoint_dir and checkpoint/universal_checkpoint.py
        # read a universal checkpoint with torch.load(weights_only=False), past any checkpoint engine
        raise CheckpointError("DeepSpeed's checkpoint.load_universal reads files with torch.load(weights_only=False) "
                              "outside the checkpoint engine, so a crafted file would run code: remove "
                              "checkpoint.load_universal from the DeepSpeed config")
    if section.engine == "deepspeed":
        current = engine.checkpoint_engine
        if type(current) is not TorchCheckpointEngine:
            raise CheckpointError(f"DeepSpeed chose its {type(current).__name__} from the config's checkpoint section "
                                  f"(writer or datastates), which loads files with torch.load(weights_only=False): "
                                  f"remove those keys, or set seekspeed.checkpoint.engine to \"async-zstd\"")
        group = tdist.new_group(backend="gloo")
        engine.checkpoint_engine = RestrictedTorchCheckpointEngine(engine._config, group=group)
        return engine.checkpoint_engine
    if engine.use_node_local_storage():
        raise CheckpointError("seekspeed.checkpoint.engine async-zstd commits through one directory that every "
                              "rank sees; turn off DeepSpeed's checkpoint.use_node_local_storage or use engine "
                              "\"deepspeed\"")
    group = tdist.new_group(backend="gloo")
    engine.checkpoint_engine = AsyncCheckpointEngine(section, group=group, log=log)
    return engine.checkpoint_engine
