"""Errors a user can fix. The CLI prints them as one line (no traceback) and exits with code 2."""

from pydantic import ValidationError


class UserError(Exception):
    """Bad input: the message names the problem and, where possible, the fix."""


def describe(exc: BaseException) -> str:
    """An exception in one line: `TypeName: first line of its message` (the type alone when it has none).
    A pydantic ValidationError (a model built with a bad field) names its first error's field, value and
    reason instead, which its first line ("1 validation error for X") leaves out."""
    if isinstance(exc, ValidationError) and (errors := exc.errors()):
        first = errors[0]
        where = ".".join(str(part) for part in first["loc"])
        value = first.get("input")
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        shown = f"{value!r:.40} ({type(value).__name__})"
        return f"ValidationError: {exc.title}.{where} = {shown}: {first['msg']}{more}"
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
