"""Topology: a rank-by-rank bandwidth matrix (measured, from `nvidia-smi topo -m`, or
from the hostfile and configured link speeds), affinity groups (which ranks share
fast links), rank placement (which DeepSpeed axis gets the fast links), intra-node
and rail groups, and a hierarchical all-reduce."""
