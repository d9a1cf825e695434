"""The hardware a plan is made for: a GPU, its node and its links (defaults: DeepSeek-V3's
H800 nodes), the figures ``pipeline.partition: "balanced"`` cuts by, and the node count of
a DeepSpeed hostfile."""

from dataclasses import dataclass

from ds_ext.errors import ConfigError

GB = 1e9


@dataclass(kw_only=True)
class Hardware:
    """A GPU, its node and its links. Defaults: NVIDIA H800 SXM (80 GB HBM3, 989 dense
    bf16 TFLOP/s) in a node as DeepSeek-V3's cluster had them: 8 GPUs on NVLink and
    NVSwitch (400 GB/s both directions per GPU, 200 one way), one 400 Gb/s ConnectX-7
    InfiniBand NIC per GPU (DeepSeek-V3 technical report, arXiv 2412.19437 section 3.1;
    DeepEP's README: "H800 (~160 GB/s NVLink maximum bandwidth), with each connected to
    a CX7 InfiniBand 400 Gb/s RDMA network card (~50 GB/s maximum bandwidth)").
    Bandwidths are line rates, one way; the efficiencies are what NCCL achieves of them
    (ds_ext/planner/collectives.py says where each comes from)."""
    name: str = "H800"
    memory_gb: float = 80.0
    reserve_gb: float = 4.0         # CUDA context, NCCL buffers, allocator fragmentation
    peak_tflops: float = 989.0
    efficiency: float = 0.4         # achieved / peak on the model's matmuls (MFU)
    hbm_gbps: float = 3350.0        # GB/s, for the optimizer step
    # node and links
    gpus_per_node: int = 8
    nics_per_node: int = 8          # one rail each
    intra_gbps: float = 200.0       # NVLink GB/s one way per GPU
    inter_gbps: float = 50.0        # GB/s one way per NIC (400 Gb/s)
    nvlink_efficiency: float = 0.8      # rings and trees: NCCL's own 20.6 of 25 GB/s per Hopper link
    nvlink_a2a_efficiency: float = 0.67  # all-to-all: DeepEP's intranode EP8 dispatch, 153 GB/s on H800
    nic_efficiency: float = 0.94        # NVIDIA: 46-48 GB/s per 400 Gb/s NIC through NCCL
    latency_us: float = 10.0        # per point-to-point transfer
    # dense FP8 GEMM TFLOP/s (H800: 1,979), for a run whose weight matmuls are FP8 elsewhere: those
    # FLOPs then run at fp8_tflops x efficiency; attention's S^2 terms and memory stay as in bf16
    fp8_tflops: float | None = None
    nvlink_latency_us: float = 1.0  # per collective algorithm step inside a node
    nic_latency_us: float = 5.0     # per collective algorithm step between nodes

    def __post_init__(self):
        flags = {"gpus_per_node": "--gpus-per-node", "nics_per_node": "--nics-per-node",
                 "intra_gbps": "--intra-gbps", "inter_gbps": "--nic-gbps (--inter-gbps)"}
        for name in ("gpus_per_node", "nics_per_node"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{flags[name]} {getattr(self, name)}: a node needs at least one; pass the count "
                                  f"per node (8 GPUs and 8 NICs on an HGX H100/H800)")
        for name in ("intra_gbps", "inter_gbps"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{flags[name]} {getattr(self, name)}: give the link's GB/s one way, above 0 "
                                  f"(400 Gb/s is 50)")
        for name in ("nvlink_efficiency", "nvlink_a2a_efficiency", "nic_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"Hardware {name} {getattr(self, name)}: an achieved fraction of the line rate, "
                                  f"in (0, 1]")

    @property
    def flops(self):
        return self.peak_tflops * 1e12 * self.efficiency

    @property
    def gemm_flops(self):
        """FLOP/s of the weight matmuls: FP8's when given."""
        return (self.fp8_tflops if self.fp8_tflops else self.peak_tflops) * 1e12 * self.efficiency

    def fabric(self):
        """The node's links for ds_ext/planner/collectives.py."""
        from .collectives import Fabric
        return Fabric(gpus_per_node=self.gpus_per_node, nics_per_node=self.nics_per_node, nic_gbps=self.inter_gbps,
                      nvlink_gbps=self.intra_gbps, nic_efficiency=self.nic_efficiency,
                      nvlink_efficiency=self.nvlink_efficiency, nvlink_a2a_efficiency=self.nvlink_a2a_efficiency,
                      nic_latency_us=self.nic_latency_us, nvlink_latency_us=self.nvlink_latency_us)


def cut_hardware(topology, ranks_per_node):
    """The figures ``pipeline.partition: "balanced"`` costs layers with, in the run and
    in every plan of it: seekspeed.topology's compute_tflops (sustained, so efficiency
    1), memory_gbps and link speeds (one NIC per rank); the rest Hardware's defaults."""
    return Hardware(peak_tflops=topology.compute_tflops, efficiency=1.0, hbm_gbps=topology.memory_gbps,
                    gpus_per_node=ranks_per_node, nics_per_node=ranks_per_node, intra_gbps=topology.intra_node_gbps,
                    inter_gbps=topology.inter_node_gbps)


def nodes_from_hostfile(path, *, include="", exclude="", num_nodes=None, num_gpus=None):
    """(nodes, GPUs per node) of DeepSpeed hostfile ``path`` after the launcher's --include,
    --exclude, --num_nodes and --num_gpus (DeepSpeed's own parser and filters)."""
    import os

    from ds_ext.topology.hostfile import active_resources, read_hostfile
    if not os.path.isfile(path):
        raise ConfigError(f"--hostfile {path} does not exist; pass a DeepSpeed hostfile ('host slots=N' per line) "
                          f"or --nodes and --gpus-per-node")
    active = active_resources(read_hostfile(path, what="--hostfile"), include=include, exclude=exclude,
                              num_nodes=num_nodes, num_gpus=num_gpus, path=path)
    counts = {host: len(slots) for host, slots in active.items()}
    if len(set(counts.values())) != 1:
        by_count = {}
        for host, n in counts.items():
            by_count.setdefault(n, []).append(host)
        shown = "; ".join(f"{n} GPUs on {', '.join(hosts[:3])}{', ...' if len(hosts) > 3 else ''}"
                          for n, hosts in sorted(by_count.items()))
        raise ConfigError(f"{path}: the nodes used have different GPU counts ({shown}); the planner assumes equal "
                          f"nodes: select equal ones with --include/--exclude or --num_gpus")
    return len(counts), next(iter(counts.values()))
