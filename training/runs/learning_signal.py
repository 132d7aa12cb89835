"""Is the run learning anything? A watch over each step's rewards that says so when it is not.

GRPO learns only from groups whose samples scored differently. A step where every group scored
alike (every sample the same reward, or only identical rewards within each group), or whose update
had a zero gradient, teaches nothing; a run made of such steps "succeeds" while learning nothing,
which is what a reward the base model never reaches looks like. ``SignalWatch.observe`` counts those
steps and, after ``patience`` in a row, returns one warning (then again only once the run has had a
signal and lost it). Likewise for each named sub-grader of a ``multi`` reward that gave every sample
of a step the same score: it cannot tell samples apart, so it adds nothing to the reward's signal.
Pure Python: the loop (training.runs.loop) emits the warnings as run events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

NO_SIGNAL = "no learning signal: every group had the same reward — see the trajectory viewer"


@dataclass
class SignalWarning:
    message: str
    data: dict[str, Any]


def _same(values: list[float]) -> bool:
    return bool(values) and max(values) - min(values) <= 1e-9


def _format(value: float) -> str:
    return f"{value:.3g}"


@dataclass
class SignalWatch:
    patience: int  # signal-less steps in a row before warning
    grader_name: str = "reward"
    quiet_steps: int = 0
    warned: bool = False
    grader_quiet: dict[str, int] = field(default_factory=dict)
    grader_warned: set[str] = field(default_factory=set)

    def observe(self, *, step: int, groups: list[list[Any]], metrics: dict[str, Any]) -> list[SignalWarning]:
        """One finished step: ``groups`` of graded trajectories (``reward``, ``sub_rewards``) and the
        update's metrics (``zero_variance_fraction``, ``grad_norm``). Returns the warnings due now."""
        rewards = [float(t.reward) for group in groups for t in group]
        all_equal = _same(rewards)
        no_group = all(_same([float(t.reward) for t in group]) for group in groups)
        zero_gradient = not no_group and float(metrics.get("grad_norm") or 0.0) == 0.0
        warnings: list[SignalWarning] = []
        if all_equal or no_group or zero_gradient:
            self.quiet_steps += 1
        else:
            self.quiet_steps, self.warned = 0, False
        if self.quiet_steps >= self.patience and not self.warned:
            self.warned = True
            if all_equal:
                reason, detail = "all_rewards_equal", f"every sample scored {_format(rewards[0])}"
            elif no_group:
                reason, detail = "zero_variance", "every group's samples scored alike"
            else:
                reason, detail = "zero_gradient", "the update's gradient norm was 0"
            warnings.append(
                SignalWarning(
                    f"{NO_SIGNAL} ({detail}, {self.quiet_steps} steps in a row up to step {step}; "
                    f"reward {self.grader_name})",
                    {"signal": reason, "step": step, "steps": self.quiet_steps, "grader": self.grader_name},
                )
            )
        names = sorted({name for group in groups for t in group for name in (t.sub_rewards or {})})
        # A lone grader is the reward itself: the warning above already covers it.
        for name in names if len(names) > 1 else []:
            scores = [float(t.sub_rewards[name]) for group in groups for t in group if name in t.sub_rewards]
            if _same(scores) and len(scores) == len(rewards):
                self.grader_quiet[name] = self.grader_quiet.get(name, 0) + 1
            else:
                self.grader_quiet[name] = 0
                self.grader_warned.discard(name)
            if self.grader_quiet[name] >= self.patience and name not in self.grader_warned:
                self.grader_warned.add(name)
                warnings.append(
                    SignalWarning(
                        f"grader {name!r} scored every sample {_format(scores[0])} for "
                        f"{self.grader_quiet[name]} steps in a row (up to step {step}): it tells no "
                        "sample from another — see the trajectory viewer",
                        {"signal": "grader_constant", "step": step, "grader": name, "score": scores[0]},
                    )
                )
        return warnings
