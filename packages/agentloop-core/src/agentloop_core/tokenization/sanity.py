"""The tokenization sanity check: built trajectory ids against a re-tokenization of the
rendered conversation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from agentloop_core.tokenization.renderer import ChatRenderer

SanityCheckMode = Literal["strict", "ignore_strippable", "disable"]
SANITY_CHECK_MODES: tuple[str, ...] = ("strict", "ignore_strippable", "disable")

_WINDOW = 12  # tokens shown either side of the first mismatch


@dataclass(frozen=True)
class SanityCheckReport:
    """Outcome of comparing a trajectory's ids with the template's rendering of its messages."""

    ok: bool
    """True when the trajectory passes under ``mode``."""
    mode: str
    """The mode the check ran in."""
    reason: str = ""
    """Why it failed, or a note on why it passed despite a difference."""
    expected_text: str = ""
    """Decoded reference tokens around the first mismatch."""
    actual_text: str = ""
    """Decoded trajectory tokens around the first mismatch."""
    first_mismatch: int | None = None
    """Index (in prompt_ids + response_ids) of the first differing token."""
    canonical: bool | None = None
    """Whether the ids also equal a plain re-tokenization of the whole text. False with ok=True
    means the engine sampled a non-canonical tokenization of its own text (normal when sampling,
    not a delta error); None when not computed."""

    def describe(self) -> str:
        """Multi-line human-readable summary, for logs and exceptions."""
        if self.ok and not self.reason:
            return f"tokenization sanity check ({self.mode}): ok"
        lines = [f"tokenization sanity check ({self.mode}): {'ok' if self.ok else 'MISMATCH'}: {self.reason}"]
        if self.first_mismatch is not None:
            lines.append(f"  first mismatching token index: {self.first_mismatch}")
            lines.append(f"  expected (template re-tokenized): {self.expected_text!r}")
            lines.append(f"  actual   (trajectory):            {self.actual_text!r}")
        return "\n".join(lines)


def check_mode(mode: str) -> None:
    """Raise ValueError naming the valid modes when ``mode`` is not one of them."""
    if mode not in SANITY_CHECK_MODES:
        raise ValueError(f"sanity_check must be one of {SANITY_CHECK_MODES}, got {mode!r}")


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _squash(text: str) -> str:
    return "".join(text.split())


def compare(
    renderer: ChatRenderer,
    built: list[int],
    expected: list[int],
    *,
    mode: str,
    canonical: bool | None,
    note: str = "",
) -> SanityCheckReport:
    """Compare built ids with reference ids under ``mode``.

    Args:
        renderer: Decodes ids for the report.
        built: The trajectory's ids (prompt + response).
        expected: The reference ids.
        mode: ``strict`` or ``ignore_strippable``.
        canonical: Passed through to the report.
        note: Context added to the reason (e.g. which reference was used).

    Returns:
        The report.
    """
    if built == expected:
        return SanityCheckReport(ok=True, mode=mode, reason=note, canonical=canonical)
    i = _first_difference(built, expected)
    lo = max(0, i - _WINDOW)
    expected_text = renderer.decode(expected[lo : i + _WINDOW])
    actual_text = renderer.decode(built[lo : i + _WINDOW])
    reason = (
        f"trajectory has {len(built)} tokens, re-tokenized template render has {len(expected)}; "
        f"first difference at token {i}"
    )
    if note:
        reason += f" ({note})"
    ok = False
    if mode == "ignore_strippable" and _squash(renderer.decode(built)) == _squash(renderer.decode(expected)):
        ok = True
        reason = "differs only in whitespace, ignored in ignore_strippable mode; " + reason
    return SanityCheckReport(
        ok=ok,
        mode=mode,
        reason=reason,
        expected_text=expected_text,
        actual_text=actual_text,
        first_mismatch=i,
        canonical=canonical,
    )
