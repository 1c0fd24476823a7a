"""Reading the metrics files the live view and the plots use."""

from __future__ import annotations

import json

from shardrl.report import last_record, read_jsonl


def test_last_record_skips_a_line_being_appended(tmp_path):
    path = tmp_path / "trainer.jsonl"
    path.write_text(
        "".join(json.dumps({"step": s, "pad": "x" * 50}) + "\n" for s in range(1, 2001)) + '{"step": 20'
    )
    assert last_record(path)["step"] == 2000
    assert last_record(path, tail_bytes=100)["step"] == 2000  # the seek cut the first line read: skipped
    assert [r["step"] for r in read_jsonl(path)][-1] == 2000
    assert last_record(tmp_path / "absent.jsonl") == {}
