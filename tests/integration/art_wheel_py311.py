"""Rewrites a pure-Python wheel that needs Python >= 3.12 only for PEP 695 syntax (and typing's
3.12 names) into one that installs and imports on 3.11: test-only, for OpenPipe ART's client
(openpipe-art 0.5.23 declares ``Requires-Python: >=3.12``; these machines have 3.11). Standard
library only.

    python art_wheel_py311.py openpipe_art-0.5.23-py3-none-any.whl -o OUT_DIR

writes OUT_DIR/<same wheel name> with
- ``type X[T] = V`` as ``X = typing_extensions.TypeAliasType("X", (V), type_params=(T,))``,
- ``def f[T: B](...)`` / ``class C[T](Base)`` as module-level (or enclosing-function-level)
  ``T = typing_extensions.TypeVar("T", bound=(B), infer_variance=True)`` before the statement (and
  its decorators), with ``Generic[T]`` added to a class's bases,
- ``Requires-Python`` relaxed to ``>=3.11`` and RECORD's hashes recomputed,
- ``from typing import override`` (any name this interpreter's typing lacks: run the converter
  with the Python it targets) as an import of that name from typing_extensions,
and refuses (exit 1, file:line) whatever it cannot rewrite faithfully: a type parameter name that
the module also uses outside the generic statement (the module-level TypeVar would clobber it), a
generic statement in a class body, or any converted file that 3.11's ``compile()`` rejects.

It works on tokens (``tokenize`` reads PEP 695 source on 3.11; ``ast`` does not) and edits the text
at token positions, so everything else is byte for byte the original. Differences from 3.12 that
remain: alias values and bounds are evaluated eagerly (an import catches a forward reference),
TypeVars are names of the enclosing scope, and a generic ``def``'s lines shift by the inserted one.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import re
import sys
import tokenize
import typing
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

MODULE = "_pep695"  # the alias typing_extensions is imported under, on each inserted line
IMPORT = f"import typing_extensions as {MODULE}"
SKIPPED = {tokenize.NL, tokenize.COMMENT}


class ConversionError(Exception):
    pass


@dataclass
class TypeParam:
    kind: str  # "" (TypeVar), "*" (TypeVarTuple), "**" (ParamSpec)
    name: str
    bound: str | None = None
    default: str | None = None

    def definition(self) -> str:
        if self.kind == "*":
            call = f'{MODULE}.TypeVarTuple("{self.name}"'
        elif self.kind == "**":
            call = f'{MODULE}.ParamSpec("{self.name}"'
        else:
            call = f'{MODULE}.TypeVar("{self.name}"'
            if self.bound is not None:
                call += _bound_arguments(self.bound)
            call += ", infer_variance=True"
        if self.default is not None:
            call += f", default=({self.default})"
        return f"{self.name} = {call})"

    def in_subscript(self) -> str:
        return f"*{self.name}" if self.kind == "*" else self.name


def _bound_arguments(text: str) -> str:
    """``T: (A, B)`` are constraints (a parenthesised tuple), anything else is a bound."""
    tokens = _significant(text)
    parenthesised = tokens and tokens[0].string == "(" and _matching(tokens, 0) == len(tokens) - 1
    if parenthesised and any(tokens[i].string == "," for i in _top_level(tokens, 1, len(tokens) - 1)):
        return f", *{text.strip()}"
    return f", bound=({text.strip()})"


def _significant(text: str) -> list[tokenize.TokenInfo]:
    readline = io.StringIO(text).readline
    ignored = SKIPPED | {tokenize.NEWLINE, tokenize.ENDMARKER, tokenize.INDENT, tokenize.DEDENT}
    return [t for t in tokenize.generate_tokens(readline) if t.type not in ignored]


def _matching(tokens: list, index: int) -> int:
    """The index of the bracket closing the one at ``index``."""
    depth = 0
    for i in range(index, len(tokens)):
        if tokens[i].string in "([{" and tokens[i].type == tokenize.OP:
            depth += 1
        elif tokens[i].string in ")]}" and tokens[i].type == tokenize.OP:
            depth -= 1
            if depth == 0:
                return i
    raise ConversionError(f"line {tokens[index].start[0]}: unbalanced bracket")


def _top_level(tokens: list, start: int, stop: int):
    """Indices in [start, stop) at bracket depth 0 relative to ``start``."""
    depth = 0
    for i in range(start, stop):
        text = tokens[i].string
        if tokens[i].type == tokenize.OP and text in ")]}":
            depth -= 1
        if depth == 0:
            yield i
        if tokens[i].type == tokenize.OP and text in "([{":
            depth += 1


@dataclass
class Converter:
    source: str
    name: str
    tokens: list = field(init=False)
    line_offsets: list = field(init=False)
    edits: list = field(default_factory=list)  # (start offset, end offset, replacement)
    scopes: list = field(default_factory=list)  # (first token index, last token index, names)
    rewritten: list = field(default_factory=list)  # what was rewritten, "line: kind name"

    def __post_init__(self) -> None:
        try:
            self.tokens = list(tokenize.generate_tokens(io.StringIO(self.source).readline))
        except (tokenize.TokenError, SyntaxError) as exc:
            raise ConversionError(f"{self.name}: cannot tokenize: {exc}") from exc
        self.line_offsets = [0]
        for line in self.source.splitlines(keepends=True):
            self.line_offsets.append(self.line_offsets[-1] + len(line))

    def offset(self, position: tuple[int, int]) -> int:
        return self.line_offsets[position[0] - 1] + position[1]

    def where(self, index: int) -> str:
        return f"{self.name}:{self.tokens[index].start[0]}"

    def convert(self) -> str:
        blocks: list[str] = []  # kind of each enclosing indented block: "class", "def", "other"
        header = "other"  # the kind of the statement whose block an INDENT would open
        decorators_from: int | None = None  # first decorator of the statement being decorated
        at_statement_start = True
        for index, token in enumerate(self.tokens):
            if token.type in SKIPPED:
                continue
            if token.type == tokenize.INDENT:
                blocks.append(header)
                continue
            if token.type == tokenize.DEDENT:
                blocks.pop()
                continue
            if token.type == tokenize.NEWLINE or (token.type == tokenize.OP and token.string == ";"):
                at_statement_start = True
                continue
            if not at_statement_start:
                continue
            at_statement_start = False
            if token.string == "@":
                decorators_from = index if decorators_from is None else decorators_from
                continue
            first = index if decorators_from is None else decorators_from
            decorators_from = None
            keyword = index + 1 if token.string == "async" else index
            word = self.tokens[keyword].string if keyword < len(self.tokens) else ""
            header = {"def": "def", "class": "class"}.get(word, "other")
            following = [t.string for t in self.tokens[keyword + 1 : keyword + 3]]
            kind = None
            if token.type == tokenize.NAME and token.string == "type" and len(following) == 2:
                if self.tokens[index + 1].type == tokenize.NAME and following[1] in ("[", "="):
                    kind = "alias"
            elif word in ("def", "class") and len(following) == 2 and following[1] == "[":
                kind = word
            if [t.string for t in self.tokens[index : index + 3]] == ["from", "typing", "import"]:
                self.typing_import(index)
            if kind is None:
                continue
            if blocks and blocks[-1] == "class":
                raise ConversionError(f"{self.where(index)}: a PEP 695 {kind} in a class body")
            if kind == "alias":
                self.alias(index)
            else:
                self.generic(first, keyword, kind)
        self.check_names()
        for index, token in enumerate(self.tokens[:-2]):
            if token.string == "typing" and self.tokens[index + 1].string == ".":
                attribute = self.tokens[index + 2].string
                if index and self.tokens[index - 1].string == ".":
                    continue
                if self.tokens[index + 2].type == tokenize.NAME and not hasattr(typing, attribute):
                    raise ConversionError(f"{self.where(index)}: typing.{attribute} is not in this Python")
        text = self.source
        for start, end, replacement in sorted(self.edits, reverse=True):
            text = text[:start] + replacement + text[end:]
        return text

    def typing_import(self, index: int) -> None:
        """``from typing import override`` (3.12): those names come from typing_extensions."""
        names = []  # (first token, last token, name, alias)
        i = index + 3
        while (
            self.tokens[i].type not in (tokenize.NEWLINE, tokenize.ENDMARKER) and self.tokens[i].string != ";"
        ):
            token = self.tokens[i]
            if token.type == tokenize.NAME:
                if self.tokens[i + 1].string == "as":
                    names.append((i, i + 2, token.string, self.tokens[i + 2].string))
                    i += 3
                    continue
                names.append((i, i, token.string, None))
            i += 1
        end = max(j for j in range(index, i) if self.tokens[j].type not in SKIPPED)
        missing = [entry for entry in names if not hasattr(typing, entry[2])]
        if not missing:
            return
        if len(missing) == len(names):
            module = self.tokens[index + 1]
            self.edits.append((self.offset(module.start), self.offset(module.end), "typing_extensions"))
        else:
            for first, last, _, _ in missing:
                stop = last + 1  # the name, its alias and the comma after it
                while self.tokens[stop].type in SKIPPED:
                    stop += 1
                start_at = self.tokens[first].start
                if self.tokens[stop].string == ",":
                    stop_at = self.tokens[stop].end
                else:  # the last name: the comma before it goes (``import a, b`` cannot end in ",")
                    stop_at = self.tokens[last].end
                    before = first - 1
                    while self.tokens[before].type in SKIPPED:
                        before -= 1
                    if self.tokens[before].string == ",":
                        start_at = self.tokens[before].start
                self.edits.append((self.offset(start_at), self.offset(stop_at), ""))
            moved = ", ".join(
                name if alias is None else f"{name} as {alias}" for _, _, name, alias in missing
            )
            self.edits.append(
                (self.offset(self.tokens[end].end),) * 2 + (f"; from typing_extensions import {moved}",)
            )
        self.rewritten.append(
            f"{self.tokens[index].start[0]}: typing import {', '.join(m[2] for m in missing)}"
        )

    def type_params(self, open_index: int) -> tuple[list[TypeParam], int]:
        close = _matching(self.tokens, open_index)
        params: list[TypeParam] = []
        start = open_index + 1
        significant = [i for i in range(start, close) if self.tokens[i].type not in SKIPPED]
        commas = [i for i in _top_level(self.tokens, start, close) if self.tokens[i].string == ","]
        for lo, hi in zip([start, *(c + 1 for c in commas)], [*commas, close], strict=True):
            items = [i for i in significant if lo <= i < hi]
            if not items:
                continue  # a trailing comma
            kind = ""
            if self.tokens[items[0]].string in ("*", "**"):
                kind, items = self.tokens[items[0]].string, items[1:]
            name = self.tokens[items[0]]
            if name.type != tokenize.NAME:
                raise ConversionError(f"{self.where(items[0])}: unexpected type parameter {name.string!r}")
            param = TypeParam(kind, name.string)
            top = set(_top_level(self.tokens, items[0], hi))
            rest = [i for i in items[1:] if i in top]
            equals = next((i for i in rest if self.tokens[i].string == "="), None)
            colon = next((i for i in rest if self.tokens[i].string == ":"), None)
            if colon is not None:
                param.bound = self.text(colon + 1, equals if equals is not None else hi)
            if equals is not None:
                param.default = self.text(equals + 1, hi)
            params.append(param)
        if not params:
            raise ConversionError(f"{self.where(open_index)}: empty type parameter list")
        return params, close

    def text(self, first: int, stop: int) -> str:
        """The source from token ``first`` up to (not including) token ``stop``."""
        return self.source[self.offset(self.tokens[first].start) : self.offset(self.tokens[stop].start)]

    def alias(self, index: int) -> None:
        name = self.tokens[index + 1].string
        params: list[TypeParam] = []
        equals = index + 2
        if self.tokens[equals].string == "[":
            params, close = self.type_params(equals)
            equals = close + 1
        if self.tokens[equals].string != "=":
            raise ConversionError(f"{self.where(index)}: expected '=' in type alias {name}")
        end = equals + 1  # the last token of the value: before the logical line's NEWLINE or ';'
        depth = 0
        while True:
            token = self.tokens[end]
            if token.type == tokenize.OP and token.string in "([{":
                depth += 1
            elif token.type == tokenize.OP and token.string in ")]}":
                depth -= 1
            if depth == 0 and (
                token.type in (tokenize.NEWLINE, tokenize.ENDMARKER)
                or (token.type == tokenize.OP and token.string == ";")
            ):
                break
            end += 1
        last = max(i for i in range(equals + 1, end) if self.tokens[i].type not in SKIPPED)
        prefix = "; ".join([IMPORT, *(p.definition() for p in params)])
        opening = f'{prefix}; {name} = {MODULE}.TypeAliasType("{name}", ('
        closing = "))"
        if params:
            closing = f"), type_params=({', '.join(p.name for p in params)},))"
        start_offset = self.offset(self.tokens[index].start)
        self.edits.append((start_offset, self.offset(self.tokens[equals].end), opening))
        self.edits.append((self.offset(self.tokens[last].end), self.offset(self.tokens[last].end), closing))
        self.scopes.append((index, last, {p.name for p in params}))
        self.rewritten.append(f"{self.tokens[index].start[0]}: type {name}")

    def generic(self, first: int, keyword: int, kind: str) -> None:
        name = self.tokens[keyword + 1].string
        params, close = self.type_params(keyword + 2)
        open_offset = self.offset(self.tokens[keyword + 2].start)
        self.edits.append((open_offset, self.offset(self.tokens[close].end), ""))
        if kind == "class":
            generic = f"{MODULE}.Generic[{', '.join(p.in_subscript() for p in params)}]"
            after = close + 1
            if self.tokens[after].string == "(":
                self.add_base(after, generic)
            else:
                self.edits.append((self.offset(self.tokens[close].end),) * 2 + (f"({generic})",))
        # The preamble line goes before the statement (and its decorators), at its indentation.
        row, column = self.tokens[first].start
        indent = self.source[self.line_offsets[row - 1] : self.line_offsets[row - 1] + column]
        if indent.strip():
            raise ConversionError(f"{self.where(first)}: a generic {kind} that does not start its line")
        preamble = indent + "; ".join([IMPORT, *(p.definition() for p in params)]) + "\n"
        self.edits.append((self.line_offsets[row - 1], self.line_offsets[row - 1], preamble))
        self.scopes.append((first, self.block_end(close), {p.name for p in params}))
        self.rewritten.append(f"{self.tokens[keyword].start[0]}: {kind} {name}")

    def add_base(self, open_index: int, generic: str) -> None:
        """``Generic[...]`` after the last positional base, before any keyword argument."""
        close = _matching(self.tokens, open_index)
        top = [i for i in _top_level(self.tokens, open_index + 1, close)]
        keyword_at = next(
            (
                i
                for i in top
                if self.tokens[i].string == "**"
                or (
                    self.tokens[i].type == tokenize.NAME
                    and i + 1 < close
                    and self.tokens[i + 1].string == "="
                    and (i == open_index + 1 or self.tokens[i - 1].string == ",")
                )
            ),
            None,
        )
        if keyword_at is not None:
            self.edits.append((self.offset(self.tokens[keyword_at].start),) * 2 + (f"{generic}, ",))
            return
        body = [i for i in range(open_index + 1, close) if self.tokens[i].type not in SKIPPED]
        if not body:
            self.edits.append((self.offset(self.tokens[close].start),) * 2 + (generic,))
        elif self.tokens[body[-1]].string == ",":
            self.edits.append((self.offset(self.tokens[body[-1]].end),) * 2 + (f" {generic}",))
        else:
            self.edits.append((self.offset(self.tokens[body[-1]].end),) * 2 + (f", {generic}",))

    def block_end(self, index: int) -> int:
        """The last token of the compound statement whose header contains token ``index``."""
        while self.tokens[index].type != tokenize.NEWLINE:
            index += 1
        following = index + 1
        while following < len(self.tokens) and self.tokens[following].type in SKIPPED:
            following += 1
        if following >= len(self.tokens) or self.tokens[following].type != tokenize.INDENT:
            return index  # a one-line body
        depth = 0
        for i in range(following, len(self.tokens)):
            if self.tokens[i].type == tokenize.INDENT:
                depth += 1
            elif self.tokens[i].type == tokenize.DEDENT:
                depth -= 1
                if depth == 0:
                    return i
        return len(self.tokens) - 1

    def check_names(self) -> None:
        """A type parameter bound in the module's scope must not be a name the module uses."""
        names = set().union(*(names for _, _, names in self.scopes)) if self.scopes else set()
        for index, token in enumerate(self.tokens):
            if token.type != tokenize.NAME or token.string not in names:
                continue
            if index and self.tokens[index - 1].string == ".":
                continue  # an attribute (tensor.T), not the name
            if not any(lo <= index <= hi and token.string in scoped for lo, hi, scoped in self.scopes):
                raise ConversionError(
                    f"{self.where(index)}: {token.string!r} is a type parameter elsewhere in this "
                    "module and also a name here: rewriting would clobber it"
                )


def convert_source(source: str, name: str = "<source>") -> tuple[str, list[str]]:
    converter = Converter(source, name)
    text = converter.convert()
    try:
        compile(text, name, "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise ConversionError(f"{name}:{exc.lineno}: still not 3.11 syntax: {exc.msg}") from exc
    return text, converter.rewritten


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def convert_wheel(wheel: Path, out_dir: Path, requires_python: str = ">=3.11") -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / wheel.name
    if target.resolve() == wheel.resolve():
        raise ConversionError("the output directory must not hold the input wheel")
    errors: list[str] = []
    files: list[tuple[zipfile.ZipInfo, bytes]] = []
    record_name = None
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            data = archive.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                record_name = info.filename
                continue
            if info.filename.endswith(".py"):
                try:
                    source = data.decode("utf-8")
                    text, rewritten = convert_source(source, info.filename)
                except (ConversionError, UnicodeDecodeError) as exc:
                    errors.append(str(exc))
                    continue
                if rewritten:
                    print(f"{info.filename}: {', '.join(rewritten)}")
                data = text.encode("utf-8")
            elif info.filename.endswith(".dist-info/METADATA"):
                text, count = re.subn(
                    r"^Requires-Python:.*$", f"Requires-Python: {requires_python}",
                    data.decode("utf-8"), count=1, flags=re.MULTILINE,
                )  # fmt: skip
                if not count:
                    errors.append(f"{info.filename}: no Requires-Python line")
                data = text.encode("utf-8")
            files.append((info, data))
    if record_name is None:
        errors.append(f"{wheel.name}: no RECORD")
    if errors:
        raise ConversionError("\n".join(errors))
    record = "".join(f"{info.filename},{_record_hash(data)},{len(data)}\n" for info, data in files)
    record += f"{record_name},,\n"
    partial = target.with_suffix(".partial")
    with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for info, data in files:
            archive.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
        archive.writestr(record_name, record, compress_type=zipfile.ZIP_DEFLATED)
    partial.replace(target)
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("-o", "--out-dir", type=Path, required=True)
    parser.add_argument("--requires-python", default=">=3.11")
    args = parser.parse_args()
    try:
        target = convert_wheel(args.wheel, args.out_dir, args.requires_python)
    except ConversionError as exc:
        print(f"cannot convert {args.wheel.name}:\n{exc}", file=sys.stderr)
        return 1
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
