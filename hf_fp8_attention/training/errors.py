"""One-line errors for the command-line tools: bad input says what is wrong, without a traceback."""
from __future__ import annotations

import functools
import sys
from pathlib import Path

# Output directories a command created in this process (deepest first); a failed run removes the
# ones it left empty, so no empty ``outputs/<example>/<attn>/`` stays behind.
created_output_dirs: list[Path] = []


class UsageError(ValueError):
    """Bad input from the user (a path, a model, a dataset, a length): printed as one line, exit 2."""


def main_with_usage_errors(fn):
    """Wrap a ``main(argv)`` so that a :class:`UsageError` prints ``error: <message>`` and exits 2.

    Anything else still raises with its traceback: that is a bug, and the traceback is the report.
    A failed run (any exception) also removes the output directories it created and left empty.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            result = fn(*args, **kwargs)
        except UsageError as err:
            remove_empty_output_dirs()
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(2) from None
        except BaseException:
            remove_empty_output_dirs()
            raise
        created_output_dirs.clear()
        return result

    return wrapper


def remove_empty_output_dirs() -> None:
    """Remove the directories of :data:`created_output_dirs` that hold no file (only empty folders)."""
    while created_output_dirs:
        path = created_output_dirs.pop(0)
        if not path.is_dir() or any(not p.is_dir() for p in path.rglob("*")):
            continue
        for sub in sorted((p for p in path.rglob("*")), key=lambda p: len(p.parts), reverse=True):
            sub.rmdir()
        path.rmdir()
