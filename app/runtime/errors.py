"""The one exception type for mistakes a user can make, and the one way to quote any exception
in a one-line message. bin/ entry points print a UserError as one line and exit 2; everything
else is a programming error and keeps its traceback.
"""

USER_ERROR_EXIT_CODE = 2


class UserError(Exception):
    """A problem the user can fix; the message names the file/key/line and what to do."""

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))  # always one line


def first_line(error: BaseException, limit: int = 160, with_type: bool = False) -> str:
    """The first non-empty line of an exception's message, at most `limit` characters; the
    type name when the message is empty (str(error) is "" for many OSErrors and for bare
    raises), so quoting an exception can never fail itself. `with_type` prefixes the name."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    name = type(error).__name__
    if not lines:
        return name
    text = lines[0][:limit]
    return f"{name}: {text}" if with_type else text


def original_error(error: UserError) -> UserError:
    """A UserError raised in a DataLoader process reaches the caller as the same type whose
    message is torch's "Caught X in DataLoader worker process N. Original Traceback ...": the
    one line the user should read is the original message at its end."""
    text, marker = str(error), f"{type(error).__name__}: "
    if "Original Traceback" not in text or marker not in text:
        return error
    return type(error)(text.rsplit(marker, 1)[1])
