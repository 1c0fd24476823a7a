"""Small builders shared by the buffer tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from buffer.config import ShardRLConfig
from buffer.layout import RunLayout
from buffer.records import Plan

if TYPE_CHECKING:
    from buffer.weights import WeightVersion


def make_layout(tmp_path: Path) -> RunLayout:
    layout = RunLayout.of(tmp_path / "run")
    layout.create()
    return layout


def stub_config(tmp_path: Path, **sections: dict[str, Any]) -> ShardRLConfig:
    """A config whose model is a directory with a bare config.json (enough for ``init_run``, nothing loads it),
    plus ``sections`` (e.g. ``run={...}``)."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"vocab_size": 100}))
    return ShardRLConfig.model_validate(
        {"model": {"path": str(model)}, "reward": {"function": "max_digit"}, **sections}
    )


def sample(
    i: int, group: str = "g0", n_resp: int = 3, reward: float = 1.0, version: int = 0
) -> dict[str, Any]:
    return {
        "group_id": group,
        "prompt_ids": [1, 2, 3],
        "response_ids": [4 + (i % 5)] * n_resp,
        "response_logprobs": [-0.5] * n_resp,
        "reward": reward,
        "policy_version": version,
        "finish_reason": "stop",
        "prompt_text": "max(3,9)=",
        "response_text": "9",
        "answer": "9",
    }


def publish_ids(layout: RunLayout, ids: list[str], worker: str = "w0", run_id: str = "run") -> str:
    """A real shard holding one sample per id of ``ids``, in that order (row i is ``ids[i]``); its name."""
    from buffer.shards import ShardWriter

    w = ShardWriter(layout, run_id, worker)
    for i, sid in enumerate(ids):
        w.add(sample(i) | {"sample_id": sid})
    path = w.flush()
    assert path is not None
    return path.name


def publish_version(layout: RunLayout, version: int, payload: bytes = b"x" * 100) -> WeightVersion:
    """Weight ``version`` at step ``10 * version``: ``payload`` as its model.safetensors and an empty config.json,
    committed the way the trainer commits (staging -> manifest -> LATEST)."""
    from buffer import weights

    st = weights.staging_dir(layout, version)
    (st / "model.safetensors").write_bytes(payload)
    (st / "config.json").write_text("{}")
    return weights.commit_version(layout, version, st, step=version * 10, dtype="float32")


def plan_sample_ids(layout: RunLayout, plan: Plan, which: str = "takes") -> list[str]:
    """The sample ids of ``plan``'s ``takes`` (or ``drops``), in the plan's order, read from its ready shards."""
    from buffer.shards import read_shard

    assert which in ("takes", "drops"), which
    ids: dict[str, list[str]] = {}
    out = []
    for name, row in plan.rows(plan.takes if which == "takes" else plan.drops):
        if name not in ids:
            ids[name] = read_shard(layout.ready_shard(name)).column("sample_id").to_pylist()
        out.append(ids[name][row])
    return out
