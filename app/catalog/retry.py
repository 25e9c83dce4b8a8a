"""The one retry policy of every request made of a bucket or a web server (docs/reliability.md,
"Retries"): the clients retry each request, configured from here with the same attempts (and
the same waits, but for botocore's own schedule); our own code adds one layer only where a client cannot (a shard fetched whole: a cut
continued, a listed shard answered 404), through `retried`.
"""

from __future__ import annotations

import random
import sys
import time
from datetime import timedelta
from typing import Callable, TypeVar

T = TypeVar("T")

# Tries of one request, the first included: a request fails for good only when the bucket
# fails it 5 times in a row (at a 10% failure rate, 1 request in 100,000). s3fs's default too.
ATTEMPTS = 5
# The longest wait before each further try, obstore's and ours (a random time below it): a
# request that always fails (an object that answers 503) costs at most 2.4 s of waiting, so the
# batch that needs it is not held up long before the image is skipped. botocore's standard mode
# has waits of its own that no setting changes: a random time below 1, 2, 4, then 8 s.
WAITS_S = (0.2, 0.4, 0.8, 1.0)

BOTOCORE_RETRIES = {"max_attempts": ATTEMPTS, "mode": "standard"}  # 5xx, throttling, connections
# s3fs's own loop would repeat botocore's whole series of tries (its `retries` counts tries):
# one try of it, so botocore's tries are the only ones.
S3FS_RETRIES = 1
# obstore (Rust's object_store) retries 5xx, throttling, dropped connections and timeouts, and
# goes on with a GET whose body was cut mid-way; its first wait is init_backoff, then a random
# time up to twice the previous, at most max_backoff.
OBSTORE_RETRY = {"max_retries": ATTEMPTS - 1,
                 "backoff": {"init_backoff": timedelta(seconds=WAITS_S[0]),
                             "max_backoff": timedelta(seconds=WAITS_S[-1]), "base": 2}}

REFUSED = (PermissionError, FileNotFoundError)  # 403, no such bucket or key: no try changes them
# What the clients raise when a request fails (their modules, looked up only where the client is
# loaded: nothing raises them otherwise). A programming error (TypeError, ...) is none of them.
CLIENT_ERRORS = {"botocore.exceptions": ("BotoCoreError", "ClientError"),
                 "aiohttp": ("ClientError",), "obstore.exceptions": ("BaseError",),
                 "gcsfs.retry": ("HttpError",), "google.auth.exceptions": ("GoogleAuthError",),
                 "azure.core.exceptions": ("AzureError",)}


def request_errors() -> tuple[type[BaseException], ...]:
    """The errors of a failed request, beside the OSErrors (timeouts, refused connections, the
    filesystems' translations of 403 and 404) that fsspec makes of most of them."""
    return (OSError, *(getattr(sys.modules[module], name) for module, names
                       in CLIENT_ERRORS.items() if module in sys.modules for name in names))


def retried(action: Callable[[], T], transient: tuple[type[BaseException], ...]) -> T:
    """`action()`, tried again after a `transient` error, ATTEMPTS times in all, waiting a random
    time below WAITS_S before each further try; the last error is raised. Anything else is
    raised at once."""
    for wait in WAITS_S:  # one fewer than ATTEMPTS
        try:
            return action()
        except transient:
            time.sleep(wait * random.random())
    return action()
