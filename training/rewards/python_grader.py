"""`python`: the author's own `grade(sample, item) -> float`, compatible with OpenAI's grader.

    {"type": "python", "name": "length", "source": "def grade(sample, item):\\n    return ..."}

`sample` is a dict: `output_text`, `output_json` (the parsed output, or None), `output_tools`,
`messages`; `item` is the task's item. The code runs in the sandbox (`sandbox.py`), never in this
process: one sandboxed interpreter per batch, a fresh one after a sample kills it. Validation
compiles the source (compiling does not run it), checks that it defines `grade` and that its import
statements name only the standard-library modules on the grader's list (`sandbox.ALLOWED_MODULES`).
That list is a convenience (an early, readable error), not the security control: code can reach
other modules at run time through `__builtins__` and friends, and what it then meets is the OS
boundary described in `sandbox.py` (empty tmpfs root, uid nobody, no fork, no network, rlimits),
which is THE control. `image_tag` (OpenAI's) is accepted and ignored: there is one sandbox image,
this interpreter's standard library.

The reward is `grade()`'s number, which must be finite and, when the spec declares
`"range": [min, max]`, within it; anything else (NaN, inf, 7 on a 0..1 scale) is a
`python_grader_runtime_error` on the sample with the reason, never a reward.
"""

from __future__ import annotations

import ast
import time
from typing import Any, ClassVar

from training.rewards.base import Field, Grader, GradeResult, Sample, attempt, range_problems
from training.rewards.sandbox import ALLOWED_MODULES, MAX_SOURCE_BYTES, RUNTIME_ERROR, PythonSandbox


class PythonGrader(Grader):
    type: ClassVar[str] = "python"
    fields: ClassVar[dict[str, Field]] = {
        "source": Field("string", required=True),
        "image_tag": Field("string"),
        "range": Field("number_list"),
    }
    reward_error_code: ClassVar[str] = RUNTIME_ERROR

    @classmethod
    def check_spec(cls, spec: dict[str, Any], path: str) -> list[dict[str, str]]:
        problems = range_problems(spec, path)
        if "source" in spec:
            problems += [
                {"path": f"{path}.source", "message": message} for message in source_problems(spec["source"])
            ]
        return problems

    def reward_range(self) -> tuple[float, float] | None:
        bounds = self.spec.get("range")
        return (bounds[0], bounds[1]) if bounds else None

    def score(self, sample: Sample, item: dict[str, Any]) -> float:
        with PythonSandbox(self.spec["source"], self.runtime.sandbox) as sandbox:
            return sandbox.grade(sample.to_grader_dict(), item)

    def grade_batch(self, samples: list[Sample], items: list[dict[str, Any]]) -> list[GradeResult]:
        if len(samples) != len(items):
            raise ValueError(f"got {len(samples)} samples but {len(items)} items")
        results = []
        with PythonSandbox(self.spec["source"], self.runtime.sandbox) as sandbox:
            for sample, item in zip(samples, items, strict=True):
                started = time.perf_counter()
                outcome = attempt(sandbox.grade, sample.to_grader_dict(), item)
                results.append(self.result(outcome, started))
        return results


def source_problems(source: str) -> list[str]:
    """Everything wrong with a grader's source that can be seen without running it."""
    size = len(source.encode("utf-8", "surrogatepass"))
    if size > MAX_SOURCE_BYTES:
        return [f"is {size} bytes; the limit is {MAX_SOURCE_BYTES}"]
    try:
        tree = ast.parse(source, "<grader>")
        compile(tree, "<grader>", "exec")
    except SyntaxError as error:
        return [f"syntax error at line {error.lineno}, column {error.offset}: {error.msg}"]
    except (ValueError, RecursionError, MemoryError) as error:  # NUL bytes, absurd nesting
        return [f"does not compile: {error}"]
    problems = []
    defines_grade = any(
        (isinstance(node, ast.FunctionDef) and node.name == "grade")
        or (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "grade" for t in node.targets)
        )
        for node in tree.body
    )
    if not defines_grade:
        problems.append("must define a top-level function grade(sample, item)")
    allowed = ", ".join(ALLOWED_MODULES)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = ["." * node.level + (node.module or "")]
        else:
            continue
        for module in modules:
            if module.split(".")[0] not in ALLOWED_MODULES:
                problems.append(
                    f"line {node.lineno}: module {module!r} is not on the python grader's module list "
                    f"(allowed: {allowed})"
                )
    return problems
