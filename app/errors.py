"""The one exception type for mistakes a user can make (bad config, missing data, ...).

bin/ entry points print its message as one line and exit with code 2; everything else
is a programming error and keeps its traceback.
"""

USER_ERROR_EXIT_CODE = 2


class UserError(Exception):
    """A problem the user can fix; the message names the file/key/line and what to do."""

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))  # always one line
