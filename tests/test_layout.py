"""The shape of app/: no import cycles (type-checking-only imports count), small modules, the
layers in their order, and every name table agreeing with the config's choices."""

import ast
import dataclasses
from pathlib import Path

from app.config import Config
from app.data.auto_augment import AUTO_AUGMENT
from app.data.decoders import DECODERS
from app.loggers import LOGGERS
from app.parallel.plans import SYNC_MODES

APP = Path(__file__).resolve().parents[1] / "app"
MAX_LINES = 350


def module_name(path: Path) -> str:
    parts = path.relative_to(APP.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Modules of app/ that `path` imports anywhere (top level, functions, TYPE_CHECKING)."""
    name = module_name(path)
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


def import_graph() -> dict[str, set[str]]:
    files = sorted(APP.rglob("*.py"))
    modules = {module_name(p) for p in files}
    return {module_name(p): imports_of(p, modules) for p in files}


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


def test_layers_import_only_downwards():
    graph = import_graph()
    # the catalog and the tables sit below the data pipeline, the model and the loop
    for low in ("app.catalog.catalog", "app.catalog.tables", "app.catalog.storage"):
        above = ("app.data", "app.training", "app.parallel")
        assert not {t for t in graph[low] if t.startswith(above)}
    # the process supervisor knows nothing of training or logging
    parallel = {t for m, targets in graph.items() if m.startswith("app.parallel")
                for t in targets}
    assert not {t for t in parallel if t.startswith(("app.training", "app.loggers", "app.launch"))}


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


def test_dalis_reader_processes_import_no_torch():
    """They run the recipes' plan() (crops, flips, auto-augment draws) and need no torch."""
    graph, files = import_graph(), {module_name(p): p for p in APP.rglob("*.py")}
    reached, todo = set(), ["app.data.dali_source"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += graph[module]
    for module in reached:
        tree = ast.parse(files[module].read_text())
        names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names]
        names += [node.module or "" for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom)]
        assert not [n for n in names if n.split(".")[0] in ("torch", "torchvision")], module
    assert {"app.data.augment", "app.data.auto_augment"} <= reached
