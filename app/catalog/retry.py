"""The one retry policy of every request made of a bucket or a web server (docs/reliability.md,
"Retries"): the clients retry each request with the attempts and waits set here (botocore keeps
its own waits); `retried` adds a layer only where a client cannot (a shard fetched whole). And
the one reading of what a failed request was (`failure`), which each caller phrases its way.
"""

from __future__ import annotations

import random
import re
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, TypeVar

from app.runtime.errors import first_line

T = TypeVar("T")

ATTEMPTS = 5  # tries of one request, the first included (s3fs's default too)
# The longest wait before each further try, obstore's and ours (a random time below it): short,
# so a batch waits little for an image that always fails; botocore keeps its own (1, 2, 4, 8 s).
WAITS_S = (0.2, 0.4, 0.8, 1.0)

BOTOCORE_RETRIES = {"max_attempts": ATTEMPTS, "mode": "standard"}  # 5xx, throttling, connections
S3FS_RETRIES = 1  # one try of s3fs's own loop, which would repeat botocore's whole series
# obstore retries 5xx, throttling, dropped connections and timeouts, and resumes a cut GET; its
# waits start at init_backoff, each up to twice the previous, at most max_backoff.
OBSTORE_RETRY = {"max_retries": ATTEMPTS - 1,
                 "backoff": {"init_backoff": timedelta(seconds=WAITS_S[0]),
                             "max_backoff": timedelta(seconds=WAITS_S[-1]), "base": 2}}

# What the clients raise for a failed request, looked up only where the client is loaded.
CLIENT_ERRORS = {"botocore.exceptions": ("BotoCoreError", "ClientError"),
                 "aiohttp": ("ClientError",), "obstore.exceptions": ("BaseError",),
                 "gcsfs.retry": ("HttpError",), "google.auth.exceptions": ("GoogleAuthError",),
                 "azure.core.exceptions": ("AzureError",)}


def request_errors() -> tuple[type[BaseException], ...]:
    """The errors of a failed request, beside the OSErrors (timeouts, refused connections, the
    filesystems' translations of 403 and 404) that fsspec makes of most of them."""
    return (OSError, *loaded(CLIENT_ERRORS))


def loaded(types: dict[str, tuple[str, ...]]) -> tuple[type[BaseException], ...]:
    """The types named {module: names} of the modules loaded: a client's errors exist only
    once it is (an error of a client never loaded is none of them)."""
    return tuple(getattr(sys.modules[module], name) for module, names in types.items()
                 if module in sys.modules for name in names)


def retried(action: Callable[[], T], transient: tuple[type[BaseException], ...]) -> T:
    """`action()`, ATTEMPTS times in all while it raises a `transient` error (the last one is
    raised), waiting a random time below WAITS_S before each further try."""
    for wait in WAITS_S:  # one fewer than ATTEMPTS
        try:
            return action()
        except transient:
            time.sleep(wait * random.random())
    return action()


# What a failed request was, as `failure` tells it.
MISSING, DENIED, INVALID, STATUS, UNREACHABLE = (
    "missing", "access denied", "invalid name", "HTTP status", "unreachable")
# The error types of each kind, the clients' looked up only where the client is loaded: a 403
# or 404 of s3fs and local files is an OSError, obstore's are its own.
KINDS = ((MISSING, (FileNotFoundError,), {"obstore.exceptions": ("NotFoundError",)}),
         (DENIED, (PermissionError,), {"obstore.exceptions": ("PermissionDeniedError",
                                                             "UnauthenticatedError")}),
         (INVALID, (), {"obstore.exceptions": ("InvalidPathError",)}))
AIOHTTP = {"aiohttp": ("ClientError",)}
OBSTORE = {"obstore.exceptions": ("BaseError",)}


@dataclass(frozen=True)
class Failure:
    """A failed request: its kind (MISSING ... UNREACHABLE: everything without an answer that
    says why, a 5xx after the tries included), the client's words on one line (`said`; `words`
    with the error's type first) and the HTTP status where the client gives one."""
    kind: str
    said: str
    words: str
    status: int | None = None


def failure(error: BaseException) -> Failure:
    """What `error` (one of request_errors()) says of the request that failed."""
    if isinstance(error, FileNotFoundError) and isinstance(error.__cause__, loaded(AIOHTTP)):
        error = error.__cause__  # fsspec's http says FileNotFoundError for any failed request
    status = getattr(error, "status", None)  # aiohttp's ClientResponseError
    status = status if isinstance(status, int) else None
    said = _said(error)
    words = f"{type(error).__name__}: {said}" if said != type(error).__name__ else said
    if status is not None:
        return Failure(MISSING if status == 404 else STATUS, said, words, status)
    kind = next((kind for kind, types, clients in KINDS
                 if isinstance(error, (*types, *loaded(clients)))), UNREACHABLE)
    return Failure(kind, said, words)


def _said(error: BaseException) -> str:
    """The error's message on one line (its type's name if it has none). obstore's name the
    request first and end with the cause (" - Server returned ... 503 ... <Code>SlowDown</Code>"),
    followed by a debug dump: the cause, without its XML, is what says why."""
    if not isinstance(error, loaded(OBSTORE)):
        return first_line(error, 160)
    text = str(error).split("\n\nDebug source:")[0].rsplit(" - ", 1)[-1]
    return " ".join(re.sub(r"<[^>]*>", " ", text).split())[:160] or type(error).__name__
