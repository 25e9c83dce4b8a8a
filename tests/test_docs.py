"""Docs that cannot drift: every `--flag` a command in README.md or docs/*.md passes to one of
bin/'s scripts is one that script accepts (its real --help, not a list kept here), every
configs/ and examples/ file they name exists, every link resolves (anchors included), and
docs/training.md's flag tables name exactly the driver's flags."""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# scripts whose extra flags are another script's: validate.py hands them to the driver
FLAGS_OF = {"validate.py": "driver.py"}
SCRIPT = re.compile(r"(?:^|[\s/])bin/(\w+\.py)$")
OPTION_LINE = re.compile(r"^  (-\S.*?)(?:\s{2,}|$)")
FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)


def commands(block: str) -> list[list[str]]:
    """A shell block's commands as words: continuation lines joined, comments dropped, and a
    line cut at `|`, `;`, `&&` or `$(`."""
    joined = re.sub(r"\\\n\s*", " ", block)
    found = []
    for line in joined.splitlines():
        line = re.split(r"\s(?:\||;|&&)\s|\$\(", line)[0]
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # an unbalanced quote in prose-like lines: not a command
            continue
        if words:
            found.append(words)
    return found


def script_calls(words: list[str]) -> list[tuple[str, list[str]]]:
    """(script, the words after it) for a command that runs bin/SCRIPT.py (after python,
    torchrun, srun, ...); flags before the script are the launcher's."""
    for index, word in enumerate(words):
        match = SCRIPT.search(word)
        if match:
            return [(match.group(1), words[index + 1:])]
    return []


@functools.cache
def accepted_flags(script: str, subcommand: str = "") -> frozenset[str]:
    """The option strings of the script's --help (bench.py: of its sub-command's)."""
    script = FLAGS_OF.get(script, script)
    argv = [sys.executable, str(REPO / "bin" / script), *([subcommand] if subcommand else []),
            "--help"]
    text = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=120,
                          check=True).stdout
    flags = set()
    for line in text.splitlines():
        match = OPTION_LINE.match(line)
        if match:
            flags |= set(FLAG.findall(match.group(1)))
    return frozenset(flags)


def unknown_flags(markdown: str) -> list[str]:
    """`script: --flag` for every flag a documented command passes that the script refuses."""
    found = []
    for language, block in code_blocks(markdown):
        if language not in ("", "bash", "sh", "shell", "console"):
            continue
        for words in commands(block):
            for script, rest in script_calls(words):
                if not (REPO / "bin" / script).exists():
                    found.append(f"bin/{script}: no such script")
                    continue
                subcommand = rest[0] if script == "bench.py" and rest else ""
                known = accepted_flags(script, subcommand)
                for word in rest:
                    flag = word.split("=", 1)[0]
                    if FLAG.fullmatch(flag) and flag not in known:
                        found.append(f"{script}: {flag}")
    return found


def named_files(markdown: str) -> set[str]:
    """Paths of the repository a page names: configs, examples, the code and the tests."""
    return set(re.findall(r"(?<![\w/.-])((?:configs|examples|app|bin|tests)/[\w./-]*\w)",
                          markdown))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def broken_links(path: Path) -> list[str]:
    found = []
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        where = (path.parent / file).resolve() if file else path
        if not where.exists():
            found.append(f"{path.name}: {target} (no such file)")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            found.append(f"{path.name}: {target} (no such heading)")
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_documented_commands_use_only_flags_their_script_accepts(doc):
    assert unknown_flags(doc.read_text()) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_named_files_exist(doc):
    assert {name for name in named_files(doc.read_text()) if not (REPO / name).exists()} == set()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_link_resolves(doc):
    assert broken_links(doc) == []


def test_a_misspelt_flag_a_missing_config_and_a_dead_link_are_found(tmp_path):
    planted = """
```bash
python bin/driver.py --config configs/resnet50.toml --epoch 3 \\
    --sync allreduce   # --not-a-flag in a comment is prose
torchrun --nnodes 2 bin/driver.py --lr 0.1 -b 64 --gpu 8
python bin/bench.py loader --dataset sample --dataset-name x
python bin/validate.py runs/x/best.pt --val-flip-tta --evaluation
python bin/driver.py --config configs/resnet51.toml
```
See [training](training.md#flags), [nowhere](missing.md) and [a heading](training.md#nope).
"""
    assert unknown_flags(planted) == ["driver.py: --epoch", "driver.py: --gpu",
                                      "bench.py: --dataset-name", "validate.py: --evaluation"]
    assert {name for name in named_files(planted) if not (REPO / name).exists()} == {
        "configs/resnet51.toml"}
    doc = tmp_path / "docs" / "planted.md"
    doc.parent.mkdir()
    doc.write_text(planted)
    (tmp_path / "docs" / "training.md").write_text("# Training\n\n## Flags\n")
    assert broken_links(doc) == ["planted.md: missing.md (no such file)",
                                 "planted.md: training.md#nope (no such heading)"]


def test_the_training_page_tables_name_exactly_the_drivers_flags():
    """Both ways: a flag added to the config shows up in docs/training.md, and a flag there that
    the driver lost fails here."""
    text = (REPO / "docs" / "training.md").read_text()
    tables = text[text.index("## Flags"):text.index("## Details")]
    first_cells = re.findall(r"^\| (.+?) \|", tables, re.M)
    documented = {flag for cell in first_cells for flag in FLAG.findall(cell)
                  if flag.startswith("--")}
    driver = {flag for flag in accepted_flags("driver.py")
              if flag.startswith("--") and not flag.startswith("--no-") and flag != "--help"}
    assert documented == driver
