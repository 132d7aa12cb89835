"""The rules every grader shares through `Grader.result`: a reward is a finite number, inside the
grader's declared range when it declares one; anything else is an error entry with the reason."""

import math
from typing import Any, ClassVar

import pytest

from training.rewards.base import Grader, Sample


class Fixed(Grader):
    type: ClassVar[str] = "fixed"

    def __init__(self, value: float, bounds: tuple[float, float] | None = None) -> None:
        super().__init__({"name": "fixed", "error_reward": -1.0})
        self.value, self.bounds = value, bounds

    def reward_range(self) -> tuple[float, float] | None:
        return self.bounds

    def score(self, sample: Sample, item: dict[str, Any]) -> float:
        return self.value


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_reward_is_an_error_for_every_grader(value):
    result = Fixed(value).grade(Sample(output_text=""), {})
    assert result.reward == -1.0 and result.sub_rewards == {"fixed": -1.0}
    [error] = result.errors
    assert error["code"] == "grader_internal_error" and "is not a finite number" in error["detail"]


def test_a_declared_range_bounds_the_reward():
    inside = Fixed(1.0, (0.0, 1.0)).grade(Sample(output_text=""), {})
    assert inside.reward == 1.0 and not inside.errors
    outside = Fixed(1.5, (0.0, 1.0)).grade(Sample(output_text=""), {})
    assert outside.reward == -1.0
    assert outside.errors[0]["detail"] == "the reward 1.5 is outside the declared range [0, 1]"
