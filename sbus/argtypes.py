"""Numbers on command lines: one set of rules for sbusd's options and the sbus tool's.

``number`` says what is wrong in words a user can act on; ``sbus.sbusd.config``
wraps it for sbusd's own option parser, and the argparse types below wrap it
for ``sbus`` and its subcommands.
"""
from __future__ import annotations

import argparse
import math
from typing import Callable, Optional, Union

Number = Union[int, float]


def number(text: str, kind: type = int, low: Number = 0, high: Optional[Number] = None,
           *, above: bool = False) -> Number:
    """``text`` as a finite ``kind`` from ``low`` (or ``above`` it) up to ``high``.

    Raises ValueError whose text names the problem: ``not a whole number:
    'lots'``, ``not a finite number: 'nan'``, ``out of range: '63' (64 to 67108864)``.
    """
    try:
        n = kind(text)
    except ValueError:
        what = "whole number" if kind is int else "number"
        raise ValueError(f"not a {what}: {text!r}") from None
    if not math.isfinite(n):            # nan and inf: no JSON for them either
        raise ValueError(f"not a finite number: {text!r}")
    if n < low or (above and n == low) or (high is not None and n > high):
        raise ValueError(f"out of range: {text!r} ({_span(low, high, above)})")
    return n


def _span(low: Number, high: Optional[Number], above: bool) -> str:
    if high is not None:
        return f"{'more than ' if above else ''}{low} to {high}"
    return f"more than {low}" if above else f"{low} or more"


def argtype(kind: type = int, low: Number = 0, high: Optional[Number] = None, *,
            above: bool = False) -> Callable[[str], Number]:
    """An argparse ``type=`` for such a number."""
    def parse(text: str) -> Number:
        try:
            return number(text, kind, low, high, above=above)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parse.__name__ = "whole number" if kind is int else "number"    # argparse's fallback text
    return parse


count = argtype(int)                            # N, BYTES: 0 or more
seconds = argtype(float)                        # a wait that may be 0
positive_seconds = argtype(float, above=True)   # an interval: 0 would spin
