"""A model's checkpoints as stored things: the disk each takes, who uses it, deleting one, and a
prune by a retention policy (keep the last N, keep the best K by a metric) previewed as a dry run
before anything is deleted. The rules are projects.services.checkpoints' (the API's
``POST /api/v1/models/{id}/checkpoints/prune`` and ``DELETE /api/v1/checkpoints/{id}``); a
checkpoint in use is never deleted, and the page says why."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import messages
from django.http import HttpResponse
from django.shortcuts import redirect, render
from django.template.defaultfilters import filesizeformat
from django.views.decorators.http import require_POST

from frontend.access import TeamHttpRequest, can_write, get_scoped, team_view
from frontend.forms import attach_errors, call_service
from projects import selectors, services
from projects.errors import ValidationFailed
from projects.models import Checkpoint, TrainableModel

# The service's field names (``keep_best.n``) → this form's.
FIELD_FOR_SERVICE_ERROR = {
    "keep_best": "keep_best_metric",
    "keep_best.metric": "keep_best_metric",
    "keep_best.n": "keep_best_n",
    "keep_best.mode": "keep_best_mode",
}


class RetentionForm(forms.Form):
    """A retention policy as the service takes it (``services.retention_check`` checks it)."""

    keep_last = forms.IntegerField(
        required=False, label="Keep the last", help_text="the newest N checkpoints (empty: none by age)"
    )
    keep_best_metric = forms.CharField(
        required=False,
        max_length=200,
        label="Keep the best by",
        help_text="eval.<result> (the checkpoint's newest evaluation, e.g. eval.mean_reward) or a "
        "step metric (reward_mean); empty: none by metric",
        widget=forms.TextInput({"list": "metric-names", "spellcheck": "false"}),
    )
    keep_best_n = forms.IntegerField(required=False, label="How many best", help_text="K checkpoints")
    keep_best_mode = forms.ChoiceField(
        choices=[("max", "the highest"), ("min", "the lowest")],
        initial="max",
        required=False,
        label="Best is",
    )

    def policy(self) -> dict[str, Any]:
        data = self.cleaned_data
        policy: dict[str, Any] = {}
        if data["keep_last"] is not None:
            policy["keep_last"] = data["keep_last"]
        if data["keep_best_metric"] or data["keep_best_n"] is not None:
            policy["keep_best"] = {
                "metric": data["keep_best_metric"],
                "n": data["keep_best_n"],
                "mode": data["keep_best_mode"] or "max",
            }
        return policy


def _initial(model: TrainableModel) -> dict[str, Any]:
    """The model's own policy (the one applied after every step), if it has one."""
    policy = model.retention or {}
    best = policy.get("keep_best") or {}
    return {
        "keep_last": policy.get("keep_last"),
        "keep_best_metric": best.get("metric", ""),
        "keep_best_n": best.get("n"),
        "keep_best_mode": best.get("mode", "max"),
    }


def steps_text(steps: list[int]) -> str:
    return ("step " if len(steps) == 1 else "steps ") + ", ".join(map(str, steps))


@team_view()
def model_checkpoints(request: TeamHttpRequest, model_id: int) -> HttpResponse:
    """GET: the checkpoints and the form. POST ``action=preview``: the prune as a dry run (what it
    deletes, the bytes freed, what it keeps in use and why). POST ``action=prune``: the prune, if
    it still deletes what the preview showed (a step recorded meanwhile changes the answer: then
    the new preview is shown instead)."""
    model = get_scoped(TrainableModel, request, model_id)
    form = RetentionForm(request.POST or None, initial=_initial(model))
    preview: services.PruneResult | None = None
    changed = False
    if request.method == "POST" and form.is_valid():
        try:
            preview = services.checkpoints_prune(model=model, policy=form.policy(), dry_run=True)
            if request.POST.get("action") == "prune":
                if request.POST.get("previewed") == ",".join(map(str, preview.deleted)):
                    result = services.checkpoints_prune(model=model, policy=form.policy())
                    _report(request, result)
                    return redirect("frontend:model-checkpoints", model_id=model.pk)
                changed = True
        except ValidationFailed as exc:
            attach_errors(form, exc, rename=FIELD_FOR_SERVICE_ERROR)
            preview = None
    checkpoints = list(Checkpoint.objects.filter(model=model).select_related("run").order_by("-step"))
    in_use = selectors.checkpoint_users(model=model, checkpoints=checkpoints)
    sizes = {c.step: selectors.checkpoint_storage_bytes(checkpoint=c) for c in checkpoints}
    rows = [{"checkpoint": c, "bytes": sizes[c.step], "in_use": in_use.get(c.step, "")} for c in checkpoints]
    return render(
        request,
        "frontend/model_checkpoints.html",
        {
            "model": model,
            "rows": rows,
            "disk_bytes": selectors.model_storage_bytes(model=model),
            "form": form,
            "metric_names": selectors.checkpoint_metric_names(model=model),
            "can_write": can_write(request),
            "preview": _preview_context(preview, sizes) if preview is not None else None,
            "changed": changed,
        },
    )


def _preview_context(result: services.PruneResult, sizes: dict[int, int]) -> dict[str, Any]:
    return {
        "deleted": [(step, sizes.get(step, 0)) for step in result.deleted],
        "previewed": ",".join(map(str, result.deleted)),
        "kept": result.kept,
        "in_use": sorted(result.in_use.items()),
        "freed_bytes": result.freed_bytes,
    }


def _report(request: TeamHttpRequest, result: services.PruneResult) -> None:
    if result.deleted:
        freed = filesizeformat(result.freed_bytes)
        messages.success(request, f"Deleted {steps_text(result.deleted)}; {freed} freed.")
    else:
        messages.info(request, "Nothing deleted: the policy keeps every checkpoint.")
    for step, reason in sorted(result.in_use.items()):
        messages.warning(request, f"Kept step {step}: {reason}.")


@require_POST
@team_view()
def checkpoint_delete(request: TeamHttpRequest, checkpoint_id: int) -> HttpResponse:
    """One checkpoint (``DELETE /api/v1/checkpoints/{id}``); one in use is refused, saying why."""
    checkpoint = get_scoped(Checkpoint, request, checkpoint_id)
    freed = filesizeformat(selectors.checkpoint_storage_bytes(checkpoint=checkpoint))
    call_service(
        request,
        lambda: services.checkpoint_delete(checkpoint=checkpoint),
        success=f"Deleted step {checkpoint.step}; {freed} freed.",
    )
    return redirect("frontend:model-checkpoints", model_id=checkpoint.model_id)
