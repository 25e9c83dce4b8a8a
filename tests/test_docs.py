"""Docs that cannot drift: every `--flag` a command in README.md, docs/*.md or examples/ (the
batch scripts and the Kubernetes manifest) passes to one of bin/'s scripts is one that script
accepts (its real --help, not a list kept here), every configs/, examples/ and docs/ file they
name exists, every link resolves (anchors included), and docs/training.md's flag tables name
exactly the driver's flags."""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import run_driver

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_EXAMPLES = sorted((REPO / "examples").rglob("*.sbatch"))
YAML_EXAMPLES = sorted((REPO / "examples").rglob("*.yaml"))
# files whose comments point at other files of the repository
COMMENTED = [*SHELL_EXAMPLES, *YAML_EXAMPLES, *sorted((REPO / "configs").glob("*.toml"))]
# scripts whose extra flags are another script's: validate.py hands them to the driver
FLAGS_OF = {"validate.py": "driver.py"}
SCRIPT = re.compile(r"(?:^|[\s/])bin/(\w+\.py)$")
OPTION_LINE = re.compile(r"^  (-\S.*?)(?:\s{2,}|$)")
FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)


def commands(block: str) -> list[list[str]]:
    """A shell block's commands as words: continuation lines and a bash array's lines
    (`TRAIN=(python bin/driver.py ...` over several lines) joined, comments dropped, and a line
    cut into its commands at `|`, `;`, `&&`, `||` and `$(`."""
    joined = re.sub(r"\\\n\s*", " ", block)
    joined = re.sub(r"=\(([^()]*)\)", lambda array: "=(" + " ".join(array[1].split()) + ")",
                    joined)
    found = []
    for line in joined.splitlines():
        for part in re.split(r"\s(?:\|\||\||;|&&)\s|\$\(", line):
            try:
                words = shlex.split(part, comments=True)
            except ValueError:  # an unbalanced quote in prose-like lines: not a command
                continue
            if words:
                found.append(words)
    return found


def inline_commands(markdown: str) -> list[list[str]]:
    """The commands written in prose, as `python bin/bench.py predict ... --images`."""
    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)
    return [words for span in re.findall(r"`([^`\n]*\bbin/\w+\.py\b[^`\n]*)`", prose)
            for words in commands(span)]


def manifest_commands(text: str) -> list[list[str]]:
    """Every list of strings in a YAML file (a container's command or args) as words."""
    found = []

    def walk(node):
        if isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            if node and all(isinstance(item, str) for item in node):
                found.append(node)
            for item in node:
                walk(item)

    for document in yaml.safe_load_all(text):
        walk(document)
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


def markdown_commands(markdown: str) -> list[list[str]]:
    """The commands of a page's shell blocks and of its prose."""
    found = [words for language, block in code_blocks(markdown)
             if language in ("", "bash", "sh", "shell", "console")
             for words in commands(block)]
    return found + inline_commands(markdown)


def unknown_flags(markdown: str, find=markdown_commands) -> list[str]:
    """`script: --flag` for every flag a documented command passes that the script refuses."""
    found = []
    for words in find(markdown):
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
    """Paths of the repository a page names: configs, examples, docs, the code and the tests."""
    return set(re.findall(r"(?<![\w/.-])((?:configs|examples|docs|app|bin|tests)/[\w./-]*\w)",
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


@pytest.mark.parametrize("example", SHELL_EXAMPLES + YAML_EXAMPLES, ids=lambda p: p.name)
def test_example_launches_use_only_flags_the_driver_accepts(example):
    find = manifest_commands if example.suffix == ".yaml" else commands
    assert unknown_flags(example.read_text(), find) == []


@pytest.mark.parametrize("path", COMMENTED, ids=lambda p: p.name)
def test_files_named_in_examples_and_configs_exist(path):
    assert {name for name in named_files(path.read_text()) if not (REPO / name).exists()} == set()


def test_a_misspelt_flag_a_missing_config_and_a_dead_link_are_found(tmp_path):
    planted = """
```bash
python bin/driver.py --config configs/resnet50.toml --epoch 3 \\
    --sync allreduce   # --not-a-flag in a comment is prose
torchrun --nnodes 2 bin/driver.py --lr 0.1 -b 64 --gpu 8
python bin/bench.py loader --dataset sample --dataset-name x
python bin/validate.py runs/x/best.pt --val-flip-tta --evaluation
python bin/driver.py --config configs/resnet51.toml
make setup && python bin/driver.py --resum auto
```
See [training](training.md#flags), [nowhere](missing.md) and [a heading](training.md#nope);
in prose, `python bin/bench.py predict ... --image` and docs/trainning.md.
"""
    assert unknown_flags(planted) == [
        "driver.py: --epoch", "driver.py: --gpu", "bench.py: --dataset-name",
        "validate.py: --evaluation", "driver.py: --resum", "bench.py: --image"]
    assert {name for name in named_files(planted) if not (REPO / name).exists()} == {
        "configs/resnet51.toml", "docs/trainning.md"}
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


def test_a_misspelt_flag_in_a_batch_script_or_a_manifest_is_found():
    script = """
TRAIN=(.venv/bin/python bin/driver.py --sync allreduce
       --dataset imagenet_s3 --output-dir runs
       --resum auto)
srun --kill-on-bad-exit=0 .venv/bin/python bin/driver.py --epochs 3 --gpu 8
"""
    manifest = """
spec:
  containers:
    - command: [.venv/bin/torchrun, --nproc-per-node=8, bin/driver.py, --sync=allreduce,
                --run-nam=r50]
      ports: [{name: port, containerPort: 23456}]
"""
    assert unknown_flags(script, commands) == ["driver.py: --resum", "driver.py: --gpu"]
    assert unknown_flags(manifest, manifest_commands) == ["driver.py: --run-nam"]


def test_the_readmes_demo_runs_as_make_demo_runs_it_and_ends_as_the_readme_shows(
        sample_cache, tmp_path):
    """`make demo`'s command (read from `make -n demo`, so README, Makefile and test cannot
    drift), run as written but for one epoch of its four (its schedule in one epoch: a quarter
    of the cost; the four epochs' figure is docs/results.md's): its last line has the shape of
    the README's, and it learned the generated sample (10 classes: chance is 10%)."""
    made = subprocess.run(["make", "-n", "demo"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.splitlines()
    words = shlex.split(next(line for line in made if "bin/driver.py" in line))
    assert words[1:] == ["bin/driver.py", "--config", "configs/demo.toml"], words
    def last(epochs: int) -> re.Pattern:
        return re.compile(rf"epoch {epochs}/{epochs}  train loss \d\.\d{{4}}  val top-1 "
                          r"(\d\.\d{4})  top-5 \d\.\d{4}  loss \d\.\d{4}  time \d+\.\ds  "
                          r"skipped 0 images")
    readme = last(4).search((REPO / "README.md").read_text())
    assert readme and float(readme[1]) >= 0.9
    result = run_driver("--config", str(REPO / "configs" / "demo.toml"), "--epochs", "1",
                        cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    ended = last(1).fullmatch(result.stdout.strip().splitlines()[-1])
    assert ended and float(ended[1]) >= 0.8, result.stdout[-2000:]
