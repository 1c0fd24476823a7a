"""The package layers, checked on the source: shardrl > trainer | rollout_worker > buffer.

`make lint` runs this file, so a forbidden import fails the lint step, not only the test run.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = ("shardrl", "buffer", "trainer", "rollout_worker")
# What each of our packages may import of ours.
ALLOWED = {
    "buffer": {"buffer"},
    "trainer": {"buffer", "trainer"},
    "rollout_worker": {"buffer", "rollout_worker"},
    "shardrl": set(OURS),
}
HEAVY = ("torch", "transformers", "vllm", "peft", "safetensors")


def _modules(pkg: str, root: Path = ROOT) -> list[Path]:
    return sorted((root / pkg).rglob("*.py"))


def _dotted(path: Path, root: Path = ROOT) -> str:
    """``buffer/config/rules.py`` -> ``buffer.config.rules``; a package's ``__init__`` is the package."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, top_level_only: bool, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, top-level package) of every import; relative imports resolve to the file's own package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    own = path.relative_to(root).parts[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.lineno, own if node.level else (node.module or "").split(".")[0]))
    return out


def _layer_violations(pkg: str, root: Path = ROOT) -> list[str]:
    return [
        f"{p.relative_to(root)}:{line} imports {mod}"
        for p in _modules(pkg, root)
        for line, mod in _imports(p, top_level_only=False, root=root)
        if mod in OURS and mod not in ALLOWED[pkg]
    ]


def _heavy_at_import(root: Path = ROOT) -> list[str]:
    return [
        f"{p.relative_to(root)}:{line} imports {mod} at module level"
        for p in _modules("buffer", root)
        for line, mod in _imports(p, top_level_only=True, root=root)
        if mod in HEAVY
    ]


def _module_imports(path: Path, known: set[str], root: Path = ROOT) -> set[str]:
    """The modules of ``known`` that ``path`` imports anywhere: at the top, in a function, under TYPE_CHECKING.

    A deferred import still ties the two modules together, so it counts: moving an import into a function only
    hides a cycle from the interpreter, not from the reader.
    """
    me = _dotted(path, root)
    package = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join([*base, *([node.module] if node.module else [])])
            names = [mod, *(f"{mod}.{a.name}" for a in node.names)]  # `from . import x` names module x
        else:
            continue
        out.update(n for n in names if n in known and n != me)
    return out


def _cycles(pkg: str, root: Path = ROOT) -> list[list[str]]:
    """Each import cycle among the modules of ``pkg``, as the list of its modules (Tarjan's strongly connected
    components of more than one module)."""
    paths = {_dotted(p, root): p for p in _modules(pkg, root)}
    graph = {m: _module_imports(p, set(paths), root) for m, p in paths.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("pkg", OURS)
def test_package_imports_only_its_lower_layers(pkg: str) -> None:
    bad = _layer_violations(pkg)
    assert not bad, "layer violation: " + "; ".join(bad)


@pytest.mark.parametrize("pkg", OURS)
def test_no_import_cycle_inside_a_package(pkg: str) -> None:
    cycles = _cycles(pkg)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_buffer_imports_nothing_heavy_at_import_time() -> None:
    bad = _heavy_at_import()
    assert not bad, "; ".join(bad)


@pytest.mark.proc
def test_importing_every_buffer_module_loads_no_torch() -> None:
    mods = [_dotted(p) for p in _modules("buffer")]
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        f"print(sorted(h for h in {HEAVY!r} if h in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    """The AST walks must find imports nested in functions, relative ones and cycles hidden by a deferred import,
    or the tests above prove nothing.  They run on a copy of buffer/, so the source tree is never written to."""
    shutil.copytree(ROOT / "buffer", tmp_path / "buffer", ignore=shutil.ignore_patterns("__pycache__"))
    f = tmp_path / "buffer" / "_probe_for_layer_test.py"
    f.write_text("import torch\n\n\ndef f():\n    from trainer import loop\n    from . import _probe_b\n")
    (tmp_path / "buffer" / "_probe_b.py").write_text("from buffer._probe_for_layer_test import f\n")
    found = _imports(f, top_level_only=False, root=tmp_path)
    assert (5, "trainer") in found and (1, "torch") in found and (6, "buffer") in found
    assert "buffer/_probe_for_layer_test.py:5 imports trainer" in _layer_violations("buffer", tmp_path)
    assert "buffer/_probe_for_layer_test.py:1 imports torch at module level" in _heavy_at_import(tmp_path)
    assert ["buffer._probe_b", "buffer._probe_for_layer_test"] in _cycles("buffer", tmp_path)
    assert not (ROOT / "buffer" / f.name).exists()


# The rooms inside rollout_worker, lowest first: a module may import its own rank and the ranks below it, never one
# above.  Modules in no room (prompts, rewards, following, admission, publishing, ...) are helpers at the rank of
# ``scoring``: the episodes, the sources and the worker sit on top of them, never the other way round.
ROOMS = (
    "engines",
    "scoring",
    "envs|streaming",
    "checks|preflight|sources",
    "worker|evaluator",
    "supervisor|__main__",
)
HELPER_RANK = 1


def _room(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "rollout_worker" or len(parts) < 2:
        return None
    for rank, names in enumerate(ROOMS):
        if parts[1] in names.split("|"):
            return rank
    return None


def _room_violations(root: Path = ROOT) -> list[str]:
    paths = {_dotted(p, root): p for p in _modules("rollout_worker", root)}
    bad = []
    for mod, path in sorted(paths.items()):
        mine = _room(mod)
        ceiling = HELPER_RANK if mine is None else mine
        for other in sorted(_module_imports(path, set(paths), root)):
            theirs = _room(other)
            if theirs is not None and theirs > ceiling:
                bad.append(f"{mod} imports {other}")
    return bad


def test_rollout_worker_rooms_import_only_downwards() -> None:
    bad = _room_violations()
    assert not bad, f"rooms ({' < '.join(ROOMS)}): " + "; ".join(bad)


def test_the_room_checker_sees_an_upward_import(tmp_path: Path) -> None:
    shutil.copytree(
        ROOT / "rollout_worker", tmp_path / "rollout_worker", ignore=shutil.ignore_patterns("__pycache__")
    )
    (tmp_path / "rollout_worker" / "engines" / "_probe.py").write_text(
        "def f():\n    from rollout_worker.sources.batch import BatchSource\n"
    )
    (tmp_path / "rollout_worker" / "streaming_probe.py").write_text(
        "from rollout_worker.worker import main\n"
    )
    found = _room_violations(tmp_path)
    assert "rollout_worker.engines._probe imports rollout_worker.sources.batch" in found
    assert "rollout_worker.streaming_probe imports rollout_worker.worker" in found
