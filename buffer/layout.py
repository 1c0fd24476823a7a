"""Every path of a run directory, in one place.

Nobody formats a run-directory path by hand anywhere else.  The layout (also documented in README.md)::

    RUN/
      run.json                 run id, schema version, creation time
      finished.json            written once by the trainer when trainer.total_steps are trained: the run is over
      config.json              the resolved run config (single source of truth for every process)
      control.json             written by people (`echo '{"action":"add","count":2}' > RUN/control.json`)
      control/gen-XXXXXXXX.json  durable desired-worker state, one generation per applied/rejected command
      leases/slot-XXXX/GGGGGGGG.json  worker-slot leases held by node supervisors, one file per lease generation
      shards/tmp/              shards being written (temporaries)
      shards/ready/bBBBBBBBB/  complete, published experience shards (Arrow IPC file format), in time buckets of
                               BUCKET_S seconds (the bucket is the first field of a shard's name): a poll lists only
                               the buckets that can still change or still hold unconsumed samples
      shards/quarantine/       shards that failed validation, each with a .reason.json
      plans/sSSSSS/step-XXXXXXXX.eN.json  the trainer's consumption log (one plan per step, N = trainer epoch), in
                               buckets of PLAN_BUCKET_STEPS steps; a plan names shards and row ranges
      plans/summaries/step-XXXXXXXX.eN.json  the consumption log compacted up to a step: what a resumed trainer
                               reads instead of every plan
      plans/poisoned/step-XXXXXXXX.json  steps whose data failed the trainer (replayed without their samples)
      plans/epochs/XXXXXX.json trainer incarnations (fencing); XXXXXX.progress.json: the step each is planning
      weights/vXXXXXX/         published HF-format weight versions (manifest.json written last)
      weights/LATEST           atomic pointer to the newest complete version
      weights/BEST.json        the evaluator's best-scoring version and its score (kept by garbage collection)
      status/workers/ID.json   worker status records (heartbeats)
      status/supervisors/ID.json
      status/trainer.json      trainer status record
      checkpoints/step-XXXXXXXX/  DCP checkpoints; complete once COMMITTED exists
      metrics/*.jsonl          per-step metrics (trainer, rollout, eval)
      logs/NAME.log            process logs
      tensorboard/             the trainer's TensorBoard events (trainer.tensorboard)
      .init.lock               held by `shardrl init` while it creates the run
      base_model/              the base model when the config asks for the built-in tiny model
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .fsio import make_dirs

BUCKET_S = 60  # seconds of publishing per shard bucket: a bucket of a busy run holds ~1k shards
PLAN_BUCKET_STEPS = 1000  # plans per plan bucket (times the trainer incarnations that planned them)
_BUCKET_RE = re.compile(r"^b(\d{9})\.")


@dataclass(frozen=True)
class RunLayout:
    root: Path

    @classmethod
    def of(cls, root: str | Path) -> RunLayout:
        return cls(Path(root).absolute())

    # run-wide records
    @property
    def run_json(self) -> Path:
        return self.root / "run.json"

    @property
    def config_json(self) -> Path:
        return self.root / "config.json"

    @property
    def finished(self) -> Path:
        return self.root / "finished.json"

    @property
    def init_lock(self) -> Path:
        """The lock `shardrl init` holds while it creates the run (two inits of one directory serialise on it)."""
        return self.root / ".init.lock"

    @property
    def base_model(self) -> Path:
        return self.root / "base_model"

    # control and elastic scale
    @property
    def control_file(self) -> Path:
        return self.root / "control.json"

    @property
    def control_dir(self) -> Path:
        return self.root / "control"

    def control_generation(self, gen: int) -> Path:
        return self.control_dir / f"gen-{gen:08d}.json"

    @property
    def leases(self) -> Path:
        return self.root / "leases"

    def lease_dir(self, slot: int) -> Path:
        return self.leases / f"slot-{slot:04d}"

    def lease(self, slot: int, generation: int) -> Path:
        return self.lease_dir(slot) / f"{generation:08d}.json"

    # experience shards
    @property
    def shards_tmp(self) -> Path:
        return self.root / "shards" / "tmp"

    @property
    def shards_ready(self) -> Path:
        return self.root / "shards" / "ready"

    @property
    def shards_quarantine(self) -> Path:
        return self.root / "shards" / "quarantine"

    def ready_bucket(self, bucket: int) -> Path:
        return self.shards_ready / f"b{bucket:09d}"

    def ready_shard(self, name: str) -> Path:
        """Where the shard called ``name`` is published: in the bucket its name begins with."""
        m = _BUCKET_RE.match(name)
        return (self.ready_bucket(int(m.group(1))) if m else self.shards_ready) / name

    def quarantined_shard(self, name: str) -> Path:
        return self.shards_quarantine / name

    def quarantine_reason(self, name: str) -> Path:
        return self.shards_quarantine / f"{name}.reason.json"

    # consumption log
    @property
    def plans(self) -> Path:
        return self.root / "plans"

    def plan_bucket(self, bucket: int) -> Path:
        return self.plans / f"s{bucket:05d}"

    def plan(self, step: int, epoch: int) -> Path:
        return self.plan_bucket(step // PLAN_BUCKET_STEPS) / f"step-{step:08d}.e{epoch}.json"

    @property
    def summaries(self) -> Path:
        return self.plans / "summaries"

    def summary(self, step: int, epoch: int) -> Path:
        return self.summaries / f"step-{step:08d}.e{epoch}.json"

    @property
    def poisoned(self) -> Path:
        return self.plans / "poisoned"

    def poisoned_step(self, step: int) -> Path:
        return self.poisoned / f"step-{step:08d}.json"

    @property
    def epochs(self) -> Path:
        return self.plans / "epochs"

    def epoch(self, epoch: int) -> Path:
        return self.epochs / f"{epoch:06d}.json"

    def epoch_progress(self, epoch: int) -> Path:
        return self.epochs / f"{epoch:06d}.progress.json"

    # weights
    @property
    def weights(self) -> Path:
        return self.root / "weights"

    def weight_version(self, version: int) -> Path:
        return self.weights / f"v{version:06d}"

    def weight_staging(self, version: int) -> Path:
        """Where the trainer's ranks write version ``version`` before it is committed (see buffer/weights.py)."""
        return self.weights / f".staging-v{version:06d}"

    @property
    def latest_pointer(self) -> Path:
        return self.weights / "LATEST"

    @property
    def best_pointer(self) -> Path:
        return self.weights / "BEST.json"

    # status records
    @property
    def worker_status_dir(self) -> Path:
        return self.root / "status" / "workers"

    def worker_status(self, worker_id: str) -> Path:
        return self.worker_status_dir / f"{worker_id}.json"

    @property
    def supervisor_status_dir(self) -> Path:
        return self.root / "status" / "supervisors"

    def supervisor_status(self, supervisor_id: str) -> Path:
        return self.supervisor_status_dir / f"{supervisor_id}.json"

    @property
    def trainer_status(self) -> Path:
        return self.root / "status" / "trainer.json"

    # trainer checkpoints
    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step-{step:08d}"

    def checkpoint_commit(self, step: int) -> Path:
        return self.checkpoint(step) / "COMMITTED"

    # metrics and logs
    @property
    def metrics(self) -> Path:
        return self.root / "metrics"

    def metrics_file(self, name: str) -> Path:
        return self.metrics / f"{name}.jsonl"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log_file(self, name: str) -> Path:
        """A process's log under logs/ (``rollout-w0-HOST``, ``demo-trainer``)."""
        return self.logs / f"{name}.log"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def demo_summary(self) -> Path:
        return self.root / "demo_summary.json"

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    def directories(self) -> list[Path]:
        return [
            self.control_dir,
            self.leases,
            self.shards_tmp,
            self.shards_ready,
            self.shards_quarantine,
            self.plans,
            self.epochs,
            self.summaries,
            self.poisoned,
            self.weights,
            self.worker_status_dir,
            self.supervisor_status_dir,
            self.checkpoints,
            self.metrics,
            self.logs,
        ]

    def create(self) -> None:
        """Every directory of the run, with the run's directory mode (``fsio.set_modes``)."""
        for d in self.directories():
            make_dirs(d)
