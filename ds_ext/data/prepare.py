"""The packed cache built by an existing distributed engine: datatrove's executors.

    local   datatrove's LocalPipelineExecutor: ``workers`` processes on this machine
            (``local_tasks``/``local_rank_offset`` run a share of the tasks, e.g. one
            share per machine by hand)
    ray     datatrove's RayPipelineExecutor on a Ray cluster (``ray_address``; none:
            a local Ray instance with ``workers`` CPUs)
    slurm   datatrove's SlurmPipelineExecutor: an sbatch array of ``tasks`` jobs, then
            one job that writes the index once they are done

Task ``r`` of ``N`` packs parts ``r, r + N, ...`` of the build plan (store.BuildPlan);
the parts, and so the rows and the training order, do not depend on ``N``. datatrove
marks a task complete in ``<build>/logs/completions`` and skips it when run again;
inside a task, a part already packed (its directory renamed into place) is skipped
too, so a rerun of the same command redoes only what died.
"""

import os
import shutil

from ds_ext.errors import ConfigError
from ds_ext.log import print_line

EXECUTORS = ("local", "ray", "slurm")
_INSTALL = {"local": "datatrove==0.10.1", "ray": "ray==2.60.0", "slurm": "datatrove==0.10.1"}


class PackTask:
    """One datatrove pipeline step: pack the parts of task ``rank`` of ``world_size``."""

    def __init__(self, plan, tokenizer):
        self.plan, self.tokenizer = plan, tokenizer

    def __call__(self, data, rank, world_size):
        from ds_ext.errors import SeekspeedError
        from .store import run_task
        try:
            run_task(self.plan, self.tokenizer, rank=rank, world_size=world_size,
                     log=print_line)
        except SeekspeedError as exc:       # bad input: one line for the driver, not a traceback per task
            self.plan.record_error(rank, exc)
            print(f"data: task {rank}/{world_size} stopped: {exc}", flush=True)
        return []


class FinishTask:
    """The slurm job that writes the index once every part is packed."""

    def __init__(self, plan):
        self.plan = plan

    def __call__(self, data, rank, world_size):
        from .store import finish
        finish(self.plan, log=print_line)
        return []


def _need(module, executor):
    try:
        return __import__(module)
    except ImportError:
        raise ConfigError(f"--executor {executor} needs the {module} package, which is not installed: "
                          f"pip install '{_INSTALL[executor]}'") from None


def run_executor(plan, tokenizer, *, executor, tasks, workers=None, local_tasks=-1, local_rank_offset=0,
                 ray_address=None, slurm=None, log=print):
    """Run the build's tasks with ``executor``; returns the datatrove executor (for
    slurm: after submitting, with the tasks still to run)."""
    if executor not in EXECUTORS:
        raise ConfigError(f"--executor {executor!r} is not one of {list(EXECUTORS)}")
    if tasks < 1:
        raise ConfigError(f"--tasks must be >= 1, got {tasks}")
    _need("datatrove", executor)
    logs = os.path.join(plan.directory, "logs")
    step = [PackTask(plan, tokenizer)]
    workers = workers or tasks
    if executor == "local":
        from datatrove.executor.local import LocalPipelineExecutor
        ex = LocalPipelineExecutor(pipeline=step, tasks=tasks, workers=min(workers, tasks), logging_dir=logs,
                                   local_tasks=local_tasks, local_rank_offset=local_rank_offset,
                                   start_method="spawn")
        ex.run()
        plan.raise_task_errors()
        return ex
    if executor == "ray":
        ray = _need("ray", executor)
        from datatrove.executor.ray import RayPipelineExecutor
        started = False
        if not ray.is_initialized():
            try:
                if ray_address:
                    ray.init(address=ray_address, log_to_driver=True)
                else:
                    ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=True)
                    started = True
            except Exception as exc:     # ray raises ConnectionError, RuntimeError, ... for a cluster it cannot reach
                first = (str(exc).splitlines() or [""])[0][:200]
                raise ConfigError(f"--executor ray: cannot start or reach a Ray cluster "
                                  f"({'address ' + ray_address if ray_address else 'local instance'}: "
                                  f"{type(exc).__name__}: {first}); start one with `ray start --head` and pass "
                                  f"--ray-address, or use --executor local") from None
        try:
            ex = RayPipelineExecutor(pipeline=step, tasks=tasks, workers=workers, logging_dir=logs,
                                     cpus_per_task=1, mem_per_cpu_gb=1)
            ex.run()
        finally:
            if started:
                ray.shutdown()
        plan.raise_task_errors()
        return ex
    if shutil.which("sbatch") is None:
        raise ConfigError("--executor slurm submits with sbatch, which is not on PATH: run on a Slurm login node, "
                          "or use --executor local or ray")
    from datatrove.executor.slurm import SlurmPipelineExecutor
    slurm = dict(slurm or {})
    options = {"time": slurm.pop("time", "24:00:00"), "partition": slurm.pop("partition"),
               "cpus_per_task": slurm.pop("cpus_per_task", 1), "mem_per_cpu_gb": slurm.pop("mem_per_cpu_gb", 2),
               "job_name": slurm.pop("job_name", f"seekspeed-pack-{plan.key}"), **slurm}
    pack = SlurmPipelineExecutor(pipeline=step, tasks=tasks, workers=workers if workers != tasks else -1,
                                 logging_dir=logs, **options)
    index = SlurmPipelineExecutor(pipeline=[FinishTask(plan)], tasks=1, depends=pack,
                                  logging_dir=os.path.join(plan.directory, "logs-index"),
                                  **(options | {"job_name": options["job_name"] + "-index"}))
    index.run()
    log(f"data: submitted {tasks} packing tasks and the index job (sbatch); the cache appears at {plan.final} "
        f"when the index job ends; the same command resubmits only the tasks that did not complete")
    return index
