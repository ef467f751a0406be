"""User-facing errors.

Every mistake a user can make (bad option, unreadable file, unsupported model) raises
`KvsieveError` with a message that says what was wrong and what to do. The CLI prints the
message and exits non-zero; it never shows a traceback for these.
"""


class KvsieveError(ValueError):
    """A problem with the user's input or environment, explained in the message."""
