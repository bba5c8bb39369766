"""The one exception type autofuse raises for a user's mistake.

It subclasses ValueError so callers that already catch ValueError keep working; the CLI turns it
into a one-line message instead of a traceback.
"""


class AutofuseError(ValueError):
    """Bad input to autofuse: wrong shape, dtype, device, activation or file content."""
