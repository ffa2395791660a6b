"""Argument checks shared by every public entry point.

Each check takes the argument's public name and its value, returns the value in the
form the caller works with (a Python ``float`` or ``int``), and otherwise raises a
``TypeError`` (wrong kind of object) or ``ValueError`` (right kind, impossible value)
whose message names the argument, what it got and what it needs::

    step_size = real("step_size", step_size, positive=True)
    # ValueError: step_size must be a positive finite number, got -0.1

Numbers may be Python, NumPy or 0-d tensor scalars; ``bool`` is never a number (a
``True`` passed as ``num_data`` is a bug, not 1). Checks run at the call, before any
work, so a bad input never costs a forward pass or leaves half-built state behind.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Callable, Collection, Iterable

import torch

__all__ = [
    "real",
    "integer",
    "probability",
    "function",
    "one_of",
    "instance",
    "site_keys",
    "is_real",
]


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _scalar(name: str, value: object, kind: str) -> object:
    """Unwrap a NumPy or 0-d tensor scalar; refuse bools and non-numbers."""
    if isinstance(value, bool) or (torch.is_tensor(value) and value.dtype == torch.bool):
        raise TypeError(f"{name} must be {kind}, got the bool {value!r}")
    if torch.is_tensor(value):
        if value.numel() != 1 or value.dim() > 1:
            raise TypeError(f"{name} must be {kind}, got a tensor of shape {tuple(value.shape)}")
        return value.item()
    item = getattr(value, "item", None)
    if not isinstance(value, numbers.Number) and callable(item) and getattr(value, "ndim", 1) == 0:
        value = item()  # a NumPy scalar or 0-d array
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__} {_show(value)}")
    return value


def real(
    name: str,
    value: object,
    *,
    positive: bool = False,
    non_negative: bool = False,
    low: float | None = None,
    high: float | None = None,
    finite: bool = True,
) -> float:
    """``value`` as a float, checked.

    :param str name: the argument's public name, used in the message.
    :param value: a real number (Python, NumPy or 0-d tensor).
    :param bool positive: require ``value > 0``.
    :param bool non_negative: require ``value >= 0``.
    :param float low: require ``value >= low``.
    :param float high: require ``value <= high``.
    :param bool finite: refuse ``inf`` (NaN is always refused).
    """
    kind = "a positive" if positive else "a non-negative" if non_negative else "a"
    kind += " finite number" if finite else " number"
    if low is not None or high is not None:
        kind += f" in [{'-inf' if low is None else low}, {'inf' if high is None else high}]"
    number = float(_scalar(name, value, kind))
    bad = (
        math.isnan(number)
        or (finite and math.isinf(number))
        or (positive and number <= 0)
        or (non_negative and number < 0)
        or (low is not None and number < low)
        or (high is not None and number > high)
    )
    if bad:
        raise ValueError(f"{name} must be {kind}, got {_show(value)}")
    return number


def integer(name: str, value: object, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int, checked (integral floats such as ``3.0`` are refused).

    :param str name: the argument's public name.
    :param value: an integer (Python, NumPy or 0-d integer tensor).
    :param int low: require ``value >= low``.
    :param int high: require ``value <= high``.
    """
    if low is not None and high is not None:
        kind = f"an int in [{low}, {high}]"
    elif low is not None:
        kind = f"an int >= {low}"
    elif high is not None:
        kind = f"an int <= {high}"
    else:
        kind = "an int"
    number = _scalar(name, value, kind)
    if not isinstance(number, numbers.Integral):
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__} {_show(value)}")
    number = int(number)
    if (low is not None and number < low) or (high is not None and number > high):
        raise ValueError(f"{name} must be {kind}, got {_show(value)}")
    return number


def probability(
    name: str, value: object, *, open_low: bool = False, open_high: bool = False
) -> float:
    """``value`` as a float in [0, 1] (ends excluded where asked).

    :param str name: the argument's public name.
    :param value: a real number.
    :param bool open_low: refuse 0.
    :param bool open_high: refuse 1.
    """
    interval = f"{'(' if open_low else '['}0, 1{')' if open_high else ']'}"
    number = float(_scalar(name, value, f"a number in {interval}"))
    if not (
        (0 < number if open_low else 0 <= number) and (number < 1 if open_high else number <= 1)
    ):
        raise ValueError(f"{name} must be a number in {interval}, got {_show(value)}")
    return number


def function(name: str, value: object, what: str = "a callable") -> Callable:
    """``value`` if it is callable, else a ``TypeError`` saying ``what`` was expected."""
    if not callable(value):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {_show(value)}")
    return value


def one_of(name: str, value: object, choices: Collection) -> object:
    """``value`` if it is one of ``choices``, else a ``ValueError`` listing them."""
    try:
        known = value in choices
    except TypeError:  # an unhashable value in a set or dict
        known = False
    if not known:
        listed = ", ".join(repr(choice) for choice in choices)
        raise ValueError(f"{name} must be one of {listed}; got {_show(value)}")
    return value


def instance(name: str, value: object, types: type | tuple[type, ...], what: str) -> object:
    """``value`` if it is an instance of ``types``, else a ``TypeError`` naming ``what``."""
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise TypeError(f"{name} must be {what}, got the bool {value!r}")
    if not isinstance(value, types):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {_show(value)}")
    return value


def site_keys(
    argument: str, keys: Iterable[str], sites: Iterable[str], what: str = "the model's sites"
) -> None:
    """Refuse keys of ``argument`` that name none of ``sites``.

    An argument keyed by site name (``init_params``, ``map=``, ``prior_precision``, ...)
    whose misspelt key were ignored would run without the value the user meant: a
    ``ValueError`` lists the unknown keys, the closest site to each, and the sites.

    :param str argument: the argument as the user wrote it, e.g. ``"init_params"``.
    :param keys: the argument's keys.
    :param sites: the names the keys may take.
    :param str what: what ``sites`` are, for the message.
    """
    sites = list(sites)
    known = set(sites)
    unknown = [key for key in keys if key not in known]
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), sites, n=1) if isinstance(key, str) else []
        if close:
            hints.append(f"{close[0]!r} for {key!r}")
    hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
    named = f"site {unknown[0]!r}" if len(unknown) == 1 else f"sites {_listed(unknown)}"
    raise ValueError(f"{argument}: unknown {named}{hint}; {what} are {_listed(sites)}")


def is_real(support: torch.distributions.constraints.Constraint) -> bool:
    """Whether a support is the real line (possibly reinterpreted as an event).

    Where it is, a site needs no transform to the unconstrained space and an observation
    no check against the support. (Documented as :func:`pyro_bdl.inference.sites.is_real`;
    it lives here, below every module that asks, so that ``pyro_bdl.likelihoods`` need not
    import the inference package.)
    """
    while isinstance(support, torch.distributions.constraints.independent):
        support = support.base_constraint
    return support is torch.distributions.constraints.real


def _listed(names: list, shown: int = 8) -> str:
    """A list of names, the first ``shown`` of them and how many there are in all."""
    if len(names) <= shown:
        return repr(names)
    return f"[{', '.join(map(repr, names[:shown]))}, ...] ({len(names)} in all)"
