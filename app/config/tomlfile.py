"""Reading TOML files (run configs, the dataset catalog) with errors a user can act on."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from app.runtime.errors import UserError


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """Parse a TOML file; a missing or malformed file is a UserError naming the file and line."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise UserError(f"{path}: {what} not found; check the path") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a folder, expected a {what} (TOML file)") from None
    except tomllib.TOMLDecodeError as error:  # its message says "(at line L, column C)"
        raise UserError(f"{path}: invalid TOML: {error}; fix the {what}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text; a {what} must be a TOML file") from None
