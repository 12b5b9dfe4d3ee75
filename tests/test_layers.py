"""The package's house rules, read from its source with ``ast``: six layers that import only downward, and no import
circle anywhere, between modules or between folders (imports inside functions count: they run too, only later); and
what a module offers others is its ``__all__``: no code imports a name it does not list, nor a ``_private`` one."""

from __future__ import annotations

import ast
import functools
import re
import tomllib
from pathlib import Path

import pytest

import tarq_deploy

PACKAGE_ROOT = Path(tarq_deploy.__file__).parent
PACKAGE = PACKAGE_ROOT.name
REPO_ROOT = PACKAGE_ROOT.parent

# Lowest first. A module belongs to the layer of the longest of its prefixes listed here (ARCHITECTURE.md, "Layers").
LAYERS: dict[str, tuple[str, ...]] = {
    "base": ("tarq_deploy", "tarq_deploy.errors", "tarq_deploy.fileio", "tarq_deploy.checks", "tarq_deploy.machine",
             "tarq_deploy.model_source", "tarq_deploy.hashing", "tarq_deploy.values", "tarq_deploy.vocabulary",
             "tarq_deploy.safetensors_view"),
    "core": ("tarq_deploy.quant", "tarq_deploy.data", "tarq_deploy.models", "tarq_deploy.checkpoint"),
    # the options schema, the pipeline, the sequential driver and its work directory: above what they orchestrate
    "calibration": ("tarq_deploy.calibration",),
    "formats": ("tarq_deploy.formats",),
    "runtimes": ("tarq_deploy.runtimes",),
    "apps": ("tarq_deploy.cli", "tarq_deploy.commands", "tarq_deploy.evaluate", "tarq_deploy.bench",
             "tarq_deploy.hub", "tarq_deploy.sweep"),
}
LAYER_RANK = {name: rank for rank, name in enumerate(LAYERS)}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(PACKAGE_ROOT.rglob("*.py"))}


def layer_of(module: str) -> str:
    """The layer of ``module``: the longest matching prefix wins (``tarq_deploy`` alone is the package's root)."""
    best, best_len = None, -1
    for layer, prefixes in LAYERS.items():
        for prefix in prefixes:
            matches = module == prefix or (module.startswith(prefix + ".") and prefix != PACKAGE)
            if matches and len(prefix) > best_len:
                best, best_len = layer, len(prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {Path(__file__).name}")
    return best


def _resolve(importer: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute module name of a (possibly relative) ``from`` import."""
    if level == 0:
        return name or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _our_module(candidate: str) -> str | None:
    """The module of ours that ``candidate`` names (``a.b.c`` may be module ``a.b`` and attribute ``c``)."""
    while candidate:
        if candidate in MODULES:
            return candidate
        candidate = candidate.rpartition(".")[0]
    return None


def imports_of(module: str) -> set[str]:
    """Every module of the package that ``module`` imports, at top level or inside a function."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, path.name == "__init__.py", node.level, node.module)
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            ours = _our_module(name)
            # `from . import x` names the package and x; a package importing its own submodule is no edge back.
            if ours is not None and ours != module and not (module.startswith(ours + ".") and ours == name):
                found.add(ours)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}



def test_every_module_is_in_a_layer() -> None:
    for module in MODULES:
        layer_of(module)


def test_every_folder_is_in_one_layer() -> None:
    """A folder's modules share its layer: a module filed in one folder and declared in another layer (as
    models/loader.py once was) would hide a folder-level loop behind the module-level rules."""
    split = {folder: sorted({layer_of(m) for m in MODULES if folder_of(m) == folder})
             for folder in set(map(folder_of, MODULES))}
    assert {f: layers for f, layers in split.items() if len(layers) > 1} == {}


# The command line is one unit of the folder graph: cli.py is the table of commands/'s modules, and demo runs the
# other commands through it.
FOLDER_UNITS = {"tarq_deploy.cli": "tarq_deploy.commands"}


def folder_of(module: str) -> str:
    """The folder-level unit of ``module``: its top-level subpackage (tarq_deploy.quant), or a top-level module
    itself (tarq_deploy.checkpoint)."""
    parts = module.split(".")
    unit = ".".join(parts[:2]) if len(parts) > 1 else module
    return FOLDER_UNITS.get(unit, unit)


FOLDER_GRAPH: dict[str, set[str]] = {}
for _module, _targets in GRAPH.items():
    FOLDER_GRAPH.setdefault(folder_of(_module), set()).update(
        folder_of(t) for t in _targets if folder_of(t) != folder_of(_module))


def test_no_folder_level_circle() -> None:
    """No import circle between folders either: quant/ importing models/ while models/ imports quant/ is a loop even
    when no two modules import each other."""
    cycle = find_cycle(FOLDER_GRAPH)
    edges = {(a, b): sorted(f"{m} -> {t}" for m, ts in GRAPH.items() for t in ts
                            if folder_of(m) == a and folder_of(t) == b) for a, b in zip(cycle or [], (cycle or [])[1:])}
    assert cycle is None, "folder-level circle: " + " -> ".join(cycle) + f"\n{edges}"


def test_the_folder_check_catches_a_planted_folder_loop() -> None:
    planted = {"tarq_deploy.quant.x": {"tarq_deploy.models.y"}, "tarq_deploy.models.y": set(),
               "tarq_deploy.models.z": {"tarq_deploy.quant.w"}, "tarq_deploy.quant.w": set()}
    folders: dict[str, set[str]] = {}
    for module, targets in planted.items():
        folders.setdefault(folder_of(module), set()).update(folder_of(t) for t in targets)
    assert find_cycle(planted) is None and find_cycle(folders) is not None


QUANT_MAY_NOT_IMPORT = ("tarq_deploy.checkpoint", "tarq_deploy.models", "tarq_deploy.data", "tarq_deploy.commands",
                        "tarq_deploy.calibration")


def test_quant_holds_lattices_and_solvers_only() -> None:
    """quant/ imports no checkpoint, model adapter, corpus, calibration or command: they are built on it."""
    found = [f"{m} -> {t}" for m, ts in GRAPH.items() if m.startswith("tarq_deploy.quant")
             for t in ts if t.startswith(QUANT_MAY_NOT_IMPORT)]
    assert not found, found


def test_the_sweep_imports_no_command() -> None:
    """The sweep validates its [quantize] table with the options schema (calibration/options.py), not through the
    command's argparse parser."""
    found = [f"{m} -> {t}" for m, ts in GRAPH.items() if m.startswith("tarq_deploy.sweep")
             for t in ts if t.startswith(("tarq_deploy.commands", "tarq_deploy.cli"))]
    assert not found, found
    assert "_actions" not in (PACKAGE_ROOT / "sweep" / "plan.py").read_text()


def test_imports_only_go_down_the_layers() -> None:
    upward = [f"{module} ({layer_of(module)}) imports {target} ({layer_of(target)})"
              for module, targets in GRAPH.items() for target in sorted(targets)
              if LAYER_RANK[layer_of(target)] > LAYER_RANK[layer_of(module)]]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle in ``graph`` (as a path that returns to its start), or None: an iterative depth-first
    search with three colours. Importing a package from one of its own submodules (for ``__version__``) is no
    circle: the package's ``__init__`` does not import it back."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = dict.fromkeys(graph, WHITE)
    for start in sorted(graph):
        if colour[start] != WHITE:
            continue
        stack: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        colour[start] = GREY
        while stack:
            node, pending = stack[-1]
            if not pending:
                colour[node] = BLACK
                stack.pop()
                continue
            nxt = pending.pop()
            if colour[nxt] == GREY:
                path = [n for n, _ in stack]
                return path[path.index(nxt):] + [nxt]
            if colour[nxt] == WHITE:
                colour[nxt] = GREY
                stack.append((nxt, sorted(graph[nxt])))
    return None


def test_no_import_circle() -> None:
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_planted_circle() -> None:
    planted = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    cycle = find_cycle(planted)
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"a", "b", "c"}
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_layer_check_catches_an_upward_import() -> None:
    assert LAYER_RANK[layer_of("tarq_deploy.commands.export")] > LAYER_RANK[layer_of("tarq_deploy.formats")]
    assert layer_of("tarq_deploy") == "base" and layer_of("tarq_deploy.cli") == "apps"
    assert LAYER_RANK["core"] < LAYER_RANK["calibration"] < LAYER_RANK["formats"]


def test_relative_imports_resolve_to_their_module() -> None:
    assert _resolve("tarq_deploy.commands.eval", False, 2, "data.corpus") == "tarq_deploy.data.corpus"
    assert _resolve("tarq_deploy.quant", True, 1, "lattice") == "tarq_deploy.quant.lattice"
    assert _resolve("tarq_deploy.calibration.pipeline", False, 2, None) == "tarq_deploy"


def test_only_tarq_deploy_is_packaged() -> None:
    """setuptools is told to find tarq_deploy* alone, and no other top-level folder holds Python packages that a
    source install could pick up by accident."""
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert config["tool"]["setuptools"]["packages"]["find"]["include"] == [f"{PACKAGE}*"]
    strays = sorted(str(p.relative_to(REPO_ROOT)) for p in REPO_ROOT.glob("*/__init__.py")
                    if p.parent.name != PACKAGE)
    assert not strays, f"top-level packages besides {PACKAGE}: {strays}"


@pytest.mark.parametrize("name", ["bench", "converters"])
def test_no_generic_top_level_module_is_importable(name: str, tmp_path: Path) -> None:
    """From outside the repository (where an installed user stands), the old top-level names do not import."""
    import subprocess
    import sys
    code = f"import importlib.util, sys; sys.exit(0 if importlib.util.find_spec({name!r}) is None else 1)"
    assert subprocess.run([sys.executable, "-c", code], cwd=tmp_path).returncode == 0


def test_the_argparse_namespace_stays_in_the_command_line_layer():
    """Below the CLI, options travel as typed dataclasses (QuantizeOptions, DecodeOptions, ReportOptions, ...): no
    module outside cli.py, commands/ and the benchmarks' own command lines takes or builds an argparse Namespace."""
    command_lines = ("tarq_deploy.cli", "tarq_deploy.commands", "tarq_deploy.bench")
    offenders = []
    for module, path in MODULES.items():
        if module.startswith(command_lines):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "Namespace":
                offenders.append(f"{module}:{node.lineno}")
            elif isinstance(node, ast.Name) and node.id == "Namespace":
                offenders.append(f"{module}:{node.lineno}")
    assert not offenders, f"argparse.Namespace below the command line: {offenders}"


# ------------------------------------------------------------------------------------ what a module offers others
def pinned_scripts() -> set[Path]:
    """results/ scripts that run at the commit their README pins (its "Pinned code" section names them): they import
    the package as it was then, not as it is."""
    pinned: set[Path] = set()
    for readme in (REPO_ROOT / "results").glob("*/README.md"):
        _, found, section = readme.read_text(encoding="utf-8").partition("\n## Pinned code\n")
        if found:
            names = re.findall(r"\b([\w-]+\.py)\b", section.split("\n## ", 1)[0])
            pinned |= {readme.parent / name for name in names if (readme.parent / name).is_file()}
    return pinned


def importing_files() -> list[Path]:
    """The code that imports the package: the package itself, the benchmarks' scripts and results/ scripts not
    pinned to an earlier commit. (Tests may reach for internals: they are the internals' own checks.)"""
    scripts = [p for folder in ("bench", "results") for p in sorted((REPO_ROOT / folder).rglob("*.py"))]
    return [*MODULES.values(), *(p for p in scripts if p not in pinned_scripts())]


@functools.cache
def declared_all(module: str) -> list[str] | None:
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return [ast.literal_eval(element) for element in node.value.elts]
    return None


@functools.cache
def names_imported_from_modules() -> list[tuple[str, str, str]]:
    """(importing file:line, module, name) for every ``from MODULE import name`` of a module file of ours (a package's
    __init__ offers its submodules too, and is left out)."""
    found = []
    for path in importing_files():
        importer = module_name(path) if path.is_relative_to(PACKAGE_ROOT) else ""
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            module = _resolve(importer, path.name == "__init__.py", node.level, node.module)
            if module in MODULES and MODULES[module].name != "__init__.py" and module != importer:
                where = f"{path.relative_to(REPO_ROOT)}:{node.lineno}"
                found += [(where, module, alias.name) for alias in node.names]
    return found


def test_no_code_imports_a_private_name_of_another_module() -> None:
    private = [f"{where}: {name} from {module}" for where, module, name in names_imported_from_modules()
               if name.startswith("_") and not name.startswith("__")]
    assert not private, "a _private name used outside its module: make it public or keep it home\n" + "\n".join(private)


def test_every_module_others_import_from_declares_what_it_offers() -> None:
    """``__all__`` on each module other code imports from, listing every name it is imported for."""
    missing = []
    for where, module, name in names_imported_from_modules():
        offered = declared_all(module)
        if offered is None:
            missing.append(f"{module}: no __all__ (imported by {where})")
        elif name not in offered:
            missing.append(f"{where}: {name} is not in {module}.__all__")
    assert not missing, "\n".join(sorted(set(missing)))


def test_a_results_script_that_imports_a_path_gone_from_the_package_is_pinned() -> None:
    """A script whose import would fail today runs at its README's pinned commit, and says so there."""
    stale = set()
    for path in sorted((REPO_ROOT / "results").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(PACKAGE + "."):
                if node.module not in MODULES:
                    stale.add(path)
    assert stale <= pinned_scripts(), sorted(str(p.relative_to(REPO_ROOT)) for p in stale - pinned_scripts())
