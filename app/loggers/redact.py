"""Keep secrets out of what leaves the machine (the config logged to wandb or TensorBoard).
Credentials never belong in a config, but a user may still put one in a URL or in a value whose
name says what it is; those are masked."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

MASK = "***"
SECRET_NAME = re.compile(r"secret|token|password|passwd|credential|api_?key|access_?key",
                         re.IGNORECASE)


def redact(value: Any, name: str = "") -> Any:
    """A copy of `value` (nested dicts/lists/strings) with secret-looking parts masked."""
    if isinstance(value, dict):
        return {key: redact(item, str(key)) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(item, name) for item in value]
    if isinstance(value, str):
        if value and SECRET_NAME.search(name):
            return MASK
        return _redact_url(value)
    return value


def _redact_url(text: str) -> str:
    """s3://KEY:SECRET@bucket/x?X-Amz-Signature=... -> s3://***@bucket/x?***"""
    if "://" not in text:
        return text
    try:
        parts = urlsplit(text)
    except ValueError:
        return MASK
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{MASK}@{netloc.rsplit('@', 1)[1]}"
    return urlunsplit((parts.scheme, netloc, parts.path, MASK if parts.query else "",
                       parts.fragment))
