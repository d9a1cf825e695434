"""What each training step reports: the progress line (loss, lr, loss parts, MoE
expert load, the compressed reduction), a row of the run report (metrics.csv and
DeepSpeed's monitor), and the figures the run summary keeps."""

from .errors import SeekspeedError
from .log import rank0_log
from .progress import Progress


class StepMetrics:
    """One run's per-step reporting. ``window`` is the profile window the report gathers
    at the end (StepTrace's); ``batches`` the timed data iterator (None on ranks that
    read no data). Creating it opens the report directory (all ranks, collective)."""

    def __init__(self, plan, engine, control, *, window, batches, start, rank, dp_rank):
        s = plan.section
        self.engine, self.control, self.batches, self.rank, self.dp_rank = engine, control, batches, rank, dp_rank
        self.comm, self.tokens_per_step = s.comm, plan.layout.tokens_per_step
        self.recipe = plan.recipe
        self.title = f"{s.recipe.name}/{s.recipe.preset}, {s.schedule}"
        self.report = _open_report(plan, engine, control, window=window, start=start, rank=rank)
        self.progress = Progress(start_step=start, total_steps=s.train.steps, tokens_per_step=self.tokens_per_step,
                                 log_interval=s.train.log_interval, enabled=rank == 0)
        self.moe_stats, self.loss_parts, self.comm_steps, self.layer_losses = None, [], [], None

    def step(self, step, *, loss, step_s, figures=()):
        """After optimizer step ``step``: ``figures`` are the recipe's step hooks'
        (recipes.spec.StepFigures: in-layer losses, expert loads). Collective on log
        steps with in-layer losses or expert loads."""
        engine, log_step = self.engine, self.progress.is_log_step(step)
        mine, moe_update = _merge(figures, with_losses=bool(self.recipe.layer_losses))
        extra = []
        parts = engine.agg_additional_losses
        if parts and log_step:
            extra.append(" | ".join(f"{name} {float(value):.4f}" for name, value in parts.items()))
        if mine is not None and log_step:
            self.layer_losses = _layer_losses(self.control, mine if self.dp_rank == 0 else None,
                                              pair=engine.replica_groups()[1] is not None)
            extra.append(" | ".join(f"{name} {value:.4f}" for name, value in self.layer_losses.items()))
        if moe_update is not None and log_step:
            loads, balance = moe_update if self.dp_rank == 0 else (None, None)
            self.moe_stats = _moe_stats(self.control, loads, balance)
            extra.append(self.moe_stats["line"])
        if log_step and getattr(self.batches, "hot", None) is not None:
            extra.append(_hot_tier_line(self.batches.figures()))
        reducer = engine.grad_reducer
        if reducer is not None and reducer.last is not None:
            self.comm_steps.append(reducer.last.figures())
            if log_step:
                what = self.comm.compressor + ("" if self.comm.target == "gradient" else f" {self.comm.target}")
                extra.append(reducer.last.line(what + (f" ({reducer.last.dense}, dense)" if reducer.last.dense
                                                       else "")))
        self.progress.update(step, loss, lr=engine.get_lr()[0], extra=" | ".join(extra) or None)
        if parts:
            self.loss_parts.append({name: float(value) for name, value in parts.items()})
        row_parts = dict(parts or {})
        if mine is not None and log_step:
            row_parts.update(self.layer_losses)
        self._write_row(step, loss=loss, step_s=step_s, parts=row_parts,
                        moe_stats=self.moe_stats if moe_update is not None and log_step else None)

    def _write_row(self, step, *, loss, step_s, parts, moe_stats):
        engine, norm = self.engine, self.engine.get_global_grad_norm()
        row = {"step": step, "loss": loss, "tokens_per_s": self.tokens_per_step / step_s if step_s > 0 else None,
               "lr": engine.get_lr()[0], "grad_norm": None if norm is None else float(norm), "step_s": step_s,
               "data_wait_s": self.batches.take_wait() if self.batches is not None else None}
        reducer = getattr(engine, "grad_reducer", None)
        if reducer is not None and reducer.last is not None:
            row["comm_bytes"], row["comm_s"] = reducer.last.wire_bytes, reducer.last.total_s
        else:
            row["comm_bytes"], row["comm_s"] = self.report.comms_logger_step()
        for name, value in (parts or {}).items():
            row[f"loss_{name}"] = float(value)
        load = None
        if moe_stats is not None:
            row["moe_max_over_mean"] = moe_stats["max_over_mean_load"]
            load = moe_stats["expert_load"]
        self.report.write(row, expert_load=load)

    def finish(self):
        """The progress figures and the report's entry (rank 0), after the report's
        end-of-run figures (all ranks, collective)."""
        entry = self.report.finish(self.control, title=self.title)
        summary = self.progress.summary()
        if entry is not None:
            summary["report"] = entry
        return summary

    def comm_summary(self):
        """Per-rank means over the steps after warm-up of the compressed reduction's
        counters, and their totals over every step (dense ones included: the warm-up,
        0/1 Adam's refreshes); collective; None when no step reduced compressed."""
        if not self.comm_steps:
            return None
        after = self.comm_steps[self.comm.warmup_steps:] or self.comm_steps
        mine = {k: sum(st[k] for st in after) / len(after) for k in after[0]}
        ranks = self.control.gather(mine)
        totals = self.control.gather({k: sum(st[k] for st in self.comm_steps) for k in after[0]})
        return {"compressor": self.comm.compressor, "hierarchical": self.comm.hierarchical,
                "steps_averaged": len(after), "per_rank_mean_per_step": ranks,
                "steps_total": len(self.comm_steps), "per_rank_total": totals}

    def layer_loss_summary(self):
        """The last logged step's in-layer losses (RecipeSpec.layer_losses); None without."""
        return self.layer_losses

    def moe_summary(self):
        """The last logged step's MoE figures; None without MoE layers."""
        return None if self.moe_stats is None else {k: v for k, v in self.moe_stats.items() if k != "line"}


def _hot_tier_line(figures):
    """The progress line's hot-tier figures so far: the node's with a node tier, else
    this rank's."""
    node = figures.get("scope") == "node"
    rate = figures["node_hit_rate" if node else "hit_rate"]
    fetched = figures["node_bytes_fetched" if node else "bytes_fetched"]
    return (f"hot tier{' (node)' if node else ''} hit {'-' if rate is None else f'{100 * rate:.1f} %'}, "
            f"{fetched / 1e6:,.1f} MB from cold")


def _open_report(plan, engine, control, *, window, start, rank):
    from .profile.run import RunReport
    s, directory = plan.section, plan.report_dir
    extra = []
    if plan.model_config.num_mtp_layers:
        extra += ["loss_lm", "loss_mtp"]
    if plan.has_moe:
        extra += ["moe_max_over_mean"]
    extra += [f"loss_{name}" for name in plan.recipe.layer_losses]
    report, error = None, None
    try:
        report = RunReport(directory, rank=rank, start_step=start, extra_columns=extra,
                           monitor=getattr(engine, "monitor", None), window=window, plots=s.report.plots,
                           log=rank0_log(rank))
    except OSError as exc:
        error = SeekspeedError(f"report directory {directory}: {exc.strerror or exc}; choose a writable "
                               f"seekspeed.report.dir or --report-dir")
    control.stop_if_any_failed(error, rank=rank)
    if rank == 0 and directory:
        profile = plan.profile.text if plan.profile else None
        print(f"report: {directory} (metrics.csv{', plots' if s.report.plots else ''}"
              f"{f', profile of steps {profile}' if profile else ''})", flush=True)
    return report


def _merge(figures, *, with_losses):
    """(this rank's in-layer losses or None when the recipe reports none, (expert loads,
    balance loss) or None without MoE figures) from the step hooks' StepFigures."""
    losses, moe_update = ({} if with_losses else None), None
    for f in figures:
        if f.losses is not None and losses is not None:
            losses.update(f.losses)
        if f.expert_loads is not None:
            moe_update = (f.expert_loads, f.balance_loss)
    return losses, moe_update


def _moe_stats(control, loads, balance):
    """Gather each stage's per-expert loads (summed over its replicas) and balance loss;
    the line shows the worst layer's max/mean expert load."""
    gathered = control.gather((loads, balance))
    per_layer, balance_total = {}, None
    for stage_loads, stage_balance in gathered:
        per_layer.update(stage_loads or {})
        if stage_balance is not None:
            balance_total = (balance_total or 0.0) + stage_balance
    worst = max((max(l) / (sum(l) / len(l)) for l in per_layer.values() if sum(l) > 0), default=1.0)
    line = f"moe max/mean expert load {worst:.2f}"
    if balance_total is not None:
        line += f" | balance loss {balance_total:.2e}"
    return {"line": line, "max_over_mean_load": worst, "expert_load": per_layer, "balance_loss": balance_total}


def _layer_losses(control, mine, *, pair):
    """Sum the in-layer losses of data-parallel replica 0's pipeline ranks (``mine``:
    this rank's, None on other replicas). Under dualpipe the two ranks of a pair hold
    copies of the same layers, each seeing half the micro-batches: each layer's value is
    the mean of its copies'."""
    totals = {}
    for part in control.gather(mine):
        for name, value in (part or {}).items():
            totals[name] = totals.get(name, 0.0) + value
    return {name: value / 2 if pair else value for name, value in totals.items()}
