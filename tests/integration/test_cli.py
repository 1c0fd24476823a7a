"""The `shardrl` command line on real run directories (init, status, scale, synth, fsck), as separate processes."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from buffer import SCHEMA_VERSION, control, shards
from buffer.layout import RunLayout

from . import _common
from ._common import ROOT

DEMO = ROOT / "shardrl" / "configs" / "demo.toml"
# whole groups of 4 and a step that one worker batch (100 prompts x 4) fills
SMALL_GROUPS = ("--rollout.sampling.n", "4", "--trainer.samples_per_step", "400")


shardrl = functools.partial(_common.shardrl, check=True)  # every command here succeeds unless told otherwise


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("cli") / "run"
    shardrl("init", str(run), "--config", str(DEMO), *SMALL_GROUPS)
    return run


def test_help_does_not_import_torch():
    code = "import sys; from shardrl import cli\ntry:\n cli.main(['--help'])\nexcept SystemExit: pass\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True).stdout
    assert out.strip().endswith("False")


def test_init_writes_layout_and_is_idempotent_but_refuses_conflicts(run_dir):
    layout = RunLayout.of(run_dir)
    meta = json.loads(layout.run_json.read_text())
    assert meta["schema_version"] == SCHEMA_VERSION and meta["run_id"]
    cfg = json.loads(layout.config_json.read_text())
    assert cfg["rollout"]["sampling"]["n"] == 4 and cfg["model"]["vocab_size"] > 10
    assert (layout.base_model / "config.json").exists()
    for d in layout.directories():
        assert d.is_dir(), d
    shardrl("init", str(run_dir), "--config", str(DEMO), *SMALL_GROUPS)  # same config: no-op
    assert json.loads(layout.run_json.read_text()) == meta
    bad = shardrl(
        "init", str(run_dir), "--config", str(DEMO), *SMALL_GROUPS, "--trainer.lr", "0.5", check=False
    )
    assert bad.returncode == 2 and "different config" in bad.stderr and "trainer.lr" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_bad_config_is_one_clear_line(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[reward]\nfunction = "max_digit"\n[trainer]\nlr = "fast"\n')
    p = shardrl("init", str(tmp_path / "r"), "--config", str(cfg), check=False)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and "trainer.lr" in p.stderr and str(cfg) in p.stderr
    p = shardrl("init", str(tmp_path / "r"), "--config", str(DEMO), "--nope.x", "1", check=False)
    assert p.returncode == 2 and "command line: --nope.x: nope is not a config key" in p.stderr
    assert not (tmp_path / "r").exists()  # a failed init leaves no directory behind


def test_init_refuses_a_deadlocking_config_in_one_line(tmp_path):
    deadlock = ("--rollout.max_backlog_samples", "64", "--rollout.prompts_per_batch", "10")
    p = shardrl("init", "--run-dir", str(tmp_path / "r"), "--config", str(DEMO), *deadlock, check=False)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == (
        f"shardrl: {DEMO}: rollout.max_backlog_samples (64) + one worker batch (rollout.prompts_per_batch x "
        "rollout.sampling.n = 160) must reach trainer.samples_per_step (1600), or workers pause before a step "
        "can fill\n"
    )
    assert not (tmp_path / "r").exists()


def test_run_wide_override_is_refused_per_process_one_allowed(run_dir):
    from buffer.config import ConfigError
    from buffer.run import open_run

    assert open_run(run_dir, {"trainer.max_steps": "3"}).config.trainer.max_steps == 3
    with pytest.raises(ConfigError, match="run-wide"):
        open_run(run_dir, {"model.dtype": "bfloat16"})


def test_status_json_has_the_contract_keys(run_dir):
    snap = json.loads(shardrl("status", str(run_dir), "--json").stdout)
    for key in (
        "desired_workers",
        "workers",
        "latest_weights_version",
        "latest_weights_path",
        "trainer",
        "shards",
        "control",
    ):
        assert key in snap
    assert set(snap["shards"]) >= {"ready", "consumed_samples", "unconsumed_samples", "quarantined"}
    assert set(snap["trainer"]) >= {"step", "state"}
    assert set(snap["control"]) >= {"last_applied", "last_rejection"}
    assert snap["desired_workers"] == 1
    assert "desired workers 1" in shardrl("status", str(run_dir)).stdout


def test_scale_writes_what_echo_would_and_bad_commands_show_in_status(run_dir):
    layout = RunLayout.of(run_dir)
    watcher = control.ControlWatcher(layout, max_workers=4, settle_s=0.0, who="test-supervisor")
    shardrl("scale", str(run_dir), "--add", "2")
    assert json.loads(layout.control_file.read_text()) == {"action": "add", "count": 2}
    assert watcher.poll().desired == 3
    for text, reason in [
        ('{"action":"add","count":9}', "above run.max_workers"),
        ('{"action":"add","count":0}', "not allowed"),
        ("{not json", "not valid JSON"),
        ('{"action":"jump","count":1}', "not one of"),
    ]:
        layout.control_file.write_text(text)
        time.sleep(0.01)
        watcher.poll()
        snap = json.loads(shardrl("status", str(run_dir), "--json").stdout)
        assert reason in snap["control"]["last_rejection"]["reason"]
        assert snap["desired_workers"] == 3
        assert snap["control"]["last_applied"]["command"] == {"action": "add", "count": 2}


def test_scale_checks_the_bounds_and_warns_before_replacing_an_unapplied_command(run_dir):
    layout = RunLayout.of(run_dir)
    desired, before = control.read_state(layout).desired, layout.control_file.read_bytes()
    p = shardrl("scale", "--run-dir", str(run_dir), "--add", "9", check=False)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "above run.max_workers = 4" in p.stderr
    p = shardrl("scale", str(run_dir), "--remove", str(desired + 1), check=False)
    assert p.returncode == 2 and f"only {desired} workers are desired" in p.stderr
    assert layout.control_file.read_bytes() == before  # nothing written
    assert "warning" not in shardrl("scale", str(run_dir), "--set", "1").stderr  # the last one was handled
    p = shardrl("scale", "--set", "2", env={"SHARDRL_RUN": str(run_dir)})
    assert p.returncode == 0 and "warning" in p.stderr and '{ "action": "set", "count": 1 }' in p.stderr
    watcher = control.ControlWatcher(layout, max_workers=4, settle_s=0.0, who="test-supervisor")
    assert watcher.poll().desired == 2  # the replaced command was never applied


def test_synth_then_fsck_clean_then_corruption_found_and_repaired(run_dir):
    shardrl("synth", str(run_dir), "--shards", "3", "--samples", "10")
    layout = RunLayout.of(run_dir)
    ready = shards.list_ready(layout)
    assert len(ready) == 3 and all(s.rows == 10 for s in ready)
    vocab = json.loads(layout.config_json.read_text())["model"]["vocab_size"]
    t = shards.read_shard(layout.ready_shard(ready[0].name), vocab)
    groups = t.group_by("group_id").aggregate([("sample_id", "count")])
    assert max(groups.column("sample_id_count").to_pylist()) == 4
    assert shardrl("fsck", str(run_dir)).returncode == 0
    victim = layout.ready_shard(ready[1].name)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    p = shardrl("fsck", str(run_dir), check=False)
    assert p.returncode == 1 and "checksum" in p.stdout
    shardrl("fsck", str(run_dir), "--repair", check=False)
    assert shardrl("fsck", str(run_dir)).returncode == 0
    snap = json.loads(shardrl("status", str(run_dir), "--json").stdout)
    assert snap["shards"]["quarantined"] == 1 and snap["shards"]["ready"] == 2
    assert snap["shards"]["unconsumed_samples"] == 20


def test_tiny_model_command_builds_a_loadable_model(tmp_path):
    out = tmp_path / "tiny"
    shardrl("tiny-model", str(out), "--tied")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True
    assert cfg["hidden_size"] // cfg["num_attention_heads"] >= 32
