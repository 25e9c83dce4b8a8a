"""The shape of app/: no import cycles (type-checking-only imports count), small modules, the
layers in their order, and every name table agreeing with the config's choices."""

import ast
import dataclasses
import re
from pathlib import Path

from app.config import Config
from app.data.augment import TRAIN_CROPS
from app.data.auto_augment import AUTO_AUGMENT
from app.data.decoders import DECODERS
from app.loggers import LOGGERS
from app.parallel.plans import SYNC_MODES

REPO = Path(__file__).resolve().parents[1]
APP = REPO / "app"
ARCHITECTURE = REPO / "docs" / "architecture.md"
MAX_LINES = 350


MAX_APP_ENTRIES = 12  # `ls app/`: a newcomer finds the program's parts in one short list


def module_name(path: Path, root: Path = APP) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str], root: Path = APP) -> set[str]:
    """Modules of app/ that `path` imports anywhere (top level, functions, TYPE_CHECKING)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from package import module` imports the module; `from module import name`, the module
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # a name inside a module -> the module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path = APP) -> dict[str, set[str]]:
    files = sorted(root.rglob("*.py"))
    modules = {module_name(p, root) for p in files}
    return {module_name(p, root): imports_of(p, modules, root) for p in files}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, done = [], set()

    def visit(module, stack):
        for target in sorted(graph[module]):
            if target in stack:
                found.append(stack[stack.index(target):] + [target])
            elif target not in done:
                visit(target, stack + [target])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    return found


def test_no_import_cycles_between_modules():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]


def floors_from_architecture_doc() -> dict[str, int]:
    """The floors of docs/architecture.md's table, ground first: `| 3 | app/data/ | ...`."""
    rows = re.findall(r"^\| *(\d+) *\| *`?app/(\w+)/`? *\|", ARCHITECTURE.read_text(), re.M)
    return {f"app.{package}": int(floor) for floor, package in rows}


def package_of(module: str) -> str:
    """app.training.trainer -> app.training; app (the top __init__) stays app."""
    return ".".join(module.split(".")[:2])


def upward_imports(graph: dict[str, set[str]], floors: dict[str, int]) -> list[str]:
    """Imports of a package on the same floor or above the importer's own (the top-level
    `app` face sits above every package: it may import them all, none may import it)."""
    top = max(floors.values()) + 1
    floor = {**floors, "app": top}
    found = []
    for module, targets in sorted(graph.items()):
        own = package_of(module)
        for target in sorted(targets):
            other = package_of(target)
            if other != own and floor[other] >= floor[own]:
                found.append(f"{module} (floor {floor[own]}) imports {target} "
                             f"(floor {floor[other]})")
    return found


def test_every_package_is_on_a_floor():
    packages = {f"app.{p.name}" for p in APP.iterdir() if (p / "__init__.py").exists()}
    assert set(floors_from_architecture_doc()) == packages


def test_packages_import_only_packages_on_lower_floors():
    """TYPE_CHECKING and in-function imports count as well (imports_of reads every import)."""
    assert upward_imports(import_graph(), floors_from_architecture_doc()) == []


def test_the_floor_rule_finds_an_upward_and_a_sideways_import():
    floors = {"app.low": 0, "app.mid": 1, "app.side": 1, "app.high": 2}
    graph = {"app.low.a": {"app.high.b"}, "app.mid.c": {"app.side.d", "app.low.a", "app.mid.e"},
             "app.high.b": {"app.mid.c", "app.low.a"}, "app.side.d": set(), "app.mid.e": set(),
             "app.low": {"app"}}
    assert upward_imports(graph, floors) == [
        "app.low (floor 0) imports app (floor 3)",
        "app.low.a (floor 0) imports app.high.b (floor 2)",
        "app.mid.c (floor 1) imports app.side.d (floor 1)"]


def test_a_planted_upward_import_fails_the_rule_however_it_is_written(tmp_path):
    """Real files, read as the suite reads app/: an import under TYPE_CHECKING, one inside a
    function and a relative one are each found."""
    root = tmp_path / "app"
    for package in ("low", "high"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "high" / "job.py").write_text("from app.low.base import Base\n")
    (root / "low" / "base.py").write_text("class Base:\n    pass\n")
    (root / "low" / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from app.high.job import Job\n")
    (root / "low" / "lazy.py").write_text("def run():\n    from ..high import job\n    return job\n")
    floors = {"app.low": 0, "app.high": 1}
    assert upward_imports(import_graph(root), floors) == [
        "app.low.lazy (floor 0) imports app.high.job (floor 1)",
        "app.low.typed (floor 0) imports app.high.job (floor 1)"]


def test_app_holds_only_its_face_and_the_packages_on_floors():
    entries = {p.name for p in APP.iterdir() if p.name != "__pycache__"}
    packages = {name.removeprefix("app.") for name in floors_from_architecture_doc()}
    assert entries == packages | {"__init__.py"}
    assert len(entries) <= MAX_APP_ENTRIES


def declared_imports(docstring: str, packages: set[str]) -> set[str] | None:
    """The packages a package's docstring says it imports ("Imports only app.runtime and
    app.config."); None where it says only "the packages below it"."""
    sentence = re.search(r"Imports(.*?)(?:[.:;](?:\s|$))", docstring, re.S)
    assert sentence, "no 'Imports ...' sentence"
    named = {word for word in re.findall(r"(?:app\.)?(\w+)", sentence[1]) if word in packages}
    if not named and "below" in sentence[1]:
        return None
    return named


def test_every_package_says_what_it_owns_and_may_import_and_keeps_to_it():
    """The docstring's list is checked against the imports it names, so it cannot drift."""
    floors = floors_from_architecture_doc()
    packages = {name.removeprefix("app.") for name in floors}
    used: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        used.setdefault(package_of(module), set()).update(
            package_of(t).removeprefix("app.") for t in targets)
    for init in APP.glob("*/__init__.py"):
        package = init.parent.name
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        declared = declared_imports(doc, packages - {package})
        if declared is None:
            continue
        assert used.get(f"app.{package}", set()) - {package} <= declared, init
        assert all(floors[f"app.{d}"] < floors[f"app.{package}"] for d in declared), init


def test_no_module_over_the_size_limit():
    long = {str(p.relative_to(APP)): n for p in APP.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def choices(section: str, key: str) -> tuple:
    fields = {f.name: f for f in dataclasses.fields(type(getattr(Config(), section)))}
    return fields[key].metadata["choices"]


def test_name_tables_match_the_config_choices():
    assert set(choices("data", "decoder")) == set(DECODERS) | {"auto"}
    assert set(choices("logging", "loggers")) == set(LOGGERS)
    assert set(choices("parallel", "sync")) == (set(SYNC_MODES) - {"local"}) | {"auto"}
    assert choices("augment", "auto_augment") == AUTO_AUGMENT
    assert choices("augment", "train_crop") == TRAIN_CROPS


def reached_from(start: str, graph: dict[str, set[str]]) -> set[str]:
    """The modules of app/ that importing `start` may load (in-function imports included)."""
    reached, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += graph[module]
            # importing app.data.x runs app/__init__.py and app/data/__init__.py first
            todo += [".".join(module.split(".")[:n]) for n in range(1, module.count(".") + 1)]
    return reached


def external_imports(tree: ast.AST, top_level_only: bool = False) -> set[str]:
    """The top-level names of the packages a module imports (`torch`, `PIL`, ...); with
    `top_level_only`, not those imported inside a function when it is called."""
    found, todo = set(), [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add((node.module or "").split(".")[0])
        if not (top_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                     ast.Lambda))):
            todo += ast.iter_child_nodes(node)
    return found


def test_dalis_reader_processes_import_no_torch():
    """They run the recipes' plan() (crops, flips, auto-augment draws) and need no torch."""
    graph, files = import_graph(), {module_name(p): p for p in APP.rglob("*.py")}
    reached = reached_from("app.data.dali_source", graph)
    for module in reached:
        names = external_imports(ast.parse(files[module].read_text()))
        assert not names & {"torch", "torchvision"}, module
    assert {"app.data.augment", "app.data.auto_augment"} <= reached


def test_pillow_loader_processes_load_no_torchvision_or_timm():
    """Each loader process imports its dataset's module; torchvision (which pulls in
    torch._dynamo) costs it ~3 s of CPU and is imported only by an auto-augment op that runs."""
    graph, files = import_graph(), {module_name(p): p for p in APP.rglob("*.py")}
    for start in ("app.data.pillow_pipeline", "app.data.encoded"):
        for module in reached_from(start, graph):
            names = external_imports(ast.parse(files[module].read_text()), top_level_only=True)
            assert not names & {"torchvision", "timm"}, (start, module)


# Words of the team's own process, not of a user's machines: issue numbers and notes, the
# development machine, colleagues, how GPU machines were come by and what travelled to them.
NOT_THE_PRODUCTS = re.compile(
    r"\bissues? #?\d+|\bissue note|\btest machine\b|\bthe GPU machine\b|GPU machine's \d|"
    r"\blent\b|a quick check of a new machine|other developers|another engineer|design brief|"
    r"\.carry\b|\bthis VM\b|device (?:call|tool)|small files only|\bas in the seed\b",
    re.IGNORECASE)


def product_texts() -> list[Path]:
    return [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "bin").glob("*.py"),
            *(REPO / "configs").glob("*"), *APP.rglob("*.py")]


def test_the_product_speaks_of_its_users_machines_not_of_the_teams():
    found = [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
             for path in product_texts()
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if NOT_THE_PRODUCTS.search(line)]
    assert found == []


def test_the_words_rule_finds_an_issue_number_and_the_machine():
    for line in ("as before issue 18", "Issue #7 asked for it", "on the 2-core test machine",
                 "like the GPU machine's 2.11", "when a GPU is lent", "in an issue note",
                 "carry .carry/ along", "other developers' runs", "On this VM, shared"):
        assert NOT_THE_PRODUCTS.search(line), line
    for line in ("an issue with the bucket", "the machine's 2 cores", "a GPU machine of yours"):
        assert not NOT_THE_PRODUCTS.search(line), line


def test_files_are_locked_one_way_in_one_module():
    """fetcher.machine_lock: the downloads' locks and the disk cache's ledger's."""
    lockers = sorted(str(path.relative_to(REPO)) for path in APP.rglob("*.py")
                     if {"fcntl", "filelock"} & {name.split(".")[0] for name in
                                                 imported_names(path)})
    assert lockers == ["app/catalog/fetcher.py"]


def imported_names(path: Path) -> set[str]:
    """Every module `path` imports, by its absolute name (anywhere in the file)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names
