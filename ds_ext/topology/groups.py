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
    """``node_of[r]`` is the node of global rank r. The groups are formed among
    ``ranks`` (all ranks by default; a data-parallel group, say), every node holding the
    same number of them. Collective: every rank of the world constructs it (it creates
    process groups); ``member`` tells whether this rank is among ``ranks``."""

    def __init__(self, node_of, ranks=None):
        ranks = list(range(len(node_of))) if ranks is None else sorted(ranks)
        nodes = sorted({node_of[r] for r in ranks})
        members = {k: [r for r in ranks if node_of[r] == k] for k in nodes}
        sizes = {len(m) for m in members.values()}
        if len(sizes) != 1:
            raise ValueError(f"nodes hold different numbers of the ranks {ranks} "
                             f"({ {k: len(m) for k, m in members.items()} }): rails need equal nodes")
        self.rank = tdist.get_rank()
        self.member = self.rank in ranks
        self.node_members = [members[k] for k in nodes]
        self.local_size = sizes.pop()
        self.num_nodes = len(nodes)
        self.node_ranks = members[node_of[self.rank]] if self.member else []
        self.local_rank = self.node_ranks.index(self.rank) if self.member else None
        self.intra_group, self.rail_group = None, None
        for group_ranks in self.node_members:
            group = tdist.new_group(ranks=group_ranks)
            if self.rank in group_ranks:
                self.intra_group = group
        self.rails = [[m[j] for m in self.node_members] for j in range(self.local_size)]
        for group_ranks in self.rails:
            group = tdist.new_group(ranks=group_ranks)
            if self.rank in group_ranks:
                self.rail_group = group

    @classmethod
    def for_subsets(cls, node_of, subsets):
        """Node and rail groups inside each of ``subsets`` (every data-parallel group,
        say); this rank's. Collective over the world."""
        mine = None
        for ranks in subsets:
            groups = cls(node_of, ranks)
            if groups.member:
                mine = groups
        return mine

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
