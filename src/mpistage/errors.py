"""The one exception class for user errors."""


class StageError(Exception):
    """A user-facing error: printed as one line, exit status 1, no traceback.

    Long messages say the cause and the fix. Raised on one rank, it is made
    collective by :func:`mpistage.collective.agree`.
    """
