"""The planner's cost model: memory per pipeline rank, bytes per link class, the
pipeline bubble and a predicted step time for a config, without a GPU.

Parameters come from the recipe's layer specs built on the meta device, cut into
stages by DeepSpeed's own partitioning code (ds_ext/pipe/partition.py); the schedule's
bubble and in-flight activations come from the pipeline simulator (ds_ext.pipe.simulate),
which runs the very instruction streams the engines run.

Memory per rank (bytes):
- weights: parameters x 2 (bf16/fp16) or 4 (fp32);
- gradients: parameters x 4 when gradients accumulate in fp32 (fp32 training, or
  ``data_types.grad_accum_dtype: fp32``), else x 2;
- optimizer: Adam's two moments (8 bytes) plus an fp32 master copy (4) in mixed
  precision, divided by the data-parallel degree under ZeRO stage >= 1 (routed
  experts: by their own expert-data-parallel degree); under DeepSpeed's Muon the
  matrices it orthogonalises keep its momentum and a staged copy in the gradient's dtype
  (plus the master), each Muon matrix a partition touches held whole
  (memory.optimizer_state, ds_ext/muon.py);
- activations: what autograd keeps per token of each layer (the recipe's
  ``PlannerCosts.activation_bytes``, recipes/spec.py, checked against the real layers
  in tests/test_plan.py)
  times the micro-batches the schedule holds at its peak (from the simulator); with DeepSpeed's activation
  checkpointing only each layer's input is kept, plus one layer's full activations
  while it is recomputed;
- buffers: ZeRO's reduce bucket (``reduce_bucket_size`` fp32 elements) and a fixed
  reserve for the CUDA context, NCCL and allocator fragmentation;
- comm state (``seekspeed.comm``, any compressor but ``none``): what the compressed
  reduction keeps between steps, from ``ds_ext.comm.traffic.state_bytes``: a pooled
  chunk-sized region per chunk in flight (two-phase compressors: also the chunk's encoded
  input and segment sums), the error-feedback residuals (full size, fp32; the two-phase
  compressors' server residual 1/W of it), and with ``target: "momentum"`` a full fp32
  local momentum per rank (ZeRO 1 partitions only the optimizer's own).

Time per optimizer step: the simulator's makespan for per-chunk costs F (forward),
B (backward: 2F, plus F recomputed under activation checkpointing), W (the weight
gradient part) and the point-to-point transfer of one micro-batch, summed from each
layer's own cost (``costs.layer_cost``: matmul FLOPs at the GEMM rate, FP8's with
``fp8_tflops``; the recipe's attention FLOPs (``PlannerCosts.attention_flops``: MLA's
S^2 terms, a sparse attention's indexer and selected keys); the memory-bound passes at ``hbm_gbps``: kept
activations, the embedding's rows, the head's logits), plus the data-parallel gradient
reduction (collectives.py: NCCL's ring or tree over the node's rails and
NVLink, or the compressor's collectives and payload, ds_ext/comm/traffic.py: sign and
int4 an all-to-all then an all-gather of the segments; hierarchical: dense inside the
node, the rails across; routed experts' gradients always flat, as install.py reduces
them) after the drain, or with ``seekspeed.overlap_grad_reduce`` each chunk's from its
last backward and W on (only what is left after the pipeline counts), plus the optimizer
step (memory bound; under ZeRO 1 with the all-gather of the updated weights over the
data-parallel groups). With ``warmup_steps`` the compressed figures are those after the
dense warm-up (a note gives the warm-up's). ``pipeline.partition: "balanced"`` cuts the
layers from those per-layer costs (ds_ext/pipe/partition.py balanced_cut), costed on the
config's own figures (``cut_hardware``) so every plan shows the cut the run makes.

Expert all-to-all (expert parallelism > 1): each MoE layer moves the routed tokens'
hidden states out and back (dispatch, combine), forward and backward, over the links
its expert-parallel group spans. A chunk is charged only what no compute covers: the
dispatch less the shared expert's time (its backward: twice that), the combine in
full; with ``seekspeed.overlap: "layer"`` an F&B chunk whose two halves both hold MoE
layers is charged max(0, each half's remaining all-to-all - the other half's compute),
from the chunk's totals (not layer by layer, so it is optimistic where one layer's
all-to-all is longer than the other half's compute between two switches).

The stages, each a module of plain values in and out: ``model`` (the recipe, its
config, precision and layer rows: ``layers``), ``costs`` (placement, the expert
all-to-all, per-layer seconds on one hardware), the cut (ds_ext/pipe/partition.py),
``timeline`` (the simulated step), ``memory`` (per rank), ``reductions`` (the
gradient reduction, traffic, the optimizer step), ``notes``; ``plan.make_plan`` runs
them in order; ``sweep`` plans many layouts; ``collectives`` times NCCL's algorithms.
"""

from .hardware import GB, Hardware, cut_hardware, nodes_from_hostfile
from .memory import StageMemory, check_fits
from .model import gradient_bytes
from .plan import Plan, make_plan
from .reductions import GroupTraffic

__all__ = ["GB", "GroupTraffic", "Hardware", "Plan", "StageMemory", "check_fits", "cut_hardware", "gradient_bytes",
           "make_plan", "nodes_from_hostfile"]
