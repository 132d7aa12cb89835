"""tests/integration/art_wheel_py311.py turns PEP 695 source (and typing's 3.12 names) into source
that Python 3.11 compiles and runs with the same meaning, turns a wheel into an installable 3.11
one, and refuses what it cannot rewrite faithfully. Hand-written inputs; no network."""

from __future__ import annotations

import base64
import hashlib
import typing
import zipfile

import pytest

from tests.integration.art_wheel_py311 import ConversionError, convert_source, convert_wheel

GENERIC_SOURCE = '''"""doc"""
from __future__ import annotations
import typing
from typing import Protocol, Any, override
type Alias = int | str  # a comment
type Boxed[T] = list[T]
type Call[K: (int, str), *Ts, **P] = typing.Callable[P, tuple[K, *Ts]]
x = 1; type Recursive = dict[str, "Recursive"]
type Defaulted[U: int = int] = (
    list[U]
)

@staticmethod
@typing.overload
def first[V](x: V) -> V: ...
def first[V](x: V) -> V:
    return x

class Getter[W](Protocol):
    def get(self) -> W: ...

class Pair[X, Y: str,]:
    def left(self, x: X) -> X:
        return x

class Keyed[Z](dict, metaclass=type):
    pass

async def nested[R](x: R) -> R:
    type Local = list[R]
    return x

class Base:
    def run(self) -> int:
        return 1

class Child(Base):
    @override
    def run(self) -> int:
        return 2
'''


def run(source: str) -> dict:
    text, _ = convert_source(source, "sample.py")
    namespace: dict = {"__name__": "sample"}
    exec(compile(text, "sample.py", "exec"), namespace)
    return namespace


def test_pep_695_source_runs_on_311_with_its_type_parameters():
    ns = run(GENERIC_SOURCE)
    assert ns["Alias"].__value__ == int | str and ns["Alias"].__name__ == "Alias"
    boxed = ns["Boxed"]
    assert [p.__name__ for p in boxed.__type_params__] == ["T"] and typing.get_args(boxed[int]) == (int,)
    k, ts, p = ns["Call"].__type_params__
    assert k.__constraints__ == (int, str) and type(ts).__name__ == "TypeVarTuple"
    assert type(p).__name__ == "ParamSpec"
    assert str(ns["Recursive"].__value__) == "dict[str, 'Recursive']"
    (u,) = ns["Defaulted"].__type_params__
    assert u.__bound__ is int and u.__default__ is int
    assert ns["first"](3) == 3
    assert ns["Getter"].__parameters__[0].__name__ == "W" and ns["Getter"]._is_protocol
    x, y = ns["Pair"].__parameters__
    assert (x.__name__, y.__name__, y.__bound__) == ("X", "Y", str)
    assert issubclass(ns["Keyed"], dict) and ns["Keyed"].__parameters__[0].__name__ == "Z"
    assert ns["Child"]().run() == 2 and ns["Child"].run.__override__ is True


def test_a_module_without_pep_695_is_left_byte_for_byte():
    source = "import typing\n\ndef f(type):  # a parameter named type\n    return type(1)\n"
    assert convert_source(source)[0] == source


def test_typing_import_keeps_other_names_and_line_numbers():
    source = "from typing import (\n    Any,\n    override,\n)\nfrom typing import Any as A, override as ov\n"
    text, rewritten = convert_source(source)
    assert text.count("\n") == source.count("\n")
    assert "from typing_extensions import override" in text and "override as ov" in text
    assert rewritten == ["1: typing import override", "5: typing import override"]


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("T = 1\ndef f[T](x: T): pass\n", "clobber"),
        ("class A:\n    type X = int\n", "class body"),
        ("import typing\n@typing.override\ndef f(): pass\n", "typing.override"),
    ],
)
def test_what_cannot_be_rewritten_faithfully_is_refused(source, reason):
    with pytest.raises(ConversionError, match=reason):
        convert_source(source)


def test_a_wheel_is_rewritten_with_relaxed_requires_python_and_a_true_record(tmp_path):
    wheel = tmp_path / "in" / "pkg-1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("pkg/__init__.py", "type Alias = int\n")
        archive.writestr("pkg-1.0.dist-info/METADATA", "Name: pkg\nVersion: 1.0\nRequires-Python: >=3.12\n")
        archive.writestr("pkg-1.0.dist-info/RECORD", "stale\n")
    target = convert_wheel(wheel, tmp_path / "out")
    with zipfile.ZipFile(target) as archive:
        assert "Requires-Python: >=3.11" in archive.read("pkg-1.0.dist-info/METADATA").decode()
        record = archive.read("pkg-1.0.dist-info/RECORD").decode().splitlines()
        for line in record:
            name, digest, size = line.rsplit(",", 2)
            if name.endswith("RECORD"):
                assert digest == size == ""
                continue
            data = archive.read(name)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert digest == f"sha256={expected}" and int(size) == len(data)
        compile(archive.read("pkg/__init__.py"), "pkg/__init__.py", "exec")
