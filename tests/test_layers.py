"""The package's layers, read from its modules' own imports: the workbench tools above the runtime,
the runtime above the kernels, no import cycles, nothing in the package that reads the checkout's
scripts/ or results/.

Layers (imports run downward only):

| layer | modules |
|---|---|
| workbench | `jfa.workbench.*`: bench, providers, head-to-head, report, plots, widgets, inspect, CLI |
| runtime | `jfa` and its other top-level modules: API, dispatch, validation, references, schedules |
| kernels | `jfa.kernels.*` |

The kernels stand on their own: a module under `jfa/kernels/` imports only other kernel modules and
`jfa.specs` (the shared facts), so a reader can take the kernels without the runtime around them.

`jfa.__main__` is the command line's entry point: it sits above every layer and delegates to
`jfa.workbench.cli`. Imports are read from the source (`ast`), wherever they are written (module
level, inside a function, under `TYPE_CHECKING`), so a lazy import counts like any other.
"""
import ast
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE_DIR = REPO / "jfa"
ENTRY_POINT = "jfa.__main__"
WORKBENCH = "jfa.workbench"
KERNELS = "jfa.kernels"
KERNEL_IMPORTS_BESIDES_KERNELS = ("jfa.specs",)  # what a kernel module may import outside jfa.kernels
# The checkout's folders that an installed package does not have: a path into one is a word that starts
# with the folder and a slash, or the bare folder name joined into a path (`root / "results"`).
CHECKOUT_ONLY_DIRS = ("scripts", "results")
CHECKOUT_PATH = re.compile(rf"^(\.\.?/)*({'|'.join(CHECKOUT_ONLY_DIRS)})/")
CHECKOUT_DIR = re.compile(rf"^(\.\.?/)*({'|'.join(CHECKOUT_ONLY_DIRS)})/?$")
PATH_CALLS = ("Path", "PurePath", "join", "open")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}
PACKAGES = {name for name, path in MODULES.items() if path.name == "__init__.py"}


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _resolve(importer: str, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative imports resolved against `importer`)."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if importer in PACKAGES else base[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str) -> set[str]:
    """The jfa modules that module `name` imports, anywhere in its source. `from P import X` counts
    as importing P.X where that is a module of the package, else P."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(name, node)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in MODULES else source)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports_of(name) for name in MODULES}


def _layer(name: str) -> str:
    if name == ENTRY_POINT:
        return "entry point"
    if _within(name, WORKBENCH):
        return "workbench"
    if _within(name, KERNELS):
        return "kernels"
    return "runtime"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_imports(name):
    importlib.import_module(name)


@pytest.mark.parametrize("name", sorted(n for n in MODULES if _layer(n) in ("runtime", "kernels")))
def test_runtime_and_kernels_never_import_the_workbench(name):
    upward = sorted(m for m in GRAPH[name] if _within(m, WORKBENCH))
    assert not upward, f"{name} ({_layer(name)}) imports the workbench: {upward}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if _layer(n) == "kernels"))
def test_kernels_import_only_kernels_and_the_shared_facts(name):
    outside = sorted(m for m in GRAPH[name] if not _within(m, KERNELS) and m not in KERNEL_IMPORTS_BESIDES_KERNELS)
    assert not outside, (f"{name} (kernels) imports {outside}: a kernel module imports only jfa.kernels.* and "
                         f"{', '.join(KERNEL_IMPORTS_BESIDES_KERNELS)}; move what it needs into the kernels or pass "
                         "it in")


def test_the_entry_point_delegates_to_the_workbench_cli():
    assert GRAPH[ENTRY_POINT] == {f"{WORKBENCH}.cli"}


def test_the_import_graph_has_no_cycles():
    """Depth-first search over GRAPH; a module met again while still on the path closes a cycle."""
    on_path, done, cycles = [], set(), []

    def visit(name):
        on_path.append(name)
        for imported in sorted(GRAPH[name]):
            if imported in on_path:
                cycles.append(on_path[on_path.index(imported):] + [imported])
            elif imported not in done:
                visit(imported)
        on_path.pop()
        done.add(name)

    for name in sorted(GRAPH):
        if name not in done:
            visit(name)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_importing_the_runtime_loads_no_workbench_module():
    """What the imports above cannot see (importlib with computed names): run it and look."""
    code = ("import sys, json, jfa, jfa.ops, jfa.dispatch, jfa.block, jfa.sparse, jfa.fp8; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('jfa.workbench') or m == 'plotly')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the string constants that are docstrings (of the module, classes and functions)."""
    owners = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef,
                                                                      ast.AsyncFunctionDef))]
    return {id(owner.body[0].value) for owner in owners
            if owner.body and isinstance(owner.body[0], ast.Expr) and isinstance(owner.body[0].value, ast.Constant)}


def _joined_into_a_path(node: ast.Constant, parents: dict) -> bool:
    parent = parents.get(id(node))
    if isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.Div):
        return True
    if isinstance(parent, ast.Call) and node in parent.args:
        func = parent.func
        return (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)) in PATH_CALLS
    return False


def checkout_paths(source: str) -> list[str]:
    """String constants of `source` (docstrings aside) that name a path in the checkout's scripts/ or
    results/: "scripts/x.py" or "../results/y.json" anywhere in a string, or "results" joined into a
    path."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in skip:
            continue
        words = [word.strip("`'\"()[],;:") for word in node.value.split()]
        if (any(CHECKOUT_PATH.match(word) for word in words)
                or (CHECKOUT_DIR.match(node.value) and _joined_into_a_path(node, parents))):
            found.append(node.value)
    return found


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_reads_the_checkouts_scripts_or_results(name):
    found = checkout_paths(MODULES[name].read_text())
    assert not found, (f"{name} names paths in the checkout's {' or '.join(CHECKOUT_ONLY_DIRS)}, which an "
                       f"installed package has not: {found}; take the directory as an argument")


def test_the_checkout_path_rule_sees_what_it_must():
    assert checkout_paths('ROOT / "results" / "x.json"') == ["results"]
    assert checkout_paths('Path("scripts")') == ["scripts"]
    assert checkout_paths('run(["python", "scripts/flex_worker.py"])') == ["scripts/flex_worker.py"]
    assert checkout_paths('default = "../results/report.html"') == ["../results/report.html"]
    assert checkout_paths('"""Reads results/ of the checkout."""\nhelp = "results JSON files"\nadd("results")') == []
