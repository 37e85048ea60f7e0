"""``HybridPatternError``: a ``ValueError`` that shows where a pattern is wrong and how to fix it.

>>> err = HybridPatternError(
...     "'[' at position 2 opens a layer group that is never closed",
...     pattern="*E[*E",
...     position=2,
...     expected="']' after the group's layer symbols",
...     hint="close the group, e.g. '[*E]'",
... )
>>> print(err)
'[' at position 2 opens a layer group that is never closed
  pattern: '*E[*E'
              ^
  expected: ']' after the group's layer symbols
  fix: close the group, e.g. '[*E]'
>>> isinstance(err, ValueError), err.position
(True, 2)
"""

from __future__ import annotations

__all__ = ["HybridPatternError", "display_char"]

_PREFIX = "  pattern: "
# Longest excerpt of the pattern shown in a message; long patterns get a window around the error.
_WINDOW = 72


def display_char(char: str) -> str:
    """Return ``char`` as it appears in messages: ASCII as is, anything else escaped.

    Escaping keeps one column per displayed character, so the caret line stays aligned.

    >>> display_char("M"), display_char("\\t"), display_char("\\u00e9")
    ('M', '\\\\t', '\\\\xe9')
    """
    if " " <= char <= "~":
        return char
    return char.encode("unicode_escape").decode("ascii")


def _excerpt(pattern: str, position: int | None) -> tuple[str, int | None]:
    """Return the quoted (possibly shortened) pattern and the caret column inside it."""
    centre = 0 if position is None else min(position, len(pattern))
    # Only characters within _WINDOW of the centre can be shown: escape no more than those, so a
    # pattern of millions of characters costs no more than a short one.
    lo = max(0, centre - _WINDOW)
    shown = [display_char(c) for c in pattern[lo : centre + _WINDOW]]
    local = centre - lo
    start, end = 0, len(shown)
    if sum(map(len, shown)) > _WINDOW:
        start = max(0, local - _WINDOW // 2)
        end = min(len(shown), start + _WINDOW)
        start = max(0, min(start, end - _WINDOW))
    head = "..." if lo + start > 0 else ""
    tail = "..." if lo + end < len(pattern) else ""
    text = f"{head}'{''.join(shown[start:end])}'{tail}"
    if position is None:
        return text, None
    # +1 for the opening quote; a position equal to len(pattern) points just past the end.
    column = len(head) + 1 + sum(map(len, shown[start:local]))
    return text, column


class HybridPatternError(ValueError):
    """A hybrid layer pattern that cannot be parsed, or cannot be laid out as asked.

    Attributes:
        message: What is wrong, in one line.
        pattern: The pattern exactly as the user wrote it.
        position: 0-based index into ``pattern`` of the first character that cannot be accepted
            (``len(pattern)`` when something is missing at the end); ``None`` for errors about
            the whole pattern (differing MTP parts, ``*`` with ``D``/``+``, the size limit).
        expected: What was expected at ``position``, in a few words (``None`` if not useful).
        hint: How to fix it (``None`` if not useful).
    """

    def __init__(
        self,
        message: str,
        pattern: str,
        position: int | None = None,
        expected: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.message = message
        self.pattern = pattern
        self.position = position
        self.expected = expected
        self.hint = hint
        super().__init__(self._render())

    def _render(self) -> str:
        text, column = _excerpt(self.pattern, self.position)
        lines = [self.message, f"{_PREFIX}{text}"]
        if column is not None:
            lines.append(" " * (len(_PREFIX) + column) + "^")
        if self.expected:
            lines.append(f"  expected: {self.expected}")
        if self.hint:
            lines.append(f"  fix: {self.hint}")
        return "\n".join(lines)

    def __reduce__(self):  # noqa: D105 - keeps the attributes when pickled (multiprocessing)
        return type(self), (self.message, self.pattern, self.position, self.expected, self.hint)
