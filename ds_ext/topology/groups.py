"""Intra-node and rail groups, and a hierarchical all-reduce over them.

A rail is the set of ranks with the same local index on every node (the GPUs that
share a NIC rail on a cluster). The hierarchical all-reduce moves each byte over the
slow inter-node links once per direction (a flat ring over node-contiguous ranks
pushes 1.5x that with two nodes): reduce-scatter inside the node, all-reduce of each
rank's part across nodes on its rail, all-gather inside the node. The tensor is cut
into segments, and one segment's rail all-reduce runs while the next segment is
reduce-scattered inside the node.
"""

import torch
import torch.distributed as tdist


class NodeGroups:
    """``node_of[r]`` is the node of global rank r; every node has the same number of
    ranks. Collective: every rank constructs it (it creates process groups)."""

    def __init__(self, node_of):
        nodes = sorted(set(node_of))
        members = {k: [r for r, n in enumerate(node_of) if n == k] for k in nodes}
        sizes = {len(m) for m in members.values()}
        if len(sizes) != 1:
            raise ValueError(f"nodes hold different numbers of ranks ({sorted(sizes)}): rails need equal nodes")
        self.rank = tdist.get_rank()
        self.node_members = [members[k] for k in nodes]
        self.local_size = sizes.pop()
        self.num_nodes = len(nodes)
        mine = node_of[self.rank]
        self.node_ranks = members[mine]
        self.local_rank = self.node_ranks.index(self.rank)
        self.intra_group, self.rail_group = None, None
        for ranks in self.node_members:
            group = tdist.new_group(ranks=ranks)
            if self.rank in ranks:
                self.intra_group = group
        self.rails = [[m[j] for m in self.node_members] for j in range(self.local_size)]
        for ranks in self.rails:
            group = tdist.new_group(ranks=ranks)
            if self.rank in ranks:
                self.rail_group = group

    @classmethod
    def contiguous(cls, world_size, ranks_per_node):
        if world_size % ranks_per_node:
            raise ValueError(f"world size {world_size} is not a multiple of {ranks_per_node} ranks per node")
        return cls([r // ranks_per_node for r in range(world_size)])


def _parts(flat, count):
    return list(torch.tensor_split(flat, count))


def hierarchical_all_reduce(tensor, groups, *, segments=4):
    """Sum ``tensor`` over all ranks in place, as a flat all-reduce would."""
    flat = tensor.view(-1)
    if groups.num_nodes == 1:
        tdist.all_reduce(flat, group=groups.intra_group)
        return tensor
    peers = [(j, r) for j, r in enumerate(groups.node_ranks) if r != groups.rank]
    me = groups.local_rank
    pending = []          # (rail all-reduce work, the segment's parts)
    for segment in _parts(flat, segments):
        parts = _parts(segment, groups.local_size)
        # 1. reduce-scatter inside the node: part j is summed on local rank j
        incoming = [torch.empty_like(parts[me]) for _ in peers]
        ops = [tdist.P2POp(tdist.isend, parts[j], r) for j, r in peers]
        ops += [tdist.P2POp(tdist.irecv, buf, r) for buf, (_, r) in zip(incoming, peers)]
        for work in tdist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        for buf in incoming:
            parts[me] += buf
        # 2. all-reduce of this rank's part across nodes, in the background
        pending.append((tdist.all_reduce(parts[me], group=groups.rail_group, async_op=True), parts))
        if len(pending) > 1:
            _gather(*pending.pop(0), groups, peers)
    while pending:
        _gather(*pending.pop(0), groups, peers)
    return tensor


def _gather(work, parts, groups, peers):
    """3. all-gather inside the node once the segment's rail all-reduce is done."""
    work.wait()
    me = groups.local_rank
    ops = [tdist.P2POp(tdist.isend, parts[me], r) for _, r in peers]
    ops += [tdist.P2POp(tdist.irecv, parts[j], r) for j, r in peers]
    for w in tdist.batch_isend_irecv(ops) if ops else []:
        w.wait()
