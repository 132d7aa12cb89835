import pytest

from training.rewards import GraderSpecError, GradingError, Sample, grade, validate_grader
from training.rewards.templates import Template, TemplateSyntaxError

ITEM = {"answer": "Paris", "meta": {"tags": ["geo", {"level": 3}]}, "answers": ["a", "b"], "ok": True}


def render(text, sample=None, item=ITEM):
    return Template.parse(text).render(sample or Sample(output_text="out"), item)


def test_literal_text_is_kept_as_is():
    assert render("no variables here") == "no variables here"
    assert render("a } and { b") == "a } and { b"
    assert Template.parse("plain").is_literal


def test_variables_render_inside_text_with_optional_spaces():
    assert render("City: {{item.answer}} / {{ sample.output_text }}") == "City: Paris / out"


def test_nested_paths_and_list_indices():
    assert render("{{item.meta.tags.0}}") == "geo"
    assert render("{{item.meta.tags.1.level}}") == "3"
    assert render("{{item.answers.1}}") == "b"


def test_non_string_values_render_as_json():
    assert render("{{item.ok}}") == "true"
    assert render("{{item.meta}}") == '{"tags": ["geo", {"level": 3}]}'
    sample = Sample(output_text="", output_tools=[{"name": "search", "arguments": {"q": "x"}}])
    assert render("{{sample.output_tools}}", sample) == '[{"name": "search", "arguments": {"q": "x"}}]'


def test_sample_messages_and_output_json_paths():
    sample = Sample(
        output_text='{"answer": {"city": "Paris"}, "steps": [1, 2]}',
        messages=[{"role": "user", "content": "Capital of France?"}],
    )
    assert render("{{sample.output_json.answer.city}}", sample) == "Paris"
    assert render("{{sample.output_json.steps.1}}", sample) == "2"
    assert render("{{sample.messages.0.content}}", sample) == "Capital of France?"


@pytest.mark.parametrize("path", ["item.missing", "item.answers.2", "item.answer.0", "item.answers.-1"])
def test_missing_item_path_is_a_template_error_naming_the_path(path):
    with pytest.raises(GradingError) as caught:
        render("{{" + path + "}}")
    assert caught.value.code == "template_error"
    assert path in caught.value.detail


def test_output_json_parse_error_only_when_a_template_uses_it():
    spec = {"type": "string_check", "input": "{{sample.output_json.a}}", "reference": "1", "operation": "eq"}
    result = grade(spec, Sample(output_text="not json"), {})
    assert result.reward == 0.0
    assert [error["code"] for error in result.errors] == ["sample_parse_error"]
    text_spec = {**spec, "input": "{{sample.output_text}}", "reference": "not json"}
    assert grade(text_spec, Sample(output_text="not json"), {}).errors == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{{item.answer", "unclosed"),
        ("{{}}", "invalid variable"),
        ("{{item..a}}", "invalid variable"),
        ("{{sample.output}}", "unknown variable"),
        ("{{answer}}", "unknown variable"),
        ("{{sample.output_text.x}}", "has no fields"),
    ],
)
def test_template_syntax_errors(text, message):
    with pytest.raises(TemplateSyntaxError, match=message):
        Template.parse(text)


def test_template_syntax_errors_are_validation_problems_on_the_field():
    spec = {"type": "string_check", "input": "{{sample.text}}", "reference": "{{item.a", "operation": "eq"}
    with pytest.raises(GraderSpecError) as caught:
        validate_grader(spec)
    assert [problem["path"] for problem in caught.value.problems] == ["grader.input", "grader.reference"]
