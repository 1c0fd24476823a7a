"""The package layers, checked on the source: shardrl > trainer | rollout_worker > buffer.

`make lint` runs this file, so a forbidden import fails the lint step, not only the test run.
"""

from __future__ import annotations

import ast
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


def _modules(pkg: str) -> list[Path]:
    return sorted((ROOT / pkg).rglob("*.py"))


def _imports(path: Path, top_level_only: bool) -> list[tuple[int, str]]:
    """(line, top-level package) of every import; relative imports resolve to the file's own package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    own = path.relative_to(ROOT).parts[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.lineno, own if node.level else (node.module or "").split(".")[0]))
    return out


@pytest.mark.parametrize("pkg", OURS)
def test_package_imports_only_its_lower_layers(pkg: str) -> None:
    bad = [
        f"{p.relative_to(ROOT)}:{line} imports {mod}"
        for p in _modules(pkg)
        for line, mod in _imports(p, top_level_only=False)
        if mod in OURS and mod not in ALLOWED[pkg]
    ]
    assert not bad, "layer violation: " + "; ".join(bad)


def test_buffer_imports_nothing_heavy_at_import_time() -> None:
    bad = [
        f"{p.relative_to(ROOT)}:{line} imports {mod} at module level"
        for p in _modules("buffer")
        for line, mod in _imports(p, top_level_only=True)
        if mod in HEAVY
    ]
    assert not bad, "; ".join(bad)


def test_importing_every_buffer_module_loads_no_torch() -> None:
    mods = [f"buffer.{p.stem}" for p in _modules("buffer") if p.stem != "__init__"]
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        f"print(sorted(h for h in {HEAVY!r} if h in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    """The AST walk must find imports nested in functions and relative ones, or the tests above prove nothing."""
    f = ROOT / "buffer" / "_probe_for_layer_test.py"
    f.write_text("def f():\n    from trainer import loop\n    import torch\n")
    try:
        found = _imports(f, top_level_only=False)
    finally:
        f.unlink()
    assert (2, "trainer") in found and (3, "torch") in found
