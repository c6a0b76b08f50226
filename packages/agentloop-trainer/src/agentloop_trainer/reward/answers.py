"""Reading the final answer out of what an instruct model wrote, in the forms such models use:
``#### N``, ``\\boxed{N}``, "the answer is N" / "answer: N" / "the final answer is $N$", and,
as the last resort, the final number of the text.

The built-in scorers use this for ``reward.answer_format`` ``flexible``; ``strict`` keeps each
task's one canonical form (:func:`agentloop_trainer.reward.rule.answer_reward`,
:func:`agentloop_trainer.reward.answers.boxed_reward`).

The text is model output, so it is hostile input: nothing here raises on any string, and the
work is bounded whatever its length. Only the last :data:`MAX_SCAN_CHARS` characters are read
(the answer that counts is the last one), every pattern is linear in what it scans, and each
answer statement is read from a window of at most :data:`MAX_STATEMENT_CHARS` characters.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

MAX_SCAN_CHARS = 20_000
"""Characters read from the end of a response; an answer written earlier than that is not seen."""
MAX_STATEMENT_CHARS = 200
"""Characters read after "the answer is" (the statement ends earlier at a sentence end or a newline)."""
_MAX_BOXED_CHARS = 1000
"""A longer box holds no answer; normalising it would cost time on hostile text."""
_TRIES = 20
"""Statements of one form tried, latest first, before giving up on that form (hostile text can
hold thousands of "answer is" with nothing usable after them)."""

ANSWER_FORMS = ("####", "boxed", "statement", "last_number")
"""What :class:`FoundAnswer.form` can be."""

# A number as people write it: thousands commas only in groups of three (so "1,2,3" is not 123),
# an optional decimal part, a sign (ASCII or the Unicode minus). Not part of a word or a version.
_NUMBER = re.compile(r"(?<![\w.])[-\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\d)")
_HASHES = re.compile(r"####")
_BOX = re.compile(r"\\(?:boxed|fbox)")
_BARE_BOX = re.compile(r"\s*([^\s${}]+)")
_CUE = re.compile(
    r"\b(?:final\s+answer|answer|solution)s?\b[*_\s]*"
    r"(?:(?:is|are|was|would\s+be|will\s+be|should\s+be|equals)\b|[:=])[:=*_\s]*",
    re.IGNORECASE,
)
_SENTENCE_END = re.compile(r"[.!?;](?=\s|$)|\n")
_MARKUP = "*_`$ \t"
_FILLER = re.compile(
    r"^(?:(?:approximately|about|around|roughly|exactly|just|only|therefore|thus|so|then|equal\s+to|"
    r"[a-zA-Z]\s*=)\s*)*")
_CONTINUES = re.compile(r"^\s*(?:[-+*/\u00d7\u00f7^=]\s*[\d(]|\d)")
_PROSE = re.compile(r"[A-Za-z]{2,}\s+[A-Za-z]{2,}")
_TEX_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def _balanced(text: str, start: int) -> tuple[str, int] | None:
    """``(content, start of content)`` of the ``{...}`` that opens right after ``start``, braces
    balanced; None when there is none or it never closes."""
    i = start
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text) or text[i] != "{":
        m = _BARE_BOX.match(text, start)  # "\boxed 5"
        return (m.group(1), m.start(1)) if m else None
    depth = 0
    for j in range(i, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j], i + 1
    return None


def _balanced_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``), braces balanced."""
    starts = [m for m in (_last_match(_BOX, text),) if m is not None]
    if not starts:
        return None
    found = _balanced(text, starts[0].end())
    return found[0] if found else None


def _last_match(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    last = None
    for last in pattern.finditer(text):  # noqa: B007 - the last one is wanted
        pass
    return last


_STRIP = [(r"\\left|\\right|\\!|\\,|\\;|\\:|\\\$|\$", ""), (r"\\[dt]frac", r"\\frac"), (r"\^\{\\circ\}|\^\\circ", ""),
          (r"\\text\{\s*([^}]*)\}", r"\1"), (r"\\mbox\{\s*([^}]*)\}", r"\1"), (r"\s+", "")]


def normalize_math_answer(answer: str) -> str:
    """A MATH answer in a canonical spelling: no spacing commands, ``\\dfrac`` -> ``\\frac``,
    no ``\\text{}`` wrappers or dollar signs, no trailing period, no whitespace."""
    s = answer.strip()
    for pattern, repl in _STRIP:
        s = re.sub(pattern, repl, s)
    s = s.rstrip(".")
    s = re.sub(r"^([a-zA-Z]\w*)=", "", s)  # "x=5" -> "5"
    return re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)  # "\frac12" -> "\frac{1}{2}"


def _as_number(s: str) -> float | None:
    """``s`` as a number (``\\frac{a}{b}``, ``a/b``, ``1,000``, ``50%``), or None."""
    if len(s) > 64:  # no answer is that long a number, and the pattern below backtracks on long runs
        return None
    m = re.fullmatch(r"\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", s)
    try:
        if m:
            return float(m.group(1)) / float(m.group(2))
        if re.fullmatch(r"-?[\d,]*\.?\d+(/\d+)?%?", s):
            s = s.replace(",", "").rstrip("%")
            if "/" in s:
                a, b = s.split("/")
                return float(a) / float(b)
            return float(s)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def boxed_reward(solution_text: str, ground_truth: Any) -> float:
    """1.0 when the last ``\\boxed{}`` answer equals ``ground_truth`` (itself boxed or plain)
    after normalisation, or numerically; else 0.0."""
    predicted = _balanced_boxed(solution_text)
    if predicted is None or len(predicted) > _MAX_BOXED_CHARS:
        return 0.0
    truth = str(ground_truth)
    truth = _balanced_boxed(truth) or truth
    a, b = normalize_math_answer(predicted), normalize_math_answer(truth)
    if a == b:
        return 1.0
    x, y = _as_number(a), _as_number(b)
    return 1.0 if x is not None and y is not None and math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-9) else 0.0


@dataclass(frozen=True)
class FoundAnswer:
    """The answer a response gives, as written."""

    text: str
    """The answer, markup around it removed (``56``, ``\\frac{1}{2}``, ``56 apples``)."""
    form: str
    """How it was written: one of :data:`ANSWER_FORMS`."""
    position: int
    """Where in the (scanned tail of the) response it starts; the latest answer wins."""


def _clean(span: str) -> str:
    """An answer span without surrounding markup: markdown emphasis, dollars, ``\\( \\)``,
    ``\\[ \\]``, a trailing full stop."""
    s = span.strip()
    for opener, closer in (("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(opener):
            s = s[len(opener):]
        if s.endswith(closer):
            s = s[: -len(closer)]
    return s.strip(_MARKUP).rstrip(".").strip(_MARKUP)


def leading_number(answer: str) -> float | None:
    """The number an answer states: the one it starts with (after "x =", "approximately",
    ``$`` and markup), when what follows does not continue an expression ("56 apples", "$18.00",
    "19 (12 + 7)" count; "12 + 7" does not), else the number after its last ``=``
    ("12 + 7 = 19"). None when it states none."""
    s = _TEX_WRAPPERS.sub(r" \1", _clean(answer[:MAX_STATEMENT_CHARS]))
    for part in (s, s.rsplit("=", 1)[1] if "=" in s else None):
        if part is None:
            continue
        part = _FILLER.sub("", _clean(part).replace("\\$", "").lstrip("$ "))
        m = _NUMBER.match(part)
        if m and not _CONTINUES.match(part[m.end():]):
            return _to_float(m.group())
    return None


def _to_float(number: str) -> float | None:
    try:
        value = float(number.replace(",", "").replace("\u2212", "-"))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _last_hashes(text: str) -> FoundAnswer | None:
    for m in list(_HASHES.finditer(text))[::-1][:_TRIES]:
        rest = text[m.end() : m.end() + MAX_STATEMENT_CHARS].lstrip(_MARKUP + "\n")
        number = _NUMBER.match(rest.replace("\\$", "").lstrip("$ "))
        if number:
            return FoundAnswer(number.group(), "####", m.start())
    return None


def _last_boxed(text: str) -> FoundAnswer | None:
    for m in list(_BOX.finditer(text))[::-1][:3]:
        found = _balanced(text, m.end())
        if found is not None and found[0].strip():
            return FoundAnswer(_clean(found[0]), "boxed", m.start())
    return None


def _last_statement(text: str, after: int) -> FoundAnswer | None:
    """The latest "the answer is X" whose X is usable, starting after position ``after``."""
    for m in list(_CUE.finditer(text))[::-1][:_TRIES]:
        if m.start() <= after:
            return None
        window = text[m.end() : m.end() + MAX_STATEMENT_CHARS]
        end = _SENTENCE_END.search(window)
        span = _clean(window[: end.start()] if end else window)
        # Usable: a number it states, or a short non-prose answer ("\frac{1}{2}", "(B)", "Monday")
        # for string matching; "the solution is to add 12 and 7" states nothing.
        if span and (leading_number(span) is not None or not _PROSE.search(span)):
            return FoundAnswer(span, "statement", m.start())
    return None


def find_answer(text: Any, last_number: bool = True) -> FoundAnswer | None:
    """The final answer of ``text``: the latest of ``#### N``, ``\\boxed{...}`` and "the answer
    is X" (and close variants: "answer: X", "the final answer is $X$", "**Answer:** X", "the
    solution is X"); when there is none, the last number of the text (unless ``last_number``
    is False: a response cut by a token limit ends mid-thought, and its last number is no
    answer). None when it has no answer at all. Never raises; reads only the last
    :data:`MAX_SCAN_CHARS` characters."""
    if not isinstance(text, str):
        return None
    tail = text[-MAX_SCAN_CHARS:]
    try:
        found = [a for a in (_last_hashes(tail), _last_boxed(tail)) if a is not None]
        latest = max((a.position for a in found), default=-1)
        statement = _last_statement(tail, latest)
        if statement is not None:
            found.append(statement)
        if found:
            return max(found, key=lambda a: a.position)
        if not last_number:
            return None
        numbers = list(_NUMBER.finditer(tail))
        return FoundAnswer(numbers[-1].group(), "last_number", numbers[-1].start()) if numbers else None
    except (RecursionError, MemoryError, ValueError):  # pragma: no cover - defensive: hostile input
        return None


def truth_text(ground_truth: Any) -> str:
    """The ground truth as an answer string: a GSM8K solution's part after ``####``, and the
    content of a boxed truth."""
    s = str(ground_truth).strip()
    if "####" in s:
        s = s.rsplit("####", 1)[1]
    found = _last_boxed(s)
    return _clean(found.text if found else s)


def answers_match(answer: str, ground_truth: Any) -> bool:
    """Whether ``answer`` states ``ground_truth``: the same after MATH normalisation
    (:func:`~agentloop_trainer.reward.answers.normalize_math_answer`), or the same number (commas,
    ``$``, a trailing ``.0`` and units like "56 apples" do not matter)."""
    truth = truth_text(ground_truth)
    if not truth:
        return False
    a, b = leading_number(answer), leading_number(truth)
    if a is not None and b is not None:
        return _close(a, b)
    x, y = normalize_math_answer(answer[:MAX_STATEMENT_CHARS]), normalize_math_answer(truth)
    if x == y:
        return True
    # "\frac{3}{4}" vs 0.75, "3/4" vs "0.75", "50%" vs 50
    x_value, y_value = _as_number(x), (b if b is not None else _as_number(y))
    return x_value is not None and y_value is not None and _close(x_value, y_value)


def _close(a: float, b: float) -> bool:
    # Absolute as the strict scorer compares, relative only at float precision: 999,999 is not 10^6.
    return abs(a - b) <= 1e-6 or math.isclose(a, b, rel_tol=1e-12)


def flexible_reward(solution_text: Any, ground_truth: Any, truncated: bool = False) -> float:
    """1.0 when the final answer of ``solution_text`` (:func:`find_answer`) states
    ``ground_truth`` (:func:`answers_match`), else 0.0; a ``truncated`` response (cut by a
    token limit) counts only an answer it states, not its last number. Never raises."""
    found = find_answer(solution_text, last_number=not truncated)
    return 1.0 if found is not None and answers_match(found.text, ground_truth) else 0.0


__all__ = ["ANSWER_FORMS", "MAX_SCAN_CHARS", "FoundAnswer", "answers_match", "boxed_reward", "find_answer",
           "flexible_reward", "leading_number", "normalize_math_answer", "truth_text"]
