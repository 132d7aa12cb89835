"""The run page's Cost line: device-hours, tokens and judge tokens, and the price only when the
operator set one ("not priced" otherwise, never a cost of 0)."""

from __future__ import annotations

import pytest
from django.test import Client

from projects.models import StepMetrics
from tests import factories

pytestmark = pytest.mark.django_db


@pytest.fixture
def run(alpha_setup):
    run = factories.RunFactory(model=alpha_setup.model, task_set=alpha_setup.task_set,
                               environment=alpha_setup.environment, reward=alpha_setup.reward)  # fmt: skip
    for step, seconds in ((1, 3600.0), (2, 1800.0)):
        StepMetrics.objects.create(run=run, step=step, metrics={
            "device_kind": "gpu", "device_count": 2.0, "device_seconds": seconds, "completion_tokens": 300.0,
            "trainable_tokens": 200.0, "judge_prompt_tokens": 40.0, "judge_completion_tokens": 2.0,
        })  # fmt: skip
    return run


def _cost_line(cast, run) -> str:
    client = Client()
    client.force_login(cast.bob)  # a viewer sees it too
    page = client.get(f"/runs/{run.pk}/").content.decode()
    start = page.index('class="cost-line"')
    return " ".join(page[start : page.index("</p>", start)].split())


def test_cost_line_without_prices_says_not_priced(cast, run):
    line = _cost_line(cast, run)
    assert 'data-priced="no"' in line and "not priced" in line
    assert "1.5 device-hours (1.5 GPU)" in line
    assert "1000 tokens (600 sampled, 400 trained)" in line and "84 judge tokens" in line


def test_cost_line_with_a_gpu_price_shows_it(cast, run, settings):
    settings.PRICE_PER_GPU_HOUR = 2.0
    settings.COST_CURRENCY = "EUR"
    line = _cost_line(cast, run)
    assert 'data-priced="yes"' in line and "3 EUR (not priced: tokens, judge_tokens)" in line


def test_a_run_without_steps_has_no_cost_line(cast, alpha_setup):
    run = factories.RunFactory(model=alpha_setup.model, task_set=alpha_setup.task_set,
                               environment=alpha_setup.environment, reward=alpha_setup.reward)  # fmt: skip
    client = Client()
    client.force_login(cast.alice)
    assert "cost-line" not in client.get(f"/runs/{run.pk}/").content.decode()
