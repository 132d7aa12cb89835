"""Numbers by magnitude (projects.formatting): what events, templates and chart ticks show."""

from __future__ import annotations

import pytest

from projects.formatting import format_number
from projects.services.steps import _step_message


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (0, "0"),
        (-0.0, "0"),
        (347.0, "347"),
        (347, "347"),
        (0.625, "0.625"),
        (0.123456, "0.1235"),
        (12.3456, "12.35"),
        (1234.56, "1235"),
        (-1.3e-6, "-1.3e-6"),
        (1.30004e-6, "1.3e-6"),
        (2.5e-10, "2.5e-10"),
        (12_345_678.9, "1.235e+7"),
        (None, "–"),
        (True, "–"),
        ("x", "–"),
    ],
)
def test_numbers_are_formatted_by_magnitude(value, shown):
    assert format_number(value) == shown


def test_more_digits_on_request():
    assert format_number(1.30004e-6, 6) == "1.30004e-6"
    assert format_number(0.6254, 3) == "0.625"


def test_step_event_shows_a_tiny_loss_without_rounding_it_to_minus_zero():
    message = _step_message("Step 3/20", {"reward_mean": 0.5, "loss": -2.4e-7, "trainable_tokens": 12.0})
    assert message == "Step 3/20: reward 0.5, loss -2.4e-7"


def test_step_event_says_when_a_step_made_no_update():
    message = _step_message("Step 1/20", {"reward_mean": 0.0, "loss": 0.0, "trainable_tokens": 0.0})
    assert message == "Step 1/20: reward 0, no update (every group had the same reward)"


def test_a_step_without_rollouts_says_its_loss_and_held_out_loss():
    assert _step_message("Step 2/8", {"loss": 1.25, "trainable_tokens": 9.0}) == "Step 2/8: loss 1.25"
    message = _step_message("Step 8/8", {"loss": 0.5, "heldout_loss": 0.75, "trainable_tokens": 9.0})
    assert message == "Step 8/8: loss 0.5, held-out loss 0.75"
