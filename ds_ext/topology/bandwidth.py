"""Rank-by-rank bandwidth matrices (GB/s, one direction) and affinity groups."""

import re
import time

import numpy as np

# `nvidia-smi topo -m` link types -> GB/s one way (estimates; NV# counts bonded NVLinks)
NVSMI_LINK_GBPS = {"PIX": 24.0, "PXB": 20.0, "PHB": 16.0, "NODE": 12.0, "SYS": 8.0}
NVLINK_GBPS = 25.0


class BandwidthMatrix:
    """``gbps[i, j]``: bandwidth from rank i to rank j; the diagonal is +inf."""

    def __init__(self, gbps, *, source):
        gbps = np.asarray(gbps, dtype=float)
        if gbps.ndim != 2 or gbps.shape[0] != gbps.shape[1]:
            raise ValueError(f"a bandwidth matrix must be square, got shape {gbps.shape}")
        self.gbps = gbps.copy()
        np.fill_diagonal(self.gbps, np.inf)
        self.source = source

    @property
    def ranks(self):
        return self.gbps.shape[0]

    def affinity_groups(self, threshold_gbps=None):
        """A partition of the ranks: i and j share a group when a chain of links of at
        least ``threshold_gbps`` joins them (connected components; each rank in exactly
        one group). Groups are ordered by their smallest rank. With no threshold, the
        midpoint (geometric) of the fastest and slowest off-diagonal link is used."""
        n = self.ranks
        if n == 1:
            return [[0]]
        off = self.gbps[~np.eye(n, dtype=bool)]
        if threshold_gbps is None:
            threshold_gbps = float(np.sqrt(off.max() * off.min())) if off.max() > off.min() else 0.0
        parent = list(range(n))

        def find(i):
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for i in range(n):
            for j in range(i + 1, n):
                if min(self.gbps[i, j], self.gbps[j, i]) >= threshold_gbps:
                    a, b = find(i), find(j)
                    if a != b:
                        parent[max(a, b)] = min(a, b)
        groups = {}
        for i in range(n):
            groups.setdefault(find(i), []).append(i)
        return sorted(groups.values(), key=lambda g: g[0])

    def link_classes(self, groups):
        """(intra-group GB/s, inter-group GB/s): the slowest link inside any group and
        the fastest link between groups (the speeds a placement can count on)."""
        member = {r: g for g, ranks in enumerate(groups) for r in ranks}
        intra = [self.gbps[i, j] for i in range(self.ranks) for j in range(self.ranks)
                 if i != j and member[i] == member[j]]
        inter = [self.gbps[i, j] for i in range(self.ranks) for j in range(self.ranks) if member[i] != member[j]]
        return (min(intra) if intra else float("inf")), (max(inter) if inter else float("inf"))


def from_nodes(nodes, *, intra_gbps, inter_gbps, source="hostfile"):
    """Ranks laid out node after node (``nodes[k]`` ranks on node k), as the DeepSpeed
    launcher and torchrun number them."""
    owner = [k for k, count in enumerate(nodes) for _ in range(count)]
    n = len(owner)
    gbps = np.full((n, n), float(inter_gbps))
    for i in range(n):
        for j in range(n):
            if owner[i] == owner[j]:
                gbps[i, j] = intra_gbps
    return BandwidthMatrix(gbps, source=source)


def from_hostfile(text, *, intra_gbps, inter_gbps, path="hostfile"):
    """Every slot of the hostfile ``text`` (read as DeepSpeed's launcher reads it) one rank."""
    from .hostfile import parse_hostfile
    return from_nodes(list(parse_hostfile(text, path=path).values()), intra_gbps=intra_gbps, inter_gbps=inter_gbps,
                      source=f"hostfile {path}")


def parse_nvidia_smi_topo(text):
    """GPU-to-GPU link types from `nvidia-smi topo -m`: a list of rows of strings
    ("X", "NV12", "SYS", ...) for the GPU rows and columns only."""
    lines = [l.rstrip() for l in text.splitlines() if l.strip()]
    # the header's first token is GPU0 followed by column names; a row's is GPU0 then "X"
    header = next((l for l in lines if l.split()[0] == "GPU0" and (len(l.split()) < 2 or l.split()[1] != "X")), None)
    if header is None:
        raise ValueError("no GPU header line (GPU0 GPU1 ...) in nvidia-smi topo -m output")
    columns = header.split()
    gpu_cols = [i for i, c in enumerate(columns) if re.fullmatch(r"GPU\d+", c)]
    rows = []
    for line in lines:
        cells = line.split()
        if line is not header and cells and re.fullmatch(r"GPU\d+", cells[0]):
            values = cells[1:]
            rows.append([values[i] for i in gpu_cols])
    if not rows or len(rows) != len(gpu_cols):
        raise ValueError(f"expected {len(gpu_cols)} GPU rows in nvidia-smi topo -m output, found {len(rows)}")
    return rows


def from_nvidia_smi(text, *, nodes=1, inter_gbps=25.0, nvlink_gbps=NVLINK_GBPS):
    """Matrix for ``nodes`` identical nodes with the GPU topology of ``text``."""
    rows = parse_nvidia_smi_topo(text)
    g = len(rows)
    local = np.zeros((g, g))
    for i, row in enumerate(rows):
        for j, kind in enumerate(row):
            if kind == "X":
                local[i, j] = np.inf
            elif kind.startswith("NV"):
                local[i, j] = int(kind[2:]) * nvlink_gbps
            elif kind in NVSMI_LINK_GBPS:
                local[i, j] = NVSMI_LINK_GBPS[kind]
            else:
                raise ValueError(f"unknown nvidia-smi link type {kind!r} between GPU{i} and GPU{j}")
    n = g * nodes
    gbps = np.full((n, n), float(inter_gbps))
    for k in range(nodes):
        gbps[k * g:(k + 1) * g, k * g:(k + 1) * g] = local
    return BandwidthMatrix(gbps, source="nvidia-smi topo -m")


def probe(*, nbytes=4 * 2**20, rounds=2, log=print):
    """Measure every rank pair: a round-robin tournament (n-1 rounds of disjoint pairs;
    each pair exchanges ``nbytes`` each way ``rounds`` times, the best time counts).
    Collective: every rank calls it; all get the same matrix. Its cost is printed."""
    import torch
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    device = get_accelerator().current_device_name()
    n, rank = dist.get_world_size(), dist.get_rank()
    gbps = np.zeros((n, n))
    players = list(range(n)) + ([None] if n % 2 else [])
    buf_out = torch.ones(nbytes // 4, device=device)
    buf_in = torch.empty_like(buf_out)
    t_start = time.perf_counter()
    for _ in range(len(players) - 1):
        half = len(players) // 2
        pairs = list(zip(players[:half], reversed(players[half:])))
        partner = next((b if a == rank else a for a, b in pairs if rank in (a, b)), None)
        if partner is not None:
            best = float("inf")
            for _ in range(rounds):
                t0 = time.perf_counter()
                if rank < partner:
                    dist.send(buf_out, partner)
                    dist.recv(buf_in, partner)
                else:
                    dist.recv(buf_in, partner)
                    dist.send(buf_out, partner)
                best = min(best, time.perf_counter() - t0)
            gbps[rank, partner] = gbps[partner, rank] = 2 * nbytes / best / 1e9
        dist.barrier()
        players = [players[0]] + [players[-1]] + players[1:-1]
    table = torch.tensor(gbps, device=device)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    table = table.cpu()
    cost = time.perf_counter() - t_start
    if rank == 0:
        log(f"topology probe: {n} ranks, {n * (n - 1) // 2} pairs x {rounds} x {nbytes / 2**20:.0f} MiB each way, "
            f"{cost:.2f}s")
    return BandwidthMatrix(table.numpy(), source=f"probe ({cost:.2f}s)")
