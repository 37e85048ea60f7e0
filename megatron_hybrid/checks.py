"""Checks of caller-supplied numbers, shared by every layer (no imports)."""

from __future__ import annotations

import operator
from typing import Any

__all__ = ["check_int"]


def check_int(name: str, value: Any, minimum: int = 1, *, where: str | None = None) -> int:
    """``value`` as an int >= ``minimum``, or a ValueError naming it.

    Integers of any kind (``numpy.int64`` too) pass; ``bool`` does not, although it is an
    ``int`` subclass, because ``True`` as a size or rank is always a mistake.

    Args:
        name: the argument's name, for the message.
        value: what the caller passed.
        minimum: the least accepted value.
        where: the function or class the argument belongs to, for the message.

    Raises:
        ValueError: ``value`` is not an integer or is below ``minimum``.
    """
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or number < minimum:
        prefix = f"{where}: " if where else ""
        raise ValueError(f"{prefix}{name} must be an integer >= {minimum}, got {value!r}")
    return number
