"""The did-you-mean hint of error messages: the closest known name to a misspelt one.

The losses, the metrics and the callbacks' monitors say it when a name is unknown, and so does the
recipe system above the trainer (``replicafit.recipes``), for a recipe's keys and names.

Example::

    >>> did_you_mean("val_los", ["loss", "val_loss"])
    " (did you mean 'val_loss'?)"
    >>> did_you_mean("zzz", ["loss"])
    ''
"""

from __future__ import annotations

from difflib import get_close_matches

__all__ = ["did_you_mean"]


def did_you_mean(name, options) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``options``, or an empty string.

    Names and options are compared as strings (``difflib.get_close_matches``, its default cutoff), so
    a key that is a number (a list index in a recipe) is compared by its digits.

    Example::

        raise ValueError(f"unknown metric {name!r}{did_you_mean(name, known)}")
    """
    close = get_close_matches(str(name), [str(o) for o in options], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
