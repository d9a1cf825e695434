"""What the trainer does with the topology section: build the bandwidth matrix,
find the nodes (affinity groups), estimate a step's traffic and choose the rank
placement; log the choice and its predicted traffic per link class."""

import os
import shutil
import subprocess
from dataclasses import dataclass

from ds_ext.errors import ConfigError

from . import bandwidth as bw
from . import hostfile as hf
from .placement import StepTraffic, choose, predict


def local_world_size(world_size):
    """Ranks per node as the launcher says (torchrun: LOCAL_WORLD_SIZE; DeepSpeed: LOCAL_SIZE)."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if os.environ.get(name):
            return int(os.environ[name])
    return world_size


def check(section, *, model_config, where="seekspeed.topology"):
    """Checks that need no process group."""
    if section.placement == "data-pipe" and model_config.num_moe_layers():
        raise ConfigError(f"{where}.placement data-pipe cannot be used with MoE layers (DeepSpeed's expert groups "
                          f"need each stage's ranks consecutive): use pipe-data or auto")
    if section.bandwidth == "hostfile":
        if not os.path.isfile(section.hostfile):
            raise ConfigError(f"{where}.hostfile {section.hostfile} does not exist")
        configured_resources(section, where=where)
    if section.bandwidth == "nvidia-smi" and shutil.which("nvidia-smi") is None:
        raise ConfigError(f"{where}.bandwidth is nvidia-smi but nvidia-smi is not on PATH: use launcher or probe")


def configured_resources(section, *, where="seekspeed.topology"):
    """host -> slot ids of ``section.hostfile`` after the section's include / exclude /
    num_nodes / num_gpus, by DeepSpeed's launcher's rules."""
    pool = hf.read_hostfile(section.hostfile, what=f"{where}.hostfile")
    return hf.active_resources(pool, include=section.include, exclude=section.exclude, num_nodes=section.num_nodes,
                               num_gpus=section.num_gpus, path=section.hostfile,
                               names={k: f"{where}.{k}" for k in hf.CLI_NAMES})


def _filters(section, where):
    given = [f"{where}.{k} {getattr(section, k)!r}" for k in hf.CLI_NAMES if getattr(section, k) is not None]
    return ", ".join(given) if given else "no include/exclude/num_nodes/num_gpus"


def hostfile_nodes(section, *, world_size, world_info=None, env=None, where="seekspeed.topology"):
    """(ranks per node in rank order, a description) for ``bandwidth: hostfile``: the
    hosts DeepSpeed's launcher started ranks on (its ``--world_info``, read from the
    parent process) when known, else the hostfile with the section's filters; checked
    against the launcher's counts (WORLD_SIZE, CROSS_SIZE, LOCAL_SIZE of node CROSS_RANK)."""
    env = os.environ if env is None else env
    path = section.hostfile
    configured = configured_resources(section, where=where)
    launched = hf.launcher_world_info() if world_info is None else world_info
    if launched is not None:
        pool = hf.read_hostfile(path, what=f"{where}.hostfile")
        unknown = [h for h in launched if h not in pool]
        if unknown:
            raise ConfigError(f"DeepSpeed's launcher started ranks on {', '.join(unknown)}, which {where}.hostfile "
                              f"{path} does not list: point {where}.hostfile at the file given to deepspeed --hostfile")
        if any(getattr(section, k) is not None for k in hf.CLI_NAMES) and configured != launched:
            raise ConfigError(f"{path} with {_filters(section, where)} gives {hf.describe(configured)}, but "
                              f"DeepSpeed's launcher started {hf.describe(launched)}: remove those keys (the launcher's "
                              f"choice is read from its --world_info) or make them match its flags")
        active, how = launched, "as DeepSpeed's launcher chose"
    else:
        active, how = configured, _filters(section, where)
    nodes = [len(slots) for slots in active.values()]
    fix = (f"if deepspeed ran with --include/--exclude/--num_nodes/--num_gpus, repeat them as {where}.include/exclude/"
           f"num_nodes/num_gpus, or set {where}.bandwidth to \"launcher\"")
    if sum(nodes) != world_size:
        raise ConfigError(f"{path} ({how}) gives {hf.describe(active)}, but the launcher started {world_size} "
                          f"rank{'s' if world_size != 1 else ''}: {fix}")
    if env.get("CROSS_SIZE") and int(env["CROSS_SIZE"]) != len(nodes):
        raise ConfigError(f"{path} ({how}) gives {hf.describe(active)}, but the launcher started "
                          f"{env['CROSS_SIZE']} nodes (CROSS_SIZE): {fix}")
    if env.get("CROSS_RANK") and env.get("LOCAL_SIZE"):
        host, slots = list(active.items())[int(env["CROSS_RANK"])]
        if len(slots) != int(env["LOCAL_SIZE"]):
            raise ConfigError(f"{path} ({how}) gives {host} {len(slots)} slots, but the launcher started "
                              f"{env['LOCAL_SIZE']} ranks on node {env['CROSS_RANK']} (LOCAL_SIZE): {fix}")
    return nodes, f"hostfile {path}, {how}"


def bandwidth_matrix(section, *, world_size, log):
    """The configured bandwidth matrix (``probe`` is collective: every rank calls it)."""
    per_node = local_world_size(world_size)
    if section.bandwidth == "probe":
        return bw.probe(nbytes=section.probe_mbytes * 2**20, log=log)
    if section.bandwidth == "hostfile":
        nodes, source = hostfile_nodes(section, world_size=world_size)
        return bw.from_nodes(nodes, intra_gbps=section.intra_node_gbps, inter_gbps=section.inter_node_gbps,
                             source=source)
    if section.bandwidth == "nvidia-smi":
        text = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, check=True).stdout
        gpus = len(bw.parse_nvidia_smi_topo(text))
        if per_node != gpus or world_size % gpus:
            raise ConfigError(f"nvidia-smi shows {gpus} GPUs per node but the launcher runs {per_node} ranks per node")
        return bw.from_nvidia_smi(text, nodes=world_size // gpus, inter_gbps=section.inter_node_gbps)
    if world_size % per_node:
        raise ConfigError(f"{world_size} ranks are not whole nodes of {per_node}")
    return bw.from_nodes([per_node] * (world_size // per_node), intra_gbps=section.intra_node_gbps,
                         inter_gbps=section.inter_node_gbps, source="launcher")


def estimate_traffic(*, model_config, layout, ds, stage_params, moe, compute_tflops):
    """Bytes per optimizer step for the placement model, from the model and the batch;
    the expert all-to-all as ``moe``'s dispatcher sends it (seekspeed.moe: every-copy
    sends each of a token's k copies, deduplicated one row to each rank holding one of
    its experts, with its routing slots; FP8 rows on the forward dispatch)."""
    bf16 = ds.get("bf16", {}).get("enabled", False)
    from ds_ext.precision import fp32_grad_accumulation
    fp32_grads = fp32_grad_accumulation(ds)
    act = 2 if bf16 else 4
    tokens = layout.micro_batch * layout.seq_len
    expert, ep = 0.0, moe.expert_parallel_size
    if ep > 1 and model_config.num_moe_layers():
        moe_per_stage = model_config.num_moe_layers() / layout.pipe_stages
        k, experts = model_config.num_experts_per_tok, model_config.n_routed_experts
        row = model_config.hidden_size * act
        from ds_ext.comm.fp8 import row_bytes as fp8_row_bytes
        sent = fp8_row_bytes(model_config.hidden_size) if moe.dispatch_dtype == "fp8" else row
        if moe.dispatcher == "every-copy":
            rows = k
        else:
            from ds_ext.comm.alltoall import slot_bytes
            from ds_ext.planner.collectives import routing
            # the placement is not chosen yet, so no node limit: free routing over the group
            rows = routing(nodes=1, per_node=ep, num_experts=experts, top_k=k).ranks_per_token
            sent += min(k, experts // ep) * slot_bytes(experts)
        # StepTraffic counts four passes (dispatch and combine, forward and backward) of
        # expert_bytes; only the forward dispatch carries the sent rows
        expert = tokens * layout.grad_accum * moe_per_stage * rows * (sent + 3 * row) / 4
    # forward + backward of one micro-batch on one stage: 6 FLOPs per parameter and token
    compute = 6 * stage_params * tokens / (compute_tflops * 1e12)
    from recipes import spec_for
    boundary = spec_for(model_config).planner.stage_boundary_bytes(model_config, act_bytes=act)
    return StepTraffic(gradient_bytes=stage_params * (4 if fp32_grads else 2),
                       activation_bytes=tokens * boundary, micro_batches=layout.grad_accum,
                       expert_bytes=expert, compute_seconds=compute)


@dataclass
class TopologyPlan:
    placement: str
    node_of: list
    intra_gbps: float
    inter_gbps: float
    predictions: list
    source: str


def plan(section, *, layout, model_config, ds, stage_params, moe, log):
    """Choose the placement; collective when the bandwidth is probed."""
    matrix = bandwidth_matrix(section, world_size=layout.world_size, log=log)
    groups = matrix.affinity_groups()
    node_of = [0] * matrix.ranks
    for k, ranks in enumerate(groups):
        for r in ranks:
            node_of[r] = k
    intra, inter = matrix.link_classes(groups)
    intra = intra if intra != float("inf") else section.intra_node_gbps
    inter = inter if inter != float("inf") else section.inter_node_gbps
    traffic = estimate_traffic(model_config=model_config, layout=layout, ds=ds, stage_params=stage_params, moe=moe,
                               compute_tflops=section.compute_tflops)
    kwargs = {"pp": layout.pipe_stages, "dp": layout.data_parallel, "ep": moe.expert_parallel_size, "traffic": traffic,
              "node_of": node_of, "intra_gbps": intra, "inter_gbps": inter}
    if section.placement == "auto":
        best, predictions = choose(moe=model_config.num_moe_layers() > 0, **kwargs)
    else:
        best = predict(section.placement, **kwargs)
        predictions = [best] + ([predict(p, **kwargs) for p in ("pipe-data", "data-pipe") if p != best.placement]
                                if not model_config.num_moe_layers() else [])
    sizes = sorted({len(g) for g in groups})
    log(f"topology: {len(groups)} node(s) of {'/'.join(map(str, sizes))} ranks ({matrix.source}), links "
        f"{intra:g} GB/s inside, {inter:g} GB/s between; placement {best.placement}"
        f"{' (auto)' if section.placement == 'auto' else ''}")
    for p in sorted(predictions, key=lambda p: p.seconds):
        log(f"  {'*' if p is best else ' '} {p.describe()}")
    return TopologyPlan(best.placement, node_of, intra, inter, predictions, matrix.source)
