"""The runner of timed parts behind `bin/bench.py gpu-check`. Each part runs in a process group
of its own with its own deadline, cut shorter when the budget runs low and told to it
(DEADLINE_ENV) so that it can leave out a run that would not end in time; a part may reserve
time, which the parts before it cannot use however long they run. A part's run folder and
report are cleared first (a rerun must not read the last run's metrics), and its reports are
written as it ends: a run cut short leaves whatever finished, and no part holds up the next."""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import tarfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from app.bench.reports import table
from app.runtime.files import write_atomically

REPO = Path(__file__).resolve().parents[2]
GRACE_S = 10.0  # between SIGTERM and SIGKILL for a part past its deadline
STOP_S = 2 * GRACE_S  # the longest a part killed at its deadline takes to be gone
MIN_PART_S = 5.0  # a part is not started with less than this for it (or its whole deadline)
LOG_TAIL = 3000  # characters of a part's log kept in its report
# a part's deadline in s, told to its command, which may then start only what will end in time
DEADLINE_ENV = "IMAGENET_DP_PART_DEADLINE_S"


@dataclass(frozen=True)
class Paths:
    out: Path  # reports: small files, to copy off the machine
    work: Path  # caches, samples, run folders
    archive: Path | None = None  # `out` packed into one .tar.gz after each part

    def report(self, part: str) -> Path:
        return self.out / f"{part}.report.json"

    @property
    def runs(self) -> Path:  # a part's training runs: runs/<part>
        return self.work / "runs"

    def clear(self, part: str) -> None:
        """A part's run folder and files (figures, log, JUnit XML) gone before it starts."""
        shutil.rmtree(self.runs / part, ignore_errors=True)
        for path in self.out.glob(f"{part}.*"):
            path.unlink()


def read_report(paths: Paths, part: str) -> dict | None:
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):  # none, or cut off
        return json.loads(paths.report(part).read_text())
    return None


@dataclass(frozen=True)
class Part:
    name: str
    what: str  # one line for the summary
    deadline_s: float
    command: Callable[[Paths], list[str]]  # argv, run in the repository
    # the part's figures once it ended: by default the JSON its command wrote
    collect: Callable[[Paths, str], dict | None] = read_report
    summary: Callable[[dict], list[str]] = lambda figures: []  # markdown lines of figures
    env: dict[str, str] = field(default_factory=dict)  # on top of the runner's environment
    reserved_s: float = 0.0  # kept for this part while the parts before it run
    grows: bool = False  # its deadline takes what of the budget the others' deadlines leave


def sized(parts: list[Part], budget_s: float) -> list[Part]:
    """A growing part's deadline raised to what of `budget_s` the others' deadlines and
    STOP_S leave."""
    others = sum(part.deadline_s for part in parts if not part.grows)
    return [replace(part, deadline_s=max(part.deadline_s, budget_s - others - STOP_S))
            if part.grows else part for part in parts]


def time_for(parts: list[Part], index: int, left_s: float) -> float:
    """Seconds the part at `index` may run: its deadline, cut so that the later parts'
    reserved time stays theirs even if this one must be killed (STOP_S more)."""
    reserved = sum(part.reserved_s for part in parts[index + 1:])
    return min(parts[index].deadline_s, left_s - (reserved + STOP_S if reserved else 0.0))


def run_command(command: list[str], log: Path, deadline_s: float, env: dict[str, str]
                ) -> tuple[int | None, str]:
    """(exit code or None, how it ended): the command in a new process group, killed with
    everything it started once `deadline_s` passes."""
    with log.open("w") as output:
        process = subprocess.Popen(command, cwd=REPO, stdout=output, stderr=subprocess.STDOUT,
                                   env=env, start_new_session=True)
        try:
            return process.wait(timeout=deadline_s), "ended"
        except subprocess.TimeoutExpired:
            stop_group(process)
            return None, f"killed at its deadline ({deadline_s:.0f} s)"


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the part's whole process group (a driver saves and stops its workers), then
    SIGKILL to whatever of it is left after GRACE_S (stragglers, or the leader); one stuck in
    the kernel is left behind."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):  # nothing of the group is left
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=GRACE_S)


def run_part(part: Part, paths: Paths, deadline_s: float, env: dict[str, str]) -> dict:
    log, started = paths.out / f"{part.name}.log", time.monotonic()
    paths.clear(part.name)
    command = part.command(paths)
    code, ending = run_command(command, log, deadline_s,
                               {**env, **part.env, DEADLINE_ENV: f"{deadline_s:.0f}"})
    seconds = time.monotonic() - started
    try:
        figures = part.collect(paths, part.name)
    except Exception as error:  # noqa: BLE001 (a part's odd output must not end the runner)
        figures = {"collect_error": f"{type(error).__name__}: {error}"}
    status = "ok" if code == 0 else (ending if code is None else f"failed (exit {code})")
    return {"name": part.name, "what": part.what, "status": status, "exit_code": code,
            "seconds": round(seconds, 1), "deadline_s": round(deadline_s, 1),
            "command": command, "log": log.name, "figures": figures,
            "log_tail": log.read_text(errors="replace")[-LOG_TAIL:]}


def not_run(part: Part, left_s: float, given_s: float) -> dict:
    kept = f", {left_s - given_s:.0f} s of it kept for later parts" * (given_s < left_s - 1)
    return {"name": part.name, "what": part.what, "seconds": 0.0,
            "status": f"not run: {left_s:.0f} s of the budget left{kept}", "figures": None}


def run_parts(parts: list[Part], budget_s: float, paths: Paths, env: dict[str, str]
              ) -> list[dict]:
    for folder in (paths.out, paths.work):
        folder.mkdir(parents=True, exist_ok=True)
    started, outcomes = time.monotonic(), []
    for index, part in enumerate(parts):
        left = budget_s - (time.monotonic() - started)
        given = time_for(parts, index, left)
        outcome = run_part(part, paths, given, env) \
            if given >= min(MIN_PART_S, part.deadline_s) else not_run(part, left, given)
        outcomes.append(outcome)
        (paths.out / f"{part.name}.json").write_text(json.dumps(outcome, indent=2))
        write_summary(paths.out / "summary.md", budget_s, parts, outcomes)
        if paths.archive:
            pack(paths.out, paths.archive)
    return outcomes


def pack(folder: Path, archive: Path) -> None:
    """`folder` as a .tar.gz, replaced whole (a run cut short leaves the parts that ended)."""
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:gz") as tar:
        tar.add(folder, arcname=folder.name)
    write_atomically(archive, data.getvalue())


def write_summary(path: Path, budget_s: float, parts: list[Part], outcomes: list[dict]) -> None:
    spent = sum(o["seconds"] for o in outcomes)
    lines = [f"# gpu-check, {time.strftime('%Y-%m-%d %H:%M')}: {spent:.0f} s of {budget_s:.0f} s",
             "", *table("part|what|status|seconds", ((o["name"], o["what"], o["status"],
                                                      f"{o['seconds']:.0f}") for o in outcomes))]
    summaries = {part.name: part.summary for part in parts}
    for outcome in outcomes:
        if figures := outcome["figures"]:
            lines += ["", f"## {outcome['name']}", ""]
            try:
                lines += summaries[outcome["name"]](figures)
            except Exception as error:  # noqa: BLE001 (the figures stay in <part>.json)
                lines.append(f"(figures in {outcome['name']}.json; summary failed: {error})")
    path.write_text("\n".join(lines) + "\n")


def part_environment(paths: Paths) -> dict[str, str]:
    """What every part shares: compile caches in the work folder (a later part reuses what the
    first one compiled), the generated sample there unless a cache is set, unbuffered output
    (a killed part's log still holds its last lines)."""
    cache = paths.work / "compile-cache"
    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
            "TRITON_CACHE_DIR": str(cache / "triton"), "PYTHONUNBUFFERED": "1",
            "IMAGENET_DP_CACHE": os.environ.get("IMAGENET_DP_CACHE",
                                                str(paths.work / "samples"))}
