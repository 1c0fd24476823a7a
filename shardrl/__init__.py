"""shardrl: RL post-training of LLMs with rollout and training jobs that meet only on shared storage.

This package is the application on top of the three process families: the `shardrl` command, the demo, the report,
synthetic shards, the built-in tiny model and the human status view.  It is the only package that may import all of
``buffer`` (the storage contract), ``trainer`` and ``rollout_worker``; those never import it.

Users scripting against the library start here::

    import shardrl
    run = shardrl.init_run("runs/x", shardrl.load_toml("cfg.toml"))
"""

from buffer.config import ConfigError, ShardRLConfig, load_toml
from buffer.layout import RunLayout
from buffer.run import Run, open_run

from .runs import init_run

__all__ = ["ConfigError", "Run", "RunLayout", "ShardRLConfig", "init_run", "load_toml", "open_run"]
