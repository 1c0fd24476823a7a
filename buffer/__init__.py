"""The shared-storage contract of shardrl.

Rollout workers and the trainer never talk to each other: they meet only in a run directory on a shared filesystem
(Lustre/NFS).  Everything that crosses that boundary — experience shards, the trainer's consumption log, published
weights, control commands, leases and status records — is defined here.  This package imports nothing else of ours
and nothing heavy (no torch) at import time.
"""

SCHEMA_VERSION = 3
"""Version of the run-directory layout (run.json, shard metadata).  2: every JSON record carries its own
``schema_version`` and is read strictly (``buffer.records``).  3: shards live in time buckets
(``shards/ready/bBBBBBBBB/``), plans name row ranges of shards instead of sample ids and live in step buckets
(``plans/sSSSSS/``), with summaries that bound what a resumed trainer reads; workers judge the backlog from the
trainer's record (``status/trainer.json``) instead of listing the run."""
