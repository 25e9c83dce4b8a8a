"""The one retry policy of every request made of a bucket or a web server (docs/reliability.md,
"Retries"): the clients retry each request with the attempts and waits set here (botocore keeps
its own waits); `retried` adds a layer only where a client cannot (a shard fetched whole).
"""

from __future__ import annotations

import random
import sys
import time
from datetime import timedelta
from typing import Callable, TypeVar

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

REFUSED = (PermissionError, FileNotFoundError)  # 403, no such bucket or key: no try changes them
# What the clients raise for a failed request, looked up only where the client is loaded.
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
    """`action()`, ATTEMPTS times in all while it raises a `transient` error (the last one is
    raised), waiting a random time below WAITS_S before each further try."""
    for wait in WAITS_S:  # one fewer than ATTEMPTS
        try:
            return action()
        except transient:
            time.sleep(wait * random.random())
    return action()
