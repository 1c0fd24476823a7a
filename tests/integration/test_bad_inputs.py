"""Bad and hostile inputs, each through the entry point that meets it, with the one behaviour it must get.

Every input a person or another program can put in front of shardrl (control.json, the TOML config and its
overrides, prompt files, the run directory itself, shards, weight versions and LATEST) is driven through the real
path: the ``shardrl`` command line in a subprocess where a person types it, otherwise the buffer function the
long-running process calls (``ControlWatcher.poll`` in the supervisor, ``load_or_quarantine`` in the trainer,
``verify_version``/``latest_version`` in the rollout worker).  Each case states where it is caught and what the one
line must name (the file, the field, what is accepted); the checks are: exactly that one line, no traceback, and
nothing lost (the desired count, the other shards, LATEST and the run directory are as before).  Cases the code does
not meet yet are ``xfail(strict=True)`` with the defect in their reason; docs/RELIABILITY.md lists them all.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from buffer import weights
from buffer.control import ControlWatcher, init_state, read_state
from buffer.layout import RunLayout
from buffer.schema import META_RUN_ID, META_SCHEMA_VERSION
from buffer.shards import ShardName, build_table, load_or_quarantine, quarantined
from tests.unit.buffer_helpers import sample

from ._common import shardrl

REPO = Path(__file__).resolve().parents[2]
MAX_WORKERS = 4
VOCAB = 100
RUN_ID = "this-run"
Needle = str | tuple[str, ...]  # a tuple: any one of them


@dataclass(frozen=True)
class Bad:
    """One bad input: where it is met, the behaviour it gets, and what its one line must contain."""

    id: str
    where: str
    behaviour: str
    needles: tuple[Needle, ...]
    make: Callable[..., Any]
    defect: str | None = None  # set while the code does not meet the behaviour: the test is xfail(strict)

    def param(self) -> Any:
        marks = [pytest.mark.xfail(strict=True, reason=self.defect)] if self.defect else []
        return pytest.param(self, id=self.id, marks=marks)


def one_clear_line(text: str, needles: tuple[Needle, ...]) -> str:
    """``text`` is one line, no traceback, containing every needle (a tuple: any of its strings)."""
    text = text.strip()
    assert "Traceback" not in text, text
    assert text and "\n" not in text, f"not one line: {text!r}"
    for n in needles:
        options = n if isinstance(n, tuple) else (n,)
        assert any(o in text for o in options), f"{options} not in {text!r}"
    return text


# --------------------------------------------------------------------------------------------- control.json


def _write(raw: bytes) -> Callable[[Path], Any]:
    return lambda p: p.write_bytes(raw)


CONTROL = [
    Bad(
        "garbage",
        "control.json",
        "rejected",
        ("control.json", "not valid JSON", '"action"'),
        _write(b"garbage\n"),
    ),
    Bad("empty", "control.json", "rejected once settled", ("control.json", "not valid JSON"), _write(b"")),
    Bad(
        "huge-16MiB",
        "control.json",
        "rejected unread (a command is a few dozen bytes)",
        ("control.json", "refused unread"),
        _write(b"x" * (16 << 20)),
    ),
    Bad("array", "control.json", "rejected", ("control.json", "JSON object"), _write(b'[{"action":"add"}]')),
    Bad(
        "negative-count",
        "control.json",
        "rejected",
        ("count", ">= 1"),
        _write(b'{"action":"add","count":-1}'),
    ),
    Bad(
        "string-count",
        "control.json",
        "rejected",
        ("count", "integer"),
        _write(b'{"action":"add","count":"2"}'),
    ),
    Bad(
        "float-count",
        "control.json",
        "rejected",
        ("count", "integer"),
        _write(b'{"action":"add","count":2.0}'),
    ),
    Bad(
        "bool-count",
        "control.json",
        "rejected",
        ("count", "integer"),
        _write(b'{"action":"add","count":true}'),
    ),
    Bad(
        "nan-count", "control.json", "rejected", ("count", "integer"), _write(b'{"action":"add","count":NaN}')
    ),
    Bad(
        "above-max-workers",
        "control.json",
        "rejected",
        ("count", f"max_workers = {MAX_WORKERS}"),
        _write(b'{"action":"set","count":99}'),
    ),
    Bad(
        "remove-below-zero",
        "control.json",
        "rejected",
        ("count", "only 1"),
        _write(b'{"action":"remove","count":5}'),
    ),
    Bad("no-action", "control.json", "rejected", ("action", "add, remove, set"), _write(b'{"count":2}')),
    Bad(
        "unknown-action",
        "control.json",
        "rejected",
        ("action", "add, remove, set"),
        _write(b'{"action":"scale","count":2}'),
    ),
    Bad(
        "unknown-field",
        "control.json",
        "rejected (a field the command does not have may be a typo or an option it lacks)",
        ("control.json", "dry_run"),
        _write(b'{"action":"add","count":1,"dry_run":true}'),
    ),
    Bad(
        "directory",
        "control.json",
        "rejected: not a regular file",
        ("control.json",),
        lambda p: p.mkdir(),
    ),
    Bad(
        "dangling-symlink",
        "control.json",
        "rejected: the link's target is missing",
        ("control.json",),
        lambda p: os.symlink(p.parent / "nowhere.json", p),
    ),
]


@pytest.fixture
def control_run(tmp_path: Path) -> RunLayout:
    layout = RunLayout.of(tmp_path / "run")
    layout.create()
    init_state(layout, 1)
    return layout


@pytest.mark.parametrize("case", [c.param() for c in CONTROL])
def test_bad_control_json(control_run: RunLayout, case: Bad) -> None:
    """The supervisor's poll records one rejection (shown by `shardrl status`); the desired count stays."""
    case.make(control_run.control_file)
    w = ControlWatcher(control_run, max_workers=MAX_WORKERS, settle_s=0.0, who="sup-a")
    for _ in range(3):
        state = w.poll()
    assert state.desired == 1 and state.last_applied is None
    assert state.generation == 1, "rejected exactly once"
    rejection = state.last_rejection or {}
    one_clear_line(str(rejection.get("reason", "")), case.needles)


def test_control_half_written_then_completed_is_applied_once(control_run: RunLayout) -> None:
    """An `echo` caught mid-write is "not yet", not a rejection; the finished command is applied once."""
    w = ControlWatcher(control_run, max_workers=MAX_WORKERS, settle_s=30.0, who="sup-a")
    control_run.control_file.write_bytes(b'{"action":"ad')
    assert w.poll().generation == 0
    control_run.control_file.write_bytes(b'{"action":"add","count":2}\n')
    for _ in range(3):
        state = w.poll()
    assert (state.desired, state.generation, state.last_rejection) == (3, 1, None)


def test_control_fifo_does_not_block_the_supervisor(control_run: RunLayout) -> None:
    os.mkfifo(control_run.control_file)
    code = (
        "import sys; from buffer.layout import RunLayout; from buffer.control import ControlWatcher; "
        "s = ControlWatcher(RunLayout.of(sys.argv[1]), 4, 0.0, 'sup-a').poll(); "
        "print((s.last_rejection or {}).get('reason'))"
    )
    try:
        r = subprocess.run(
            [sys.executable, "-c", code, str(control_run.root)],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the poll blocked on a FIFO named control.json")
    one_clear_line(r.stdout, ("control.json",))
    assert read_state(control_run).desired == 1


# ----------------------------------------------------------------------------------------- configs (init)

OK_TOML = '[model]\npath = "model"\n[reward]\nfunction = "max_digit"\n[run]\nmax_workers = 4\n'


def _toml(text: str | bytes) -> Callable[[Path], Path]:
    def make(d: Path) -> Path:
        p = d / "cfg.toml"
        p.write_bytes(text.encode() if isinstance(text, str) else text)
        return p

    return make


def _cfg_dir(d: Path) -> Path:
    (d / "cfg.toml").mkdir()
    return d / "cfg.toml"


CONFIGS = [
    Bad("toml-syntax", "config", "exit 2", ("cfg.toml", "not valid TOML", "line 1"), _toml("[model\n")),
    Bad(
        "unknown-key",
        "config",
        "exit 2, naming the keys the section accepts",
        ("cfg.toml", "trainer.lrr", ("accepted", "weight_decay")),
        _toml(OK_TOML + "[trainer]\nlrr = 1e-5\n"),
    ),
    Bad(
        "wrong-type",
        "config",
        "exit 2",
        ("cfg.toml", "trainer.lr", "valid number"),
        _toml(OK_TOML + '[trainer]\nlr = "fast"\n'),
    ),
    Bad(
        "out-of-bounds",
        "config",
        "exit 2",
        ("cfg.toml", "run.max_workers", "greater than or equal to 1"),
        _toml(OK_TOML.replace("max_workers = 4", "max_workers = 0")),
    ),
    Bad(
        "bad-choice",
        "config",
        "exit 2",
        ("cfg.toml", "algorithm", "'dpo'", "'grpo'"),
        _toml(OK_TOML + '[algorithm]\nname = "dpo"\n'),
    ),
    Bad(
        "missing-required",
        "config",
        "exit 2, naming the accepted values",
        ("cfg.toml", "reward.function", "max_digit"),
        _toml('[model]\npath = "model"\n[reward]\n'),
    ),
    Bad("file-missing", "config", "exit 2", ("nope.toml", "not found"), lambda d: d / "nope.toml"),
    Bad(
        "is-a-directory",
        "config",
        "exit 2",
        ("cfg.toml",),
        _cfg_dir,
    ),
    Bad(
        "not-utf8",
        "config",
        "exit 2",
        ("cfg.toml", "UTF-8"),
        _toml(b"\xff\xfe[model]\n"),
    ),
]

OVERRIDES = [
    Bad(
        "bad-override-value",
        "command line",
        "exit 2, naming the flag, not the file",
        ("--trainer.lr", "valid number"),
        lambda d: ["--trainer.lr", "abc"],
    ),
    Bad("unknown-override", "command line", "exit 2", ("trainer.nope",), lambda d: ["--trainer.nope", "1"]),
    Bad(
        "override-no-value",
        "command line",
        "exit 2",
        ("--trainer.lr", "needs a value"),
        lambda d: ["--trainer.lr"],
    ),
    Bad(
        "override-not-a-section",
        "command line",
        "exit 2",
        ("--run.max_workers.x", "not a section"),
        lambda d: ["--run.max_workers.x", "1"],
    ),
]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A directory with a stand-in model (init reads only its config.json) and a good config."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    (tmp_path / "ok.toml").write_text(OK_TOML)
    return tmp_path


@pytest.mark.parametrize("case", [c.param() for c in CONFIGS])
def test_bad_config(workdir: Path, case: Bad) -> None:
    r = shardrl("init", "run", "--config", case.make(workdir), cwd=workdir)
    assert r.returncode == 2, r.stderr
    one_clear_line(r.stderr, case.needles)
    assert not (workdir / "run").exists()


@pytest.mark.parametrize("case", [c.param() for c in OVERRIDES])
def test_bad_override(workdir: Path, case: Bad) -> None:
    r = shardrl("init", "run", "--config", "ok.toml", *case.make(workdir), cwd=workdir)
    assert r.returncode == 2, r.stderr
    one_clear_line(r.stderr, case.needles)
    assert not (workdir / "run").exists()


def test_run_wide_override_at_a_later_process(workdir: Path) -> None:
    assert shardrl("init", "run", "--config", "ok.toml", cwd=workdir).returncode == 0
    r = subprocess.run(
        [sys.executable, "-m", "rollout_worker", "--run", "run", "--rollout.cpu_workers", "zero"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=workdir,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert r.returncode == 2
    one_clear_line(r.stderr, ("config.json", "rollout.cpu_workers", "valid integer"))


# ------------------------------------------------------------------------------------------ prompt files

_PROMPTS_TOML = (
    '[model]\npath = "model"\n[reward]\nfunction = "{fn}"\n[data]\ntask = "file"\nprompts_file = "{f}"\n'
)


def _prompts(name: str, content: bytes | None, fn: str = "exact_match") -> Callable[[Path], Path]:
    def make(d: Path) -> Path:
        if content is not None:
            (d / name).write_bytes(content)
        (d / "p.toml").write_text(_PROMPTS_TOML.format(fn=fn, f=name))
        return d / "p.toml"

    return make


PROMPTS = [
    Bad(
        "missing",
        "prompts file",
        "exit 2 at init",
        ("p.jsonl", "not found", "accepted"),
        _prompts("p.jsonl", None),
    ),
    Bad(
        "not-json",
        "prompts file",
        "exit 2 at init",
        ("p.jsonl", "line 1", "not valid JSON"),
        _prompts("p.jsonl", b"x\n"),
    ),
    Bad(
        "missing-field",
        "prompts file",
        "exit 2 at init",
        ("p.jsonl", "'prompt'", "question"),
        _prompts("p.jsonl", b'{"question": "1+1", "answer": "2"}\n'),
    ),
    Bad("empty", "prompts file", "exit 2 at init", ("p.jsonl", "no prompts"), _prompts("p.jsonl", b"")),
    Bad(
        "json-array",
        "prompts file",
        "exit 2 at init",
        ("p.jsonl", "not JSONL"),
        _prompts("p.jsonl", b'[{"prompt": "x"}]\n'),
    ),
    Bad(
        "prompt-not-a-string",
        "prompts file",
        "exit 2 at init",
        ("p.jsonl", "'prompt'", "int"),
        _prompts("p.jsonl", b'{"prompt": 5, "answer": "1"}\n'),
    ),
    Bad(
        "no-answers",
        "prompts file",
        "exit 2 at init",
        ("p.jsonl", "answer", "exact_match"),
        _prompts("p.jsonl", b'{"prompt": "x"}\n'),
    ),
    Bad(
        "corrupt-parquet",
        "prompts file",
        "exit 2 at init",
        ("p.parquet", "Parquet"),
        _prompts("p.parquet", b"PAR1 not really"),
    ),
]


@pytest.mark.parametrize("case", [c.param() for c in PROMPTS])
def test_bad_prompt_file(workdir: Path, case: Bad) -> None:
    r = shardrl("init", "run", "--config", case.make(workdir), cwd=workdir)
    assert r.returncode == 2, r.stderr
    one_clear_line(r.stderr, case.needles)
    assert not (workdir / "run").exists()


# ------------------------------------------------------------------------------------------- run directory


@pytest.fixture
def run_dir(workdir: Path) -> Path:
    r = shardrl("init", "run", "--config", "ok.toml", cwd=workdir)
    assert r.returncode == 0, r.stderr
    return workdir / "run"


def _other_schema(run: Path) -> None:
    meta = json.loads((run / "run.json").read_text())
    meta["schema_version"] = int(meta["schema_version"]) + 1
    (run / "run.json").write_text(json.dumps(meta))


RUN_DIRS = [
    Bad(
        "other-schema-fsck",
        "run.json",
        "exit 2 (fsck)",
        ("run.json", "schema_version"),
        lambda r: ("fsck", _other_schema),
    ),
    Bad(
        "other-schema-scale",
        "run.json",
        "exit 2 (scale)",
        ("run.json", "schema_version"),
        lambda r: ("scale", _other_schema),
    ),
    Bad(
        "other-schema-status",
        "run.json",
        "exit 2 (status)",
        ("run.json", "schema_version"),
        lambda r: ("status", _other_schema),
    ),
    Bad(
        "garbage-run-json",
        "run.json",
        "exit 2 (fsck)",
        ("run.json",),
        lambda r: ("fsck", lambda run: (run / "run.json").write_text("{garbage")),
    ),
    Bad(
        "not-a-run",
        "RUN",
        "exit 2 (fsck)",
        ("run.json", "shardrl init"),
        lambda r: ("fsck", lambda run: shutil.rmtree(run)),
    ),
]


@pytest.mark.parametrize("case", [c.param() for c in RUN_DIRS])
def test_bad_run_directory(run_dir: Path, case: Bad) -> None:
    command, damage = case.make(run_dir)
    damage(run_dir)
    before = sorted(str(p) for p in run_dir.rglob("*")) if run_dir.exists() else []
    extra = ["--add", "1"] if command == "scale" else []
    r = shardrl(command, run_dir, *extra, cwd=run_dir.parent)
    assert r.returncode == 2, (r.stdout, r.stderr)
    one_clear_line(r.stderr, case.needles)
    assert (sorted(str(p) for p in run_dir.rglob("*")) if run_dir.exists() else []) == before


@pytest.fixture
def readonly_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory nobody can write into: a read-only tmpfs when root (root ignores modes), else mode 0555."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() == 0:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(d)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a read-only tmpfs: {r.stderr.decode().strip()}")
        try:
            yield d
        finally:
            subprocess.run(["umount", "-l", str(d)], capture_output=True)
    else:
        d.chmod(0o555)
        yield d
        d.chmod(0o755)


def test_init_into_an_unwritable_directory(workdir: Path, readonly_dir: Path) -> None:
    r = shardrl("init", readonly_dir / "run", "--config", "ok.toml", cwd=workdir)
    assert r.returncode == 2
    one_clear_line(r.stderr, (str(readonly_dir / "run"), ("Read-only", "Permission denied")))


def test_init_under_a_regular_file(workdir: Path) -> None:
    (workdir / "afile").write_text("")
    r = shardrl("init", workdir / "afile" / "run", "--config", "ok.toml", cwd=workdir)
    assert r.returncode == 2
    one_clear_line(r.stderr, ("afile", "Not a directory"))


# ------------------------------------------------------------------------------------------------- shards


def _table(n: int = 4, run_id: str = RUN_ID, **overrides: Any) -> pa.Table:
    rows = [sample(i, group=f"g{i // 2}") | {"sample_id": f"w.i.0.{i}"} for i in range(n)]
    for r in rows:
        r.update(overrides)
    return build_table(rows, run_id, "w", 0)


def _ipc(table: pa.Table, stream: bool = False) -> bytes:
    sink = io.BytesIO()
    opener = ipc.new_stream if stream else ipc.new_file
    with opener(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue()


BUCKET = 0  # the shards these tests write by hand go into one bucket


def _named(data: bytes, rows: int = 4) -> tuple[str, bytes]:
    return ShardName(BUCKET, "w", "bad", 0, rows, zlib.crc32(data)).name, data


def _truncated_keep_name() -> tuple[str, bytes]:
    data = _ipc(_table())
    name, _ = _named(data)
    return name, data[: len(data) // 2]


def _flipped_byte() -> tuple[str, bytes]:
    data = bytearray(_ipc(_table()))
    name, _ = _named(bytes(data))
    data[len(data) // 2] ^= 0xFF
    return name, bytes(data)


def _with_meta(key: bytes, value: bytes) -> tuple[str, bytes]:
    t = _table()
    return _named(_ipc(t.replace_schema_metadata({**t.schema.metadata, key: value})))


def _without_column(col: str) -> tuple[str, bytes]:
    t = _table()
    return _named(_ipc(t.drop_columns([col]).replace_schema_metadata(t.schema.metadata)))


def _retyped(col: str) -> tuple[str, bytes]:
    t = _table()
    i = t.schema.get_field_index(col)
    t2 = t.set_column(i, pa.field(col, pa.string()), t.column(col).cast(pa.string()))
    return _named(_ipc(t2.replace_schema_metadata(t.schema.metadata)))


def _duplicate_ids() -> tuple[str, bytes]:
    rows = [sample(i) | {"sample_id": "same"} for i in range(4)]
    return _named(_ipc(build_table(rows, RUN_ID, "w", 0)))


def _parquet() -> tuple[str, bytes]:
    sink = io.BytesIO()
    pq.write_table(_table(), sink)
    return _named(sink.getvalue())


SHARDS = [
    Bad("truncated", "shards/ready", "quarantined", ("checksum",), _truncated_keep_name),
    Bad(
        "truncated-consistent-name",
        "shards/ready",
        "quarantined",
        ("Arrow IPC",),
        lambda: _named(_ipc(_table())[:-100]),
    ),
    Bad("flipped-byte", "shards/ready", "quarantined", ("checksum",), _flipped_byte),
    Bad("zero-length-file", "shards/ready", "quarantined", ("Arrow IPC",), lambda: _named(b"")),
    Bad(
        "ipc-stream-format",
        "shards/ready",
        "quarantined",
        ("Arrow IPC",),
        lambda: _named(_ipc(_table(), stream=True)),
    ),
    Bad("parquet-file", "shards/ready", "quarantined", ("Arrow IPC",), _parquet),
    Bad(
        "missing-column",
        "shards/ready",
        "quarantined",
        ("'reward'", "missing"),
        lambda: _without_column("reward"),
    ),
    Bad("wrong-column-type", "shards/ready", "quarantined", ("reward", "float"), lambda: _retyped("reward")),
    Bad(
        "other-schema-version",
        "shards/ready",
        "quarantined",
        ("schema version",),
        lambda: _with_meta(META_SCHEMA_VERSION, b"99"),
    ),
    Bad(
        "nan-logprobs",
        "shards/ready",
        "quarantined",
        ("response_logprobs", "non-finite"),
        lambda: _named(_ipc(_table(response_logprobs=[float("nan")] * 3))),
    ),
    Bad(
        "positive-logprobs",
        "shards/ready",
        "quarantined",
        ("response_logprobs", "> 0"),
        lambda: _named(_ipc(_table(response_logprobs=[0.5] * 3))),
    ),
    Bad(
        "token-id-beyond-vocab",
        "shards/ready",
        "quarantined",
        ("response_ids", f"[0, {VOCAB})"),
        lambda: _named(_ipc(_table(response_ids=[VOCAB + 400] * 3))),
    ),
    Bad(
        "negative-token-id",
        "shards/ready",
        "quarantined",
        ("prompt_ids", "out of range"),
        lambda: _named(_ipc(_table(prompt_ids=[-1, 2]))),
    ),
    Bad(
        "length-mismatch",
        "shards/ready",
        "quarantined",
        ("response_logprobs", "length"),
        lambda: _named(_ipc(_table(response_logprobs=[-0.1]))),
    ),
    Bad(
        "nan-reward",
        "shards/ready",
        "quarantined",
        ("reward", "non-finite"),
        lambda: _named(_ipc(_table(reward=float("nan")))),
    ),
    Bad("duplicate-sample-ids", "shards/ready", "quarantined", ("duplicate sample_id",), _duplicate_ids),
    Bad(
        "wrong-row-count-in-name",
        "shards/ready",
        "quarantined",
        ("4 rows", "name says 5"),
        lambda: _named(_ipc(_table()), rows=5),
    ),
    Bad(
        "another-runs-id",
        "shards/ready",
        "quarantined",
        (("run_id", "run id"), "another-run"),
        lambda: _with_meta(META_RUN_ID, b"another-run"),
    ),
]


@pytest.fixture
def shard_run(tmp_path: Path) -> RunLayout:
    layout = RunLayout.of(tmp_path / "run")
    layout.create()
    layout.ready_bucket(BUCKET).mkdir()
    layout.run_json.write_text(json.dumps({"run_id": RUN_ID, "schema_version": 3, "created_at": 0}))
    return layout


def _good_neighbour(layout: RunLayout) -> str:
    data = _ipc(_table())
    name = ShardName(BUCKET, "w", "good", 0, 4, zlib.crc32(data)).name
    layout.ready_shard(name).write_bytes(data)
    return name


@pytest.mark.parametrize("case", [c.param() for c in SHARDS])
def test_bad_shard(shard_run: RunLayout, case: Bad) -> None:
    """The trainer's load quarantines it with one reason line; the bytes are kept; the shard beside it loads."""
    good = _good_neighbour(shard_run)
    name, data = case.make()
    shard_run.ready_shard(name).write_bytes(data)
    assert load_or_quarantine(shard_run, name, VOCAB) is None
    assert not shard_run.ready_shard(name).exists()
    assert shard_run.quarantined_shard(name).read_bytes() == data
    reason = json.loads(shard_run.quarantine_reason(name).read_text())
    assert reason["shard"] == name
    one_clear_line(reason["reason"], case.needles)
    table = load_or_quarantine(shard_run, good, VOCAB)
    assert table is not None and table.num_rows == 4 and quarantined(shard_run) == [name]


def test_zero_row_shard_is_empty_or_rejected_as_such(shard_run: RunLayout) -> None:
    """The writer never makes one; a zero-row shard is harmless either way, but its reason must be true."""
    name, data = _named(_ipc(_table(0)), rows=0)
    shard_run.ready_shard(name).write_bytes(data)
    table = load_or_quarantine(shard_run, name, VOCAB)
    if table is not None:
        assert table.num_rows == 0 and quarantined(shard_run) == []
    else:
        reason = json.loads(shard_run.quarantine_reason(name).read_text())["reason"]
        one_clear_line(reason, (("0 rows", "no rows", "empty"),))


def test_directory_with_a_shard_name_is_quarantined(shard_run: RunLayout) -> None:
    name = ShardName(BUCKET, "w", "dir", 0, 4, 0).name
    shard_run.ready_shard(name).mkdir()
    assert load_or_quarantine(shard_run, name, VOCAB) is None
    reason = json.loads(shard_run.quarantine_reason(name).read_text())["reason"]
    one_clear_line(reason, (("directory", "Is a directory", "unreadable"),))


# ------------------------------------------------------------------------------------------------ weights


@pytest.fixture
def weights_run(tmp_path: Path) -> RunLayout:
    layout = RunLayout.of(tmp_path / "run")
    layout.create()
    for v in (1, 2):
        d = weights.staging_dir(layout, v)
        (d / "model.safetensors").write_bytes(bytes(range(256)) * 16 * v)
        (d / "config.json").write_text("{}")
        weights.commit_version(layout, v, d, step=v, dtype="float32")
    return layout


def _manifest(layout: RunLayout, v: int = 2) -> Path:
    return layout.weight_version(v) / "manifest.json"


def _edit_manifest(fn: Callable[[dict[str, Any]], Any]) -> Callable[[RunLayout], None]:
    def damage(layout: RunLayout) -> None:
        m = json.loads(_manifest(layout).read_text())
        fn(m)
        _manifest(layout).write_text(json.dumps(m))

    return damage


def _corrupt_same_size(layout: RunLayout) -> None:
    f = layout.weight_version(2) / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[100] ^= 0xFF
    f.write_bytes(bytes(data))


WEIGHTS = [
    Bad(
        "latest-names-missing-version",
        "weights/LATEST",
        "worker keeps its version",
        ("v000002", "manifest.json", "missing"),
        lambda layout: shutil.rmtree(layout.weight_version(2)),
    ),
    Bad(
        "manifest-size-mismatch",
        "manifest.json",
        "worker keeps its version",
        ("model.safetensors", "size"),
        lambda layout: (layout.weight_version(2) / "model.safetensors").write_bytes(b"short"),
    ),
    Bad(
        "same-size-corrupted-file",
        "model.safetensors",
        "worker keeps its version (the sha256 in the manifest does not match)",
        ("model.safetensors", "sha256"),
        _corrupt_same_size,
    ),
    Bad(
        "manifest-not-json",
        "manifest.json",
        "worker keeps its version",
        ("manifest.json", "not valid JSON"),
        lambda layout: _manifest(layout).write_text("{garbage"),
    ),
    Bad(
        "manifest-json-array",
        "manifest.json",
        "worker keeps its version",
        ("manifest.json", "JSON object"),
        lambda layout: _manifest(layout).write_text("[]"),
    ),
    Bad(
        "manifest-other-version",
        "manifest.json",
        "worker keeps its version",
        ("manifest.json", "version"),
        _edit_manifest(lambda m: m.update(version=7)),
    ),
    Bad(
        "manifest-file-missing",
        "manifest.json",
        "worker keeps its version",
        ("model.safetensors", "missing"),
        lambda layout: (layout.weight_version(2) / "model.safetensors").unlink(),
    ),
    Bad(
        "manifest-entry-without-size",
        "manifest.json",
        "worker keeps its version",
        ("manifest.json", "size"),
        _edit_manifest(lambda m: m["files"]["model.safetensors"].pop("size")),
    ),
]


@pytest.mark.parametrize("case", [c.param() for c in WEIGHTS])
def test_bad_weight_version(weights_run: RunLayout, case: Bad) -> None:
    """The worker's check of the version LATEST names fails with one line; LATEST and v1 are untouched."""
    case.make(weights_run)
    latest = weights.latest_version(weights_run)
    assert latest == 2
    with pytest.raises(weights.WeightsError) as e:
        weights.verify_version(weights_run, latest)
    one_clear_line(str(e.value), case.needles)
    assert weights.verify_version(weights_run, 1, checksums=True).version == 1


LATEST = [
    Bad(
        "garbage", "weights/LATEST", "error naming LATEST", ("LATEST", "not valid JSON"), lambda: b"{garbage"
    ),
    Bad("empty", "weights/LATEST", "error naming LATEST", ("LATEST", "not valid JSON"), lambda: b""),
    Bad(
        "version-a-string",
        "weights/LATEST",
        "error naming LATEST",
        ("LATEST", "version"),
        lambda: b'{"schema_version": 1, "version": "2", "path": "v000002", "step": 2}',
    ),
    Bad(
        "version-negative",
        "weights/LATEST",
        "error naming LATEST",
        ("LATEST", "version"),
        lambda: b'{"schema_version": 1, "version": -3, "path": "v000002", "step": 2}',
    ),
]


@pytest.mark.parametrize("case", [c.param() for c in LATEST])
def test_bad_latest_pointer(weights_run: RunLayout, case: Bad) -> None:
    """A damaged LATEST is an error naming it, never silently "version 0" (the base model)."""
    weights_run.latest_pointer.write_bytes(case.make())
    with pytest.raises(ValueError) as e:
        weights.latest_version(weights_run)
    one_clear_line(str(e.value), case.needles)
    assert weights.published_versions(weights_run) == [1, 2]


def test_fsck_reports_a_same_size_corrupted_file(workdir: Path) -> None:
    run = workdir / "run"
    assert shardrl("init", "run", "--config", "ok.toml", cwd=workdir).returncode == 0
    layout = RunLayout.of(run)
    for v in (1, 2):
        d = weights.staging_dir(layout, v)
        (d / "model.safetensors").write_bytes(b"w" * 4096)
        weights.commit_version(layout, v, d, step=v, dtype="float32")
    _corrupt_same_size(layout)
    r = shardrl("fsck", run, cwd=workdir)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    problems = [line for line in r.stdout.splitlines() if line.startswith("PROBLEM")]
    assert len(problems) == 1 and "v2" in problems[0] and "sha256" in problems[0]
