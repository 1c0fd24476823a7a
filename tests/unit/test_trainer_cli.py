"""`python -m trainer --help`: works without torch (nor torch.distributed), documents every option once, in the right
list; the command line refuses what the trainer would never read."""

from __future__ import annotations

import subprocess
import sys

import pytest

from buffer.config import PER_PROCESS_FIELDS, section_fields

PROBE = """
import sys
from trainer.__main__ import main
try:
    main(["--help"])
except SystemExit as e:
    assert e.code == 0, e.code
print("TORCH-IMPORTED" if "torch" in sys.modules else "NO-TORCH")
"""


@pytest.mark.proc
def test_help_needs_no_torch_and_documents_every_option_once() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True
    )
    text = out.stdout
    assert text.rstrip().endswith("NO-TORCH")
    for opt in ("--run-dir", "--run", "--max-steps", "SHARDRL_RUN", "torchrun", "--section.key VALUE"):
        assert opt in text, opt
    per_process, run_wide = text.split("Per-process settings")[1].split("Run-wide settings")
    keys = section_fields("trainer") + section_fields("algorithm")
    assert len(keys) > 30
    for key, f in keys:
        assert text.count(f"--{key} ") == 1, key
        assert f"--{key} " in (per_process if key in PER_PROCESS_FIELDS else run_wide), key
        assert (f.description or "") in text, key
    assert sum(k.startswith("trainer.") for k in PER_PROCESS_FIELDS) == per_process.count("--trainer.")
    assert "Exit status" in text


def test_rollout_overrides_are_refused_in_one_line(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    from trainer.__main__ import main

    assert main(["--run-dir", str(tmp_path), "--rollout.engine", "hf"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--rollout.engine is a rollout setting" in err
