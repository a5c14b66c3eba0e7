"""Errors a user can fix. The CLI prints them as one line (no traceback) and exits with code 2."""


class UserError(Exception):
    """Bad input: the message names the problem and, where possible, the fix."""
