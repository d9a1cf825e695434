"""Progress lines (step, loss, tokens/s, ETA) and the end-of-run summary."""

import resource
import sys
import time


def fmt_duration(seconds):
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Progress:

    def __init__(self, *, start_step, total_steps, tokens_per_step, log_interval, enabled, out=None):
        self.start_step = start_step
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self.log_interval = log_interval
        self.enabled = enabled
        self.out = out
        self.t0 = time.perf_counter()
        self.last_t, self.last_step = self.t0, start_step
        self.losses = []          # (step, loss) for every step of this run
        self.step_times = []
        self._prev = self.t0

    def is_log_step(self, step):
        return step % self.log_interval == 0 or step == self.total_steps or step == self.start_step + 1

    def update(self, step, loss, *, lr=None, extra=None):
        """Record optimizer step ``step`` (1-based) and print every ``log_interval`` steps."""
        now = time.perf_counter()
        self.step_times.append(now - self._prev)
        self._prev = now
        self.losses.append((step, loss))
        if not self.is_log_step(step):
            return
        interval = max(now - self.last_t, 1e-9)
        tok_s = (step - self.last_step) * self.tokens_per_step / interval
        done = step - self.start_step
        eta = (now - self.t0) / done * (self.total_steps - step) if done else 0.0
        self.last_t, self.last_step = now, step
        if self.enabled:
            lr_part = f" | lr {lr:.2e}" if lr is not None else ""
            extra_part = f" | {extra}" if extra else ""
            print(f"step {step:>{len(str(self.total_steps))}}/{self.total_steps} | loss {loss:.4f} | "
                  f"{tok_s:,.0f} tok/s{lr_part} | elapsed {fmt_duration(now - self.t0)} | eta {fmt_duration(eta)}"
                  f"{extra_part}", file=self.out or sys.stdout, flush=True)

    def summary(self):
        wall = time.perf_counter() - self.t0
        steps = len(self.losses)
        # the first step includes one-off work (buffers, p2p shape exchange): report steady state apart
        steady = self.step_times[1:] if len(self.step_times) > 1 else self.step_times
        window = max(1, min(10, steps // 5 or 1))
        first = [l for _, l in self.losses[:window]]
        last = [l for _, l in self.losses[-window:]]
        return {
            "steps": steps,
            "start_step": self.start_step,
            "final_step": self.losses[-1][0] if self.losses else self.start_step,
            "tokens": steps * self.tokens_per_step,
            "wall_s": wall,
            "tokens_per_s": steps * self.tokens_per_step / wall if wall > 0 else 0.0,
            "steady_tokens_per_s": len(steady) * self.tokens_per_step / sum(steady) if steady else 0.0,
            "loss_first": sum(first) / len(first) if first else None,
            "loss_last": sum(last) / len(last) if last else None,
            "loss_window": window,
            "losses": [l for _, l in self.losses],
        }
