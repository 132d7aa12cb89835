"""Suggestions for a name that is not one of the valid ones: ``lr`` -> "did you mean
learning_rate?". One place, so the API, the forms and the config errors say it the same way."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable

LIST_AT_MOST = 12  # longer lists of valid names are left to the listing endpoint


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The valid name ``word`` most likely meant: same name in another case, an abbreviation made
    of the words' initials (``lr``), the one name with it as a word (``kl``) or that it begins, else difflib's closest."""
    names = sorted(set(choices))
    lowered = word.lower()
    same = [name for name in names if name.lower() == lowered]
    if same:
        return same[0]
    initials = [name for name in names if len(lowered) >= 2 and _initials(name) == lowered]
    if initials:
        return initials[0]
    worded = [name for name in names if lowered in re.split(r"[^a-z0-9]+", name.lower())]
    if len(worded) == 1:  # "kl" -> kl_coef
        return worded[0]
    begun = [name for name in names if len(lowered) >= 3 and name.lower().startswith(lowered)]
    if len(begun) == 1:
        return begun[0]
    close = difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    return close[0] if close else None


def unknown(what: str, word: str, choices: Iterable[str], *, quoted: bool = True) -> str:
    """ "unknown base model 'x' (valid: a, b); did you mean a?" - the valid names only when few."""
    names = sorted(set(choices))
    text = f"unknown {what} {word!r}" if quoted else f"unknown {what}"
    if names and len(names) <= LIST_AT_MOST:
        text += f" (valid: {', '.join(names)})"
    suggestion = closest(word, names)
    return f"{text}; did you mean {suggestion}?" if suggestion else text


def _initials(name: str) -> str:
    return "".join(part[0] for part in re.split(r"[^a-zA-Z0-9]+", name.lower()) if part)
