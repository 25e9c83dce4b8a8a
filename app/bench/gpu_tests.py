"""gpu-check's gpu tests: the files that hold them, the pytest command that runs them, and each
test's outcome, from the JUnit XML when pytest finished, else from its -v log (cut off at the
part's deadline, the log still says which tests ended and how)."""

from __future__ import annotations

import importlib.util
import re
import sys
import xml.etree.ElementTree as ElementTree
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GPU_MARK = re.compile(r"pytest\.mark\.gpu2?\b")
TEST_TIMEOUT_S = 60  # each test's: one that hangs must leave the others most of the slice
OUTCOMES = "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
# a test that ended, as pytest -v prints it: in one process `tests/x.py::t PASSED [ 4%]`, with
# pytest-xdist `[gw0] [ 4%] PASSED tests/x.py::t`
ENDED = (re.compile(rf"^(?P<name>tests/\S.*?::.+?) (?P<outcome>{OUTCOMES})\b"),
         re.compile(rf"^\[gw\d+\] \[\s*\d+%\] (?P<outcome>{OUTCOMES}) "
                    rf"(?P<name>tests/\S.*?::.+?)\s*$"))


def gpu_test_files() -> list[str]:
    """The test files that hold gpu tests: the others are not collected (some import packages
    a GPU box may lack, and collecting them all in each test process costs much)."""
    return sorted(str(path.relative_to(REPO)) for path in (REPO / "tests").glob("test_*.py")
                  if GPU_MARK.search(path.read_text()))


def command(junit_xml: Path, processes: int, select: str) -> list[str]:
    """pytest over the gpu tests; with pytest-xdist, `processes` share the GPU (most tests are
    driver runs that leave it idle while they start)."""
    # a file that needs a package the machine lacks must not stop the collection of the others
    argv = [sys.executable, "-m", "pytest", "-m", "gpu or gpu2", "-p", "no:cacheprovider", "-v",
            "--continue-on-collection-errors", f"--junitxml={junit_xml}", *gpu_test_files()]
    if importlib.util.find_spec("pytest_timeout") is not None:
        argv.append(f"--timeout={TEST_TIMEOUT_S}")
    if processes > 1 and importlib.util.find_spec("xdist") is not None:
        argv += ["-n", str(processes)]
    if select:
        argv += ["-k", select]
    return argv


def parse_junit(path: Path) -> list[dict]:
    tests = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = "failed" if kind == "failure" else kind
                message = (found.get("message") or found.text or "").strip().splitlines()
                message = message[0][:300] if message else ""
                break
        tests.append({"name": f"{case.get('classname')}::{case.get('name')}",
                      "outcome": outcome, "seconds": float(case.get("time") or 0),
                      "message": message})
    return tests


def ended_in_log(log: str) -> list[dict]:
    found = (next((m for m in (pattern.match(line) for pattern in ENDED) if m), None)
             for line in log.splitlines())
    return [{"name": match["name"], "outcome": match["outcome"].lower()}
            for match in found if match]


def figures(junit_xml: Path, log: Path) -> dict:
    """Each test that ended and how, and the counts per outcome."""
    tests = parse_junit(junit_xml) if junit_xml.exists() else \
        ended_in_log(log.read_text(errors="replace"))
    return {"counts": dict(Counter(test["outcome"] for test in tests)), "tests": tests}
