"""What every bin/ entry point shares: user mistakes become one line on stderr and exit 2."""

from __future__ import annotations

import logging
import sys
from typing import Callable

from app.runtime.errors import USER_ERROR_EXIT_CODE, UserError

INTERRUPTED_EXIT_CODE = 130


def run_cli(main: Callable[[list[str]], int], argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    try:
        return main(sys.argv[1:] if argv is None else argv)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
