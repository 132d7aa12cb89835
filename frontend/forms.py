"""Dashboard forms. They only shape input; every check that matters is in projects.services,
whose ValidationFailed errors are put back next to the field they name (``attach_errors``); a
button's service call reports back as the page's message (``call_service``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django import forms
from django.contrib import messages
from django.http import HttpRequest

from projects import catalog, services
from projects.errors import DomainError, ValidationFailed
from projects.models import EnvironmentKind, Role


def set_choices(form: forms.BaseForm, name: str, choices: list[tuple[Any, str]]) -> None:
    field = form.fields[name]
    assert isinstance(field, forms.ChoiceField), name
    field.choices = choices


HYPERPARAMETER_PREFIX = "hp_"


def default_text(default: Any) -> str:
    """A TrainConfig default as the form's help says it ("Default: 5e-05.")."""
    if default is None:
        return "empty"
    if isinstance(default, bool):
        return "on" if default else "off"
    return str(default)


def _hyperparameter_field(spec: dict[str, Any]) -> forms.Field:
    kind, default = spec["type"], spec["default"]
    # Said on every field: the demo run and a fork use other values, and a newcomer could not tell
    # which numbers the form had prefilled (issue 24).
    help_text = f"{spec['help']} Default: {default_text(default)}."
    optional = "None" in kind.split(" | ")  # an empty box means None
    kind = kind.replace(" | None", "")
    if "choices" in spec:
        return forms.ChoiceField(
            choices=[(c, c) for c in spec["choices"]], initial=default, help_text=help_text
        )
    if kind == "bool":
        return forms.BooleanField(required=False, initial=default, help_text=help_text)
    if kind == "int":
        return forms.IntegerField(initial=default, required=not optional, help_text=help_text)
    if kind == "float":
        widget = forms.NumberInput({"step": "any"})
        return forms.FloatField(initial=default, required=not optional, help_text=help_text, widget=widget)
    return forms.CharField(initial=default, required=not optional, help_text=help_text)


class NewRunForm(forms.Form):
    """Model, task set (pick one or upload JSONL), environment, reward, and every TrainConfig field
    prefilled with its default and help text."""

    kind = forms.ChoiceField(
        choices=[
            ("platform", "RL (GRPO): rollouts in the environment, graded by the reward"),
            (
                "sft",
                "SFT: supervised on the rows' assistant replies ('completion' or a final assistant message)",
            ),
            ("dpo", "DPO: preferences, the rows' 'chosen' over 'rejected' replies"),
        ],
        initial="platform",
        required=False,  # not sent (a script posting the form): RL, as the API's default
        label="Kind",
        help_text="SFT and DPO train on targets in the task rows; the reward grades their held-out answers.",
    )
    model = forms.TypedChoiceField(
        coerce=int,
        label="Model",
        help_text="A model with checkpoints continues from its latest one; a new one starts from its base model.",
    )
    start_from = forms.ChoiceField(
        choices=[
            ("latest", "The model's latest checkpoint (the base model when it has none)"),
            ("base", "A fresh adapter on the base model (a model without trained steps only)"),
        ],
        initial="latest",
        required=False,  # not sent (a script posting the form): the latest, as the API's default
        label="Start from",
        help_text="To train on from an older step, fork that step's run from its page.",
    )
    start_checkpoint = forms.IntegerField(
        required=False,
        min_value=1,
        label="…or the checkpoint id it must start from",
        help_text="Pins the start: refused unless it is still the model's latest checkpoint.",
    )
    task_set = forms.TypedChoiceField(coerce=int, required=False, label="Task set", empty_value=None)
    task_file = forms.FileField(
        required=False,
        label="…or upload a JSONL task set",
        help_text="A chosen file is used instead of the task set above.",
    )
    task_set_name = forms.CharField(required=False, max_length=63, label="Name of the uploaded task set")
    validation_fraction = forms.FloatField(
        initial=0.0, min_value=0.0, max_value=0.99, label="Validation fraction of the upload"
    )
    environment = forms.TypedChoiceField(coerce=int, label="Environment")
    reward = forms.TypedChoiceField(coerce=int, label="Reward definition")

    def __init__(
        self,
        *args: Any,
        choices: dict[str, list[tuple[int, str]]],
        last_used: dict[str, int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        for name in ("model", "environment", "reward"):
            set_choices(self, name, choices[name])
        set_choices(self, "task_set", [("", "— upload a new one below —"), *choices["task_set"]])
        if choices["task_set"]:  # an existing task set, the newest, rather than "upload"
            self.fields["task_set"].initial = max(pk for pk, _ in choices["task_set"])
        # What the project's last run used (selectors.project_last_run_inputs), not the newest or
        # the first of each list: a newcomer's second run keeps the first one's reward.
        for name, pk in (last_used or {}).items():
            if any(choice == pk for choice, _ in choices[name]):
                self.fields[name].initial = pk
        for name, spec in catalog.hyperparameters().items():
            self.fields[HYPERPARAMETER_PREFIX + name] = _hyperparameter_field(spec)
            self.fields[HYPERPARAMETER_PREFIX + name].label = name

    upload_saved = False  # keep_uploaded: the uploaded file's task set exists now

    def clean(self) -> dict[str, Any]:
        # A chosen file wins over the task set list, which is preselected (a newcomer's upload was
        # silently dropped for it); upload_note says so after the run starts.
        data = super().clean() or {}
        if not data.get("task_set") and not data.get("task_file"):
            self.add_error("task_set", "choose a task set or upload a JSONL file")
        if data.get("task_file") and not data.get("task_set_name"):
            self.add_error("task_set_name", "name the uploaded task set")
        # Every problem in one submit: the uploaded rows are checked here, and when anything is
        # wrong so are the hyperparameters (a bad file hid `steps: -3` until the next submit).
        # With nothing else wrong, run_create checks them after saving the upload (keep_uploaded).
        self._check_upload(data)
        if self.errors:
            try:
                services.run_config_check(config=self.config(), kind=data.get("kind") or "platform")
            except ValidationFailed as exc:
                attach_errors(self, exc)
        return data

    def _check_upload(self, data: dict[str, Any]) -> None:
        upload = data.get("task_file")
        if not upload:
            return
        try:
            text = upload.read().decode("utf-8")
        except UnicodeDecodeError as exc:
            self.add_error("task_file", f"not UTF-8 text (byte {exc.start})")
            return
        finally:
            upload.seek(0)  # read again when the task set is made
        try:
            services.task_set_rows_check(
                jsonl=text, validation_fraction=data.get("validation_fraction") or 0.0
            )
        except ValidationFailed as exc:
            attach_errors(self, exc, rename=FIELD_FOR_SERVICE_ERROR)

    def keep_uploaded(self, task_set_id: int, label: str) -> None:
        """After an error past the upload: the task set it made is saved, so select it (a browser
        cannot refill a file input, and uploading it again would clash with its name)."""
        self.fields["task_set"].choices = [*self.fields["task_set"].choices, (task_set_id, label)]  # type: ignore[attr-defined]
        self.data = self.data.copy()
        self.data["task_set"] = str(task_set_id)
        self.data["task_set_name"] = ""
        self.upload_saved = True

    def ask_for_the_file_again(self) -> None:
        """After an error before the upload was saved, say so next to the (now empty) file input."""
        if self.files.get("task_file") and not self.upload_saved:
            self.add_error("task_file", "Not saved: a browser cannot keep a chosen file, so choose it again.")

    def upload_note(self, task_set: Any) -> str:
        """For the "run queued" message: the run's task set came from the uploaded file, and which
        selected task set it took the place of."""
        if not self.cleaned_data.get("task_file"):
            return ""
        note = (
            f" on the uploaded task set “{task_set.name}” ({task_set.train_count} train / "
            f"{task_set.validation_count} validation rows)"
        )
        selected = self.cleaned_data.get("task_set")
        if selected and selected != task_set.pk:
            label = dict(self.fields["task_set"].choices).get(selected, selected)  # type: ignore[attr-defined]
            name = str(label).split(" (")[0]  # "<name> (N train / M validation rows)"; names have no space
            note += f"; the selected task set “{name}” was not used"
        return note

    def start(self) -> str | int:
        """``start_from`` for ``services.run_create``: a checkpoint id when one is given."""
        return self.cleaned_data.get("start_checkpoint") or self.cleaned_data.get("start_from") or "latest"

    def hyperparameter_fields(self) -> list[forms.BoundField]:
        return [self[name] for name in self.fields if name.startswith(HYPERPARAMETER_PREFIX)]

    def config(self) -> dict[str, Any]:
        """Only the hyperparameters the user changed: the rest keep the environment's sampling
        settings, then the TrainConfig defaults (the order ``run_create`` merges them in)."""
        return {
            name.removeprefix(HYPERPARAMETER_PREFIX): self.cleaned_data[name]
            for name in self.changed_data
            if name.startswith(HYPERPARAMETER_PREFIX) and name in self.cleaned_data  # not a field error
        }


FIELD_FOR_SERVICE_ERROR = {"file": "task_file", "name": "task_set_name"}


class ForkRunForm(forms.Form):
    """Fork a run from one of its model's checkpoints as a new model (services.run_fork); the
    hyperparameters are the run's (the API takes overrides)."""

    from_step = forms.TypedChoiceField(coerce=int, label="From checkpoint step")
    name = forms.CharField(max_length=63, label="Name of the new model")

    def __init__(self, *args: Any, steps: list[int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        set_choices(self, "from_step", [(step, f"step {step}") for step in steps])
        if steps:
            self.fields["from_step"].initial = steps[-1]


def attach_errors(form: forms.Form, error: ValidationFailed, *, rename: dict[str, str] | None = None) -> None:
    """Show each problem of a service's ValidationFailed next to the form field it names
    (``config.steps`` → ``hp_steps``; unknown fields become form-wide errors)."""
    rename = rename or {}
    for field, message in error.problems:
        name = field.split(":")[0] if field.startswith("line ") else field
        if name.startswith("config."):
            name = HYPERPARAMETER_PREFIX + name.removeprefix("config.").split(".")[0]
        elif name.startswith("line "):
            name = rename.get("file", "file")
            message = f"{field}: {message}"
        name = rename.get(name, name)
        head = name.split(".")[0].split("[")[0]
        if name in form.fields:
            form.add_error(name, message)
        elif head in form.fields:  # a path inside a JSON field: "spec.graders.fmt.operation"
            form.add_error(head, f"{name}: {message}")
        else:
            form.add_error(None, f"{field}: {message}" if field != "non_field_errors" else message)


def call_service(request: HttpRequest, action: Callable[[], object], *, success: str) -> None:
    """Run a button's service call (cancel a run, an evaluation): ``success`` or the domain error's
    message becomes the message on the page the button returns to."""
    try:
        action()
    except DomainError as exc:
        messages.error(request, exc.message)
    else:
        messages.success(request, success)


class EnvironmentForm(forms.Form):
    name = forms.CharField(max_length=63)
    kind = forms.ChoiceField(choices=EnvironmentKind.choices)
    system_prompt = forms.CharField(required=False, widget=forms.Textarea({"rows": 3}))
    max_turns = forms.IntegerField(
        required=False, min_value=1, max_value=100, help_text="empty: the kind's default"
    )
    tools = forms.CharField(
        required=False,
        widget=forms.Textarea({"rows": 2, "spellcheck": "false"}),
        help_text='JSON list, e.g. ["calculator"] (tool environments only)',
    )
    config = forms.CharField(
        required=False,
        widget=forms.Textarea({"rows": 2, "spellcheck": "false"}),
        help_text="JSON object of kind-specific settings; header values (MCP's config.headers, each "
        "http_tools tool's config.tools[i].headers) are stored encrypted and never shown again",
    )

    def clean_tools(self) -> Any:
        return _json_or_none(self.cleaned_data["tools"])

    def clean_config(self) -> Any:
        return _json_or_none(self.cleaned_data["config"])

    def service_arguments(self) -> dict[str, Any]:
        """Only what was filled in, so the service applies its own defaults for the rest."""
        return {key: value for key, value in self.cleaned_data.items() if value not in (None, "")}


def _json_or_none(raw: str) -> Any:
    if not raw.strip():
        return None
    try:  # the API's strict reader: depth, NaN, number range, lone surrogates, NUL
        return services.json_text_read(raw)
    except ValidationFailed as exc:
        raise forms.ValidationError(exc.message) from exc


class ProjectForm(forms.Form):
    name = forms.CharField(max_length=63, help_text="lowercase letters, digits, '.', '_' or '-'")
    description = forms.CharField(required=False, max_length=500)


class TrainableModelForm(forms.Form):
    name = forms.CharField(max_length=63)
    base_model = forms.TypedChoiceField(coerce=int)


class RewardDefinitionForm(forms.Form):
    name = forms.CharField(max_length=63)
    spec = forms.CharField(widget=forms.Textarea({"rows": 14, "spellcheck": "false"}))


class ApiKeyForm(forms.Form):
    name = forms.CharField(max_length=100)
    read_only = forms.BooleanField(required=False, help_text="can read but not create or change anything")


class InvitationForm(forms.Form):
    """An owner's invitation (``services.invitation_create``): nobody joins without accepting."""

    invitee = forms.CharField(
        max_length=254, label="Email or username", help_text="kept as a note for your list"
    )
    role = forms.ChoiceField(choices=Role.choices, initial=Role.MEMBER)


class MemberRoleForm(forms.Form):
    role = forms.ChoiceField(choices=Role.choices)


class ScenarioForm(forms.Form):
    """Scenario generation (``services.task_set_generate``): the service checks the
    values; the form only shapes them."""

    environment = forms.TypedChoiceField(
        coerce=int, help_text="the model writes tasks that use this environment's tools"
    )
    endpoint = forms.TypedChoiceField(
        coerce=int, label="Endpoint", help_text="one of the team's OpenAI-compatible endpoints"
    )
    model = forms.CharField(
        required=False, max_length=200, help_text="the model to call there; empty: the endpoint's default"
    )
    n = forms.IntegerField(initial=10, label="Rows", help_text="how many task rows to ask for (1 to 100)")
    instruction = forms.CharField(
        widget=forms.Textarea({"rows": 3}), help_text="what the tasks should be about, in plain words"
    )
    name = forms.CharField(
        max_length=63, label="New task set name", help_text="lowercase letters, digits, '.', '_' or '-'"
    )
    validation_fraction = forms.FloatField(
        initial=0.0, label="Validation fraction", help_text="share of the rows kept for evaluation"
    )

    def __init__(self, *args: Any, choices: dict[str, list[tuple[int, str]]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name in ("environment", "endpoint"):
            set_choices(self, name, choices[name])


# An evaluation's subject or reference is chosen from one list: "checkpoint:<id>", "base:<id>"
# (a base model without an adapter) or, for the reference only, "endpoint:<id>".
REFERENCE_NONE = ""


def split_choice(value: str) -> tuple[str, int]:
    kind, _, pk = value.partition(":")
    return kind, int(pk)


class EvaluationForm(forms.Form):
    """A queued evaluation (``services.evaluation_create``)."""

    subject = forms.ChoiceField(label="Model to evaluate")
    task_set = forms.TypedChoiceField(coerce=int, label="Task set")
    split = forms.ChoiceField(initial="validation", help_text="which rows of the task set")
    environment = forms.TypedChoiceField(coerce=int)
    reward = forms.TypedChoiceField(coerce=int, label="Reward definition")
    reference = forms.ChoiceField(
        required=False,
        label="Compare against (optional)",
        help_text="the same rows, graded the same way; the win rate is by reward per row",
    )
    reference_model = forms.CharField(
        required=False,
        max_length=200,
        label="Model on the endpoint",
        help_text="only for an endpoint reference; empty: the endpoint's default model",
    )
    pass_threshold = forms.FloatField(
        initial=1.0, help_text="a sample passes when its reward is at least this"
    )
    samples_per_row = forms.IntegerField(initial=1, label="Samples per row")
    max_rows = forms.IntegerField(required=False, label="Max rows", help_text="empty: every row of the split")
    temperature = forms.FloatField(initial=0.0, widget=forms.NumberInput({"step": "any"}))
    max_new_tokens = forms.IntegerField(
        required=False, label="Max new tokens", help_text="empty: the environment's setting"
    )

    def __init__(self, *args: Any, choices: dict[str, list[Any]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name in ("subject", "task_set", "split", "environment", "reward", "reference"):
            set_choices(self, name, choices[name])


# Service error fields (evaluation services and selectors) → the form field that shows them.
EVALUATION_FIELD_FOR_SERVICE_ERROR = {
    "model": "subject",
    "checkpoint": "subject",
    "base_model": "subject",
    "reference.model": "reference_model",
    "reference.checkpoint": "reference",
    "reference.endpoint": "reference",
}
