"""The checks every value from a user goes through: SamplingParams, LLM options, prompts, model configs.

One rule everywhere, as vLLM has it: an int field takes an int or an integral float (JSON sends 40.0
for 40), never a bool (`True` is an int to Python but never means 1 to a user); a float field takes any
real number that is finite, never NaN or inf. A wrong type raises TypeError, a value out of range
ValueError, and both say "<field> must be <what it accepts>, got <value>", so the message alone tells
the user which argument to fix and how.
"""
from __future__ import annotations

import math
import numbers

FLOAT32_MAX = 3.4028234663852886e38  # the sampler computes in float32: larger floats would become inf
INT64_MAX = 2**63 - 1


def as_int(field: str, value: object, accepted: str, low: int | None = None, high: int | None = None) -> int:
    """`value` as an int in [low, high]; integral floats are converted (40.0 -> 40), bools refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(_message(field, accepted, value, with_type=True))
    if not isinstance(value, numbers.Integral):
        number = float(value)
        if not number.is_integer():  # 2.5, NaN and inf alike
            raise TypeError(_message(field, accepted, value, with_type=True))
        value = number
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(_message(field, accepted, value))
    return value


def as_float(field: str, value: object, accepted: str, low: float, high: float, *, low_open: bool = False) -> float:
    """`value` as a finite float in [low, high] ((low, high] with low_open); ints are converted."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(_message(field, accepted, value, with_type=True))
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        raise ValueError(_message(field, accepted, value)) from None
    if not (math.isfinite(number) and (low < number if low_open else low <= number) and number <= high):
        raise ValueError(_message(field, accepted, value))
    return number


def as_bool(field: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(_message(field, "True or False", value, with_type=True))
    return value


def as_optional_str(field: str, value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(_message(field, "a str or None", value, with_type=True))
    return value


def as_choice(field: str, value: object, choices: tuple) -> object:
    if not isinstance(value, str):
        raise TypeError(_message(field, f"one of {choices}", value, with_type=True))
    if value not in choices:
        raise ValueError(_message(field, f"one of {choices}", value))
    return value


def _message(field: str, accepted: str, value: object, with_type: bool = False) -> str:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    if with_type and not isinstance(value, (int, float, str)):
        shown += f" ({type(value).__name__})"
    elif with_type and isinstance(value, bool):
        shown += " (a bool)"
    return f"{field} must be {accepted}, got {shown}"
