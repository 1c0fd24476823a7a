"""`python -m trainer --help`: works without torch (nor torch.distributed) and documents every option."""

from __future__ import annotations

import subprocess
import sys

from buffer.config import PER_PROCESS_FIELDS, AlgorithmConfig, TrainerConfig

PROBE = """
import sys
from trainer.__main__ import main
try:
    main(["--help"])
except SystemExit as e:
    assert e.code == 0, e.code
print("TORCH-IMPORTED" if "torch" in sys.modules else "NO-TORCH")
"""


def test_help_needs_no_torch_and_documents_every_option() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True
    )
    text = out.stdout
    assert text.rstrip().endswith("NO-TORCH")
    for opt in ("--run-dir", "--run", "--max-steps", "SHARDRL_RUN", "torchrun"):
        assert opt in text, opt
    for key in PER_PROCESS_FIELDS:
        if key.startswith("trainer."):
            assert f"--{key} " in text, key
    for name, f in TrainerConfig.model_fields.items():
        assert f"--trainer.{name} " in text and (f.description or "") in text, name
    for name in AlgorithmConfig.model_fields:
        assert f"--algorithm.{name} " in text, name
    assert "Exit status" in text
