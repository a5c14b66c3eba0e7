"""Errors a user can fix. The CLI prints them as one line (no traceback) and exits with code 2."""


class UserError(Exception):
    """Bad input: the message names the problem and, where possible, the fix."""


def describe(exc: BaseException) -> str:
    """An exception in one line: `TypeName: first line of its message` (the type alone when it has none)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
