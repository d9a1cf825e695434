"""The values a recipe's layers and ds_ext exchange through the spec (recipes/spec.py):
the routed experts of a built module and the per-step hooks with what they report.
Imports nothing of the project, so layers and the spec both use it."""

from collections.abc import Callable
from dataclasses import dataclass, field


class NotCostable(ValueError):
    """A layer class the recipe's planner costs do not know."""


@dataclass(frozen=True, kw_only=True)
class RoutedExperts:
    """One MoE block's routed experts in a built module: this rank's expert parameters,
    how many experts a token picks (``top_k``) of how many (``num_experts``), and which
    of them this rank holds (``num_local`` from ``ep_rank * num_local``)."""
    parameters: tuple
    top_k: int
    num_experts: int
    ep_rank: int = 0
    num_local: int = 0


@dataclass(frozen=True, kw_only=True)
class StepFigures:
    """What a step hook reports after one optimizer step, for this rank: ``losses``
    {name: value} of in-layer losses since the last step (mean over micro-batches,
    summed over the rank's layers); ``expert_loads`` {router: tokens per expert} summed
    over the stage's copies, with ``balance_loss`` (None when off)."""
    losses: dict | None = None
    expert_loads: dict | None = None
    balance_loss: float | None = None


@dataclass(frozen=True, kw_only=True)
class StepHook:
    """A per-step mechanism of a recipe's layers. ``applies(config)``: whether the model
    has the layers it works on; ``setup(engine, *, section, grad_accum)`` once the
    engine exists (``section``: the seekspeed config section); ``after_step(engine, *,
    section)`` after each optimizer step, returning StepFigures or None; ``losses``: the
    names of the in-layer losses it reports (metrics.csv columns ``loss_<name>``).
    ``after_step`` may be collective over the engine's replica groups
    (``engine.replica_groups()``): every rank calls it every step."""
    name: str
    applies: Callable = field(default=lambda config: True)
    setup: Callable = field(default=lambda engine, *, section, grad_accum: None)
    after_step: Callable = field(default=lambda engine, *, section: None)
    losses: tuple = ()
