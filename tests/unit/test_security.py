"""The run directory is the trust boundary: explicit modes, refused world-writable runs, size caps, no unpickling.

docs/RELIABILITY.md ("Trust") says what is trusted; these tests keep the code to it.
"""

from __future__ import annotations

import ast
import errno
import json
import os
import stat
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from buffer import fsio, plans, shards, weights
from buffer.config import ConfigError, ShardRLConfig
from buffer.control import init_state
from buffer.layout import RunLayout
from buffer.records import LatestPointer, RecordError, read_record
from buffer.run import init_run, open_run

from .buffer_helpers import sample, stub_config

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("buffer", "trainer", "rollout_worker", "shardrl", "bench")

# --------------------------------------------------------------------------------------- nothing unpickled

_PICKLERS = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
_DCP_LOADS = {"load", "load_state_dict"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _kw(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _unpickling(call: ast.Call, picklers: set[str], dcp_names: set[str]) -> str | None:
    """Why ``call`` may unpickle (or evaluate) bytes it reads, or None."""
    name = _dotted(call.func)
    head, _, last = name.rpartition(".")
    if head in picklers and last in {"load", "loads", "Unpickler", "open"}:
        return name
    if name in {"eval", "exec"}:
        return name
    if head == "torch" and last == "load" and not _is_true(_kw(call, "weights_only")):
        return "torch.load without weights_only=True"
    if head in {"np", "numpy"} and last == "load" and _is_true(_kw(call, "allow_pickle")):
        return "numpy.load(allow_pickle=True)"
    if last == "read_pickle" or last in {"unsafe_load", "full_load"}:
        return name
    if head == "yaml" and last == "load" and "Safe" not in _dotted(_kw(call, "Loader") or ast.Constant(None)):
        return "yaml.load without a SafeLoader"
    if head in dcp_names and last in _DCP_LOADS:
        return "DCP load (unpickles .metadata)"
    return None


def _import_names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """The names under which ``tree`` imports a pickler module, and DCP."""
    picklers, dcp = set(_PICKLERS), {"torch.distributed.checkpoint"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            picklers |= {a.asname or a.name for a in node.names if a.name in _PICKLERS}
            dcp |= {a.asname or a.name for a in node.names if a.name == "torch.distributed.checkpoint"}
        if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            dcp |= {a.asname or a.name for a in node.names if a.name == "checkpoint"}
    return picklers, dcp


class _Calls(ast.NodeVisitor):
    """Every suspicious call with the innermost function around it."""

    def __init__(self, picklers: set[str], dcp: set[str]):
        self.picklers, self.dcp = picklers, dcp
        self.stack: list[str] = []
        self.found: list[tuple[int, str, str]] = []

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module in _PICKLERS and any(a.name in {"load", "loads", "Unpickler"} for a in node.names):
            self.found.append((node.lineno, "", f"from {node.module} import load/loads/Unpickler"))

    def visit_Call(self, node: ast.Call) -> None:
        if why := _unpickling(node, self.picklers, self.dcp):
            self.found.append((node.lineno, self.stack[-1] if self.stack else "", why))
        self.generic_visit(node)


def unpickling_calls(source: str) -> list[tuple[int, str, str]]:
    """(line, enclosing function, why) of every call in ``source`` that may unpickle what it reads."""
    tree = ast.parse(source)
    calls = _Calls(*_import_names(tree))
    calls.visit(tree)
    return sorted(calls.found)


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle\npickle.loads(b)",
        "import pickle as p\ndef f():\n    return p.load(open('x', 'rb'))",
        "from pickle import loads",
        "import torch\ntorch.load('x')",
        "import torch\ntorch.load('x', weights_only=False)",
        "import yaml\nyaml.load(s)",
        "eval(text)",
        "import numpy as np\nnp.load('x', allow_pickle=True)",
        "import torch.distributed.checkpoint as dcp\ndcp.load(sd, checkpoint_id='x')",
        "from torch.distributed import checkpoint\ncheckpoint.load(sd)",
    ],
)
def test_the_scan_finds_unpickling(snippet: str) -> None:
    assert unpickling_calls(snippet), snippet


@pytest.mark.parametrize(
    "snippet",
    ["import torch\ntorch.load('x', weights_only=True)", "import yaml\nyaml.load(s, Loader=yaml.SafeLoader)"],
)
def test_the_scan_passes_safe_loads(snippet: str) -> None:
    assert unpickling_calls(snippet) == []


def test_no_module_unpickles_what_it_reads_but_the_checksummed_dcp_load() -> None:
    """The one exception, DCP's .metadata, is loaded only after ``verify_metadata`` in the same function."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            source = path.read_text()
            for line, fn, why in unpickling_calls(source):
                found[f"{path.relative_to(ROOT)}:{line} {fn}"] = (why, source, line)
    allowed = {k for k in found if k.startswith("trainer/checkpoint.py:") and k.endswith(" load_checkpoint")}
    assert set(found) - allowed == set(), {k: found[k][0] for k in set(found) - allowed}
    assert allowed, "load_checkpoint no longer loads through DCP: update this test"
    for key in allowed:
        _, source, line = found[key]
        before = source.splitlines()[:line]
        body = before[max(i for i, t in enumerate(before) if t.startswith("def load_checkpoint(")) :]
        assert any("verify_metadata(" in t for t in body), f"{key}: DCP load without verify_metadata first"


# ------------------------------------------------------------------------------------------------- modes


@pytest.fixture
def restore_modes() -> Iterator[None]:
    before, umask = fsio.modes(), os.umask(0o022)
    os.umask(umask)
    yield
    fsio.set_modes(before)
    os.umask(umask)


def _config(tmp_path: Path, **run: object) -> ShardRLConfig:
    return stub_config(tmp_path, run=dict(run))


def _use_the_run(layout: RunLayout, run_id: str) -> None:
    """One write through every protocol: shard, plan, weights, control, leases' directory."""
    w = shards.ShardWriter(layout, run_id, "w0")
    w.add(sample(0))
    path = w.flush()
    assert path is not None
    plans.PlanLog.claim(layout).write_plan(1, [path.name], [(path.name, 0)])
    st = weights.staging_dir(layout, 1)
    (st / "model.safetensors").write_bytes(b"x" * 8)
    (st / "model.safetensors").chmod(0o600)
    (st / "config.json").write_text("{}")  # a library's write: the umask the run set decides
    weights.commit_version(layout, 1, st, step=1, dtype="float32")
    init_state(layout, 2)


def _modes_under(root: Path) -> tuple[set[int], set[int]]:
    files, dirs = set(), set()
    for here, dnames, fnames in os.walk(root):
        dirs |= {stat.S_IMODE(os.stat(os.path.join(here, d)).st_mode) for d in dnames}
        files |= {stat.S_IMODE(os.stat(os.path.join(here, f)).st_mode) for f in fnames}
    return files, dirs | {stat.S_IMODE(root.stat().st_mode)}


def test_a_group_shared_run_creates_everything_group_shared(tmp_path: Path, restore_modes: None) -> None:
    os.umask(0o077)  # whatever the user's shell had: the run's modes decide, not this
    run = init_run(tmp_path / "run", _config(tmp_path, group_shared=True))
    _use_the_run(run.layout, run.run_id)
    files, dirs = _modes_under(run.layout.root)
    assert files == {0o660} and dirs == {0o2770}


def test_explicit_modes_and_the_default(tmp_path: Path, restore_modes: None) -> None:
    os.umask(0o077)
    run = init_run(tmp_path / "a", _config(tmp_path, file_mode="0o640", dir_mode=0o750))
    _use_the_run(run.layout, run.run_id)
    assert _modes_under(run.layout.root) == ({0o640}, {0o750})
    os.umask(0o077)
    other = tmp_path / "b"
    other.mkdir()
    run = init_run(other / "run", _config(other))
    _use_the_run(run.layout, run.run_id)
    assert _modes_under(run.layout.root) == ({0o644}, {0o755})


@pytest.mark.parametrize(
    ("run", "needle"),
    [
        ({"file_mode": 0o666}, "writable by every user"),
        ({"dir_mode": 0o777}, "writable by every user"),
        ({"file_mode": 0o400}, "owner at least"),
        ({"file_mode": 0o664, "dir_mode": 0o750}, "does not"),
        ({"file_mode": "rw-r--r--"}, "valid integer"),
    ],
)
def test_unsafe_modes_are_refused_in_one_line(tmp_path: Path, run: dict, needle: str) -> None:
    with pytest.raises(ValueError) as e:
        _config(tmp_path, **run)
    assert needle in str(e.value)


@pytest.mark.parametrize("where", ["root", "checkpoints"])
def test_a_run_writable_by_others_is_refused(tmp_path: Path, restore_modes: None, where: str) -> None:
    run = init_run(tmp_path / "run", _config(tmp_path))
    target = run.layout.root if where == "root" else run.layout.checkpoints
    target.chmod(0o777)
    with pytest.raises(ConfigError) as e:
        open_run(run.layout.root)
    msg = str(e.value)
    assert "\n" not in msg and str(target) in msg and "0o777" in msg and "chmod o-w" in msg
    target.chmod(0o775)  # group-writable is the run's choice
    assert open_run(run.layout.root).run_id == run.run_id


# --------------------------------------------------------------------------------------------- size caps


def test_a_huge_file_is_refused_without_being_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    big = tmp_path / "control.json"
    with open(big, "wb") as f:
        f.truncate(100 << 20)  # 100 MB (sparse)
    reads = []
    real_read = os.read
    monkeypatch.setattr(fsio.os, "read", lambda fd, n: reads.append(n) or real_read(fd, n))
    with pytest.raises(fsio.FileRefused) as e:
        fsio.read_capped(big, 64 << 10)
    assert reads == [] and str(big) in str(e.value) and "104857600 bytes" in str(e.value)
    monkeypatch.undo()
    big.write_bytes(b'{"action": "add", "count": 1}')
    data, st = fsio.read_capped_stat(big, 64 << 10)
    assert json.loads(data)["count"] == 1 and st.st_size == len(data)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_non_regular_file_is_refused_without_blocking(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "control.json"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    with pytest.raises(fsio.FileRefused, match="not a regular file"):
        fsio.read_capped(path, 1 << 20)


def test_a_record_over_its_cap_is_one_record_error(tmp_path: Path) -> None:
    latest = tmp_path / "LATEST"
    latest.write_bytes(b" " * (LatestPointer.max_bytes + 1))
    with pytest.raises(RecordError) as e:
        read_record(LatestPointer, latest)
    assert str(latest) in str(e.value) and "more than" in str(e.value)


def test_read_errors_keep_their_errno_and_name_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError) as e:
        fsio.read_capped(missing, 10)
    assert e.value.errno == errno.ENOENT and str(missing) in str(e.value)
    named = fsio.named(OSError(errno.EIO, "Input/output error"), missing)
    assert isinstance(named, OSError) and named.errno == errno.EIO and str(missing) in str(named)


# ------------------------------------------------------------------------------------------- checkpoints


def test_a_checkpoint_whose_dcp_metadata_changed_is_not_loaded(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from trainer.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    layout = RunLayout.of(tmp_path / "run")
    layout.create()
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP without a process group says so
        save_checkpoint(layout, 1, model, opt, sched, {"n": 1})
        assert load_checkpoint(layout, 1, model, opt, sched) == {"n": 1}
        meta = layout.checkpoint(1) / ".metadata"
        meta.write_bytes(meta.read_bytes() + b".")
        with pytest.raises(CheckpointError, match="sha256"):
            load_checkpoint(layout, 1, model, opt, sched)
        record = json.loads(layout.checkpoint_commit(1).read_text())
        del record["metadata_sha256"]
        layout.checkpoint_commit(1).write_text(json.dumps(record))
        with pytest.raises(CheckpointError, match="no metadata_sha256"):
            load_checkpoint(layout, 1, model, opt, sched)


def test_the_tiny_model_is_readable_by_the_run_group(tiny_model_untied: Path) -> None:
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tiny_model_untied.iterdir()}
    assert modes["model.safetensors"] & 0o040, modes  # transformers alone leaves it 0600
