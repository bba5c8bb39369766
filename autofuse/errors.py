"""The one exception type autofuse raises for a user's mistake.

It subclasses ValueError so callers that already catch ValueError keep working; the CLI turns it
into a one-line message instead of a traceback.
"""


class AutofuseError(ValueError):
    """Bad input to autofuse: wrong shape, dtype, device, activation or file content."""


def shown(value: object, limit: int = 40) -> str:
    """`value` as it may appear in a message: its repr (control characters escaped, so a value from a file
    cannot start a line of its own) cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def printable_name(value: object, what: str, limit: int = 64) -> str:
    """`value` where it is a name that may be printed as it is: a string of 1 to `limit` printable
    characters; AutofuseError otherwise."""
    if not isinstance(value, str) or not 1 <= len(value) <= limit or not value.isprintable():
        raise AutofuseError(f"{what} must be a string of 1 to {limit} printable characters, got {shown(value)}")
    return value
