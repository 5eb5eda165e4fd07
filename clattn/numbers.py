"""What counts as an integer and as a number in clattn's arguments.

A leaf module: it imports nothing from clattn, so that every module may use it.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np


def is_int(x: Any) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def is_number(x: Any) -> bool:
    """A real number that ``float()`` takes (not a string, bytes or a bool)."""
    if isinstance(x, (str, bytes, bool, np.bool_)):
        return False
    try:
        float(x)
    except (TypeError, ValueError):
        return False
    return True


def is_positive_finite(x: Any) -> bool:
    """A number (:func:`is_number`) that is positive and finite."""
    return is_number(x) and math.isfinite(float(x)) and float(x) > 0
