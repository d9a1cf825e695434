"""The compressed reduction inside DeepSpeed's pipeline engines.

``CompressedReduction`` is mixed into every seekspeed engine class (1F1B, DualPipeV,
dualpipev-zb, dualpipe). With ``engine.grad_reducer`` unset (compressor ``none``)
every method falls through to DeepSpeed's own. Set, it takes over the two places
where DeepSpeed reduces data-parallel gradients at the accumulation boundary:

- ``buffered_allreduce_fallback``: ZeRO 0 (fp32, fp16, bf16) and DeepSpeed's
  BF16_Optimizer (bf16 with ZeRO 1); the gradients and expert groups are the ones
  DeepSpeed would reduce, averaged over the same groups by the same factors;
- ZeRO 1 in fp32/fp16 (DeepSpeedZeroOptimizer): the gradients are averaged first,
  then the optimizer's own reduction runs with its communication replaced by the
  identity (it needs ``zero_optimization.reduce_scatter`` false, which
  ``prepare_config`` sets), so it copies its partition out as usual.
"""

import torch.distributed as tdist
from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE

from .reducer import GradientReducer


def prepare_config(ds_config, section, *, log=print):
    """DeepSpeed config changes the compressed reduction needs (in place)."""
    if section.compressor == "none":
        return ds_config
    zero = ds_config.setdefault("zero_optimization", {})
    bf16 = ds_config.get("bf16", {}).get("enabled", False)
    if zero.get("stage", 0) == 1 and not bf16 and zero.get("reduce_scatter", True):
        zero["reduce_scatter"] = False
        log("comm: zero_optimization.reduce_scatter set to false (ZeRO 1 copies its partition out of the "
            "gradients seekspeed has already averaged)")
    return ds_config


def _identity_reduction(tensor, communication_data_type):
    return tensor


class CompressedReduction:
    grad_reducer = None

    def _compressed_reduce(self, non_expert, expert):
        from deepspeed.utils import groups
        reducer = self.grad_reducer
        reducer.begin_step()
        at = dict(micro_step=self.micro_steps, boundary=self.is_gradient_accumulation_boundary())
        dp_group = self.mpu.get_data_parallel_group()
        reducer.reduce(list(non_expert), group=dp_group, divide_by=tdist.get_world_size(dp_group), key="dense",
                       **at)
        if self.has_moe_layers:
            dp_world = tdist.get_world_size(groups._get_data_parallel_group())
            for name, grads in expert.items():
                reducer.reduce(list(grads), group=groups._get_expert_data_parallel_group(name), divide_by=dp_world,
                               key=("expert", name), hierarchical=False, **at)
        reducer.end_step()

    def buffered_allreduce_fallback(self, grads=None, elements_per_buffer=500000000):
        if self.grad_reducer is None:
            return super().buffered_allreduce_fallback(grads=grads, elements_per_buffer=elements_per_buffer)
        if grads is not None:
            non_expert, expert = grads, {}
        elif hasattr(self.optimizer, "get_grads_for_reduction"):
            non_expert, expert = self.optimizer.get_grads_for_reduction()
        else:
            non_expert, expert = self._get_gradients_for_reduction()
        self._compressed_reduce(non_expert, expert)

    def allreduce_gradients(self, bucket_size=MEMORY_OPT_ALLREDUCE_SIZE):
        zero1 = (self.grad_reducer is not None and self.zero_optimization_stage() == 1
                 and hasattr(self.optimizer, "reduce_gradients") and not self.using_bf16_optimizer)
        if not zero1 or not self.is_gradient_accumulation_boundary():
            return super().allreduce_gradients(bucket_size=bucket_size)
        if getattr(self.optimizer, "reduce_scatter", False):
            raise RuntimeError("compressed reduction with ZeRO 1 needs zero_optimization.reduce_scatter false "
                               "(ds_ext.comm.prepare_config sets it)")
        non_expert, expert = self._get_gradients_for_reduction()
        self._compressed_reduce(non_expert, expert)
        self.optimizer.gradient_reduction_w_predivide = _identity_reduction
        try:
            super().allreduce_gradients(bucket_size=bucket_size)
        finally:
            del self.optimizer.gradient_reduction_w_predivide


def install(engine, section, *, node_of=None, log=print):
    """Attach a GradientReducer for ``section`` (a ``seekspeed.comm`` section) to
    ``engine``; collective over the world when ``section.hierarchical``. ``node_of``:
    node of each global rank (default: consecutive blocks of LOCAL_WORLD_SIZE)."""
    import os
    from ds_ext.topology.groups import NodeGroups
    if section.compressor == "none":
        engine.grad_reducer = None
        return None
    world = tdist.get_world_size()
    if node_of is None:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        node_of = [r // per_node for r in range(world)]
    node_groups = None
    if section.hierarchical:
        try:
            node_groups = NodeGroups.for_subsets(node_of, engine.grid.dp_groups)
        except ValueError as exc:
            from ds_ext.errors import ConfigError
            raise ConfigError(f"seekspeed.comm.hierarchical: {exc}; set hierarchical to false or change "
                              f"seekspeed.topology.placement") from None
    spans = {}
    if node_groups is not None:
        spans = {node_groups.intra_group: False, node_groups.rail_group: node_groups.num_nodes > 1}
    reducer = GradientReducer(section, node_groups=node_groups, spans_nodes=spans, node_of=node_of,
                              seed=0)
    engine.grad_reducer = reducer
    if tdist.get_rank() == 0:
        shape = (f"hierarchical: {node_groups.num_nodes} node(s) x {node_groups.local_size} rank(s) per data-parallel "
                 f"group" if node_groups is not None else "flat")
        log(f"comm: data-parallel gradients through {section.compressor} ({shape}, chunks of {section.chunk_mb:g} MB, "
            f"{section.pipeline_depth} in flight, dense under {section.min_numel} elements"
            + (f", dense for the first {section.warmup_steps} steps" if section.warmup_steps else "") + ")")
    return reducer
