"""Build the tiered data pipeline's packed cache before a job, on a distributed engine.

    python launch/prepare_data.py --deepspeed ds_configs/128node.json
    python launch/prepare_data.py --deepspeed CONFIG --executor local --tasks 32 --workers 16
    python launch/prepare_data.py --deepspeed CONFIG --executor ray --tasks 1024 --ray-address auto
    python launch/prepare_data.py --deepspeed CONFIG --executor slurm --tasks 1024 --partition cpu

Every source of ``seekspeed.data`` (``pipeline: "tiered"``) is cut into parts of about
``data.part_mb`` (ds_ext/data/parts.py); ``--tasks`` tasks of datatrove's executor pack
them (task r: parts r, r + N, ...) into ``data.cache_dir``, and a last step writes the
index, so a training job finds the cache ready instead of rank 0 building it while the
other ranks wait. The rows, and the training order over them, are the same whatever
``--tasks`` is. Run the same command again after a failure: completed tasks and packed
parts are skipped, only what died is redone. A cache already there is left as it is.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deepspeed", "--deepspeed_config", dest="config", required=True, metavar="JSON")
    p.add_argument("--executor", choices=("local", "ray", "slurm"), default="local",
                   help="datatrove executor that runs the tasks (default local)")
    p.add_argument("--tasks", type=int, default=1, help="tasks the parts are split into (default 1)")
    p.add_argument("--workers", type=int, default=None, help="tasks run at once (default: all)")
    p.add_argument("--local-tasks", type=int, default=-1,
                   help="local: run only this many of the tasks here, from --local-rank-offset (a share per machine)")
    p.add_argument("--local-rank-offset", type=int, default=0)
    p.add_argument("--ray-address", default=None, help="ray: the cluster to use (e.g. auto); default a local instance")
    p.add_argument("--partition", help="slurm: the partition (required with --executor slurm)")
    p.add_argument("--time", default="24:00:00", help="slurm: time limit per task")
    p.add_argument("--cpus-per-task", type=int, default=1, help="slurm")
    p.add_argument("--mem-per-cpu-gb", type=int, default=2, help="slurm")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from ds_ext.config import SECTION, SeekspeedSection, read_json
    from ds_ext.errors import ConfigError, SeekspeedError
    from ds_ext.schema import from_dict
    try:
        if args.executor == "slurm" and not args.partition:
            raise ConfigError("--executor slurm needs --partition (the Slurm partition the tasks run in)")
        if args.tasks < 1:
            raise ConfigError(f"--tasks must be >= 1, got {args.tasks}")
        raw = read_json(args.config)
        section = from_dict(SeekspeedSection, (raw or {}).get(SECTION, {}), where=SECTION)
        data = section.data
        if data.pipeline != "tiered":
            raise SeekspeedError(f"{args.config}: seekspeed.data.pipeline is {data.pipeline!r}; only the \"tiered\" "
                                 f"pipeline has a packed cache to prepare")
        from recipes import get_recipe
        from ds_ext.data import load_tokenizer
        from ds_ext.data.sources import cache_dir
        from ds_ext.data.store import BuildPlan, finish, open_all
        recipe = get_recipe(section.recipe.name)
        model_config = recipe.make_config(section.recipe.preset, section.recipe.overrides)
        tokenizer = load_tokenizer(data.tokenizer, vocab_size=model_config.vocab_size)
        root = data.cache_dir or str(cache_dir() / "packed")
        log = lambda m: print(m, flush=True)
        start = time.perf_counter()
        plans = [BuildPlan(source, tokenizer, root=root, rows_per_shard=data.rows_per_shard)
                 for source, _ in data.sources()]
        pending = 0
        for plan in plans:
            if plan.done is not None:
                continue
            plan.write()
            log(f"data: {plan.data.source}: {len(plan.parts)} part(s) ({plan.format}) in {args.tasks} task(s) on the "
                f"{args.executor} executor; build directory {plan.directory}")
            from ds_ext.data.prepare import run_executor
            with plan.removed_on_bad_input():
                run_executor(plan, tokenizer, executor=args.executor, tasks=args.tasks, workers=args.workers,
                             local_tasks=args.local_tasks, local_rank_offset=args.local_rank_offset,
                             ray_address=args.ray_address, log=log,
                             slurm={"partition": args.partition, "time": args.time,
                                    "cpus_per_task": args.cpus_per_task, "mem_per_cpu_gb": args.mem_per_cpu_gb})
                if args.executor == "slurm":
                    pending += 1
                elif args.local_tasks != -1 and plan.missing():
                    log(f"data: this share's tasks are done; {len(plan.missing())} parts are left to the other "
                        f"shares; the index is written by the run that packs the last of them")
                    pending += 1
                else:
                    finish(plan, log=log)
        if pending:
            return 0
        shards = open_all(data, tokenizer, root=root, rows_per_shard=data.rows_per_shard)
    except SeekspeedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from ds_ext.data.textfiles import describe_undecodable
    for store in shards.stores:
        undecodable = describe_undecodable(store.index.get("replaced_documents", 0),
                                           store.index.get("skipped_documents", 0))
        print(f"ready: {store.root}: {store.num_rows:,} rows of {store.row_len} tokens in {len(store.shards)} shards "
              f"({store.index['documents']:,} documents, {store.index['tokens']:,} tokens"
              f"{'; ' + undecodable if undecodable else ''})")
    print(f"done in {time.perf_counter() - start:.1f} s; training with this config finds the cache under {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
