"""One-line errors for the command-line tools: bad input says what is wrong, without a traceback."""
from __future__ import annotations

import functools
import sys


class UsageError(ValueError):
    """Bad input from the user (a path, a model, a dataset, a length): printed as one line, exit 2."""


def main_with_usage_errors(fn):
    """Wrap a ``main(argv)`` so that a :class:`UsageError` prints ``error: <message>`` and exits 2.

    Anything else still raises with its traceback: that is a bug, and the traceback is the report.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UsageError as err:
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(2) from None

    return wrapper
