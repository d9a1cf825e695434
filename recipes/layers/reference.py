"""The single-process reference of a recipe's model: every layer of a spec list in one
module, what pipelined runs, exports and generation are checked against."""

from torch import nn

from .pipe import CausalLMLoss


class SequentialReference(nn.Module):
    """All layers of a spec list in one process: the single-rank reference a
    pipelined run is checked against. Tied specs share one module, as in DeepSpeed,
    and state-dict keys are a PipelineModule's ("3.self_attn.o_proj.weight",
    "tied_modules.embed.embed_tokens.weight"), so weights compare key by key."""

    def __init__(self, specs, loss_fn=None):
        super().__init__()
        self.tied_modules = nn.ModuleDict()
        self._funcs = []
        for idx, spec in enumerate(specs):
            key = getattr(spec, "key", None)
            if key is None:
                module = spec.build()
                self.add_module(str(idx), module)
                self._funcs.append(module)
                continue
            if key not in self.tied_modules:
                self.tied_modules[key] = spec.build()
            module = self.tied_modules[key]
            fn = spec.forward_fn
            self._funcs.append(module if fn is None else (lambda x, m=module, f=fn: f(m, x)))
        self.loss_fn = loss_fn or CausalLMLoss()
        self._modules_in_order = []
        for idx, spec in enumerate(specs):
            key = getattr(spec, "key", None)
            module = self.tied_modules[key] if key is not None else getattr(self, str(idx))
            if all(module is not m for m in self._modules_in_order):
                self._modules_in_order.append(module)

    def layer_modules(self):
        """Each layer's module once, in the layer list's order (a tied module at its first use)."""
        return iter(self._modules_in_order)

    def forward(self, input_ids):
        x = input_ids
        for fn in self._funcs:
            x = fn(x)
        return x
