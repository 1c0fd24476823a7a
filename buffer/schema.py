"""Arrow schema of one experience sample (one row per sampled response) and its schema version."""

from __future__ import annotations

import pyarrow as pa

from . import SCHEMA_VERSION

REQUIRED_FIELDS: list[pa.Field] = [
    pa.field("sample_id", pa.string(), nullable=False),  # unique in the run
    pa.field("group_id", pa.string(), nullable=False),  # same for the n samples of one prompt draw
    pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
    # the behaviour policy's logprob of each response token, under the sampling distribution actually used
    pa.field("response_logprobs", pa.list_(pa.float32()), nullable=False),
    pa.field("reward", pa.float32(), nullable=False),
    pa.field("policy_version", pa.int64(), nullable=False),  # published weight version; 0 = base model
    pa.field("finish_reason", pa.string(), nullable=False),
    pa.field("worker_id", pa.string(), nullable=False),
    pa.field("created_at", pa.timestamp("ms", tz="UTC"), nullable=False),
]
OPTIONAL_FIELDS: list[pa.Field] = [
    pa.field("prompt_text", pa.string()),
    pa.field("response_text", pa.string()),
    pa.field("answer", pa.string()),
    pa.field("extra", pa.string()),  # JSON object
]
REQUIRED_NAMES = [f.name for f in REQUIRED_FIELDS]
OPTIONAL_NAMES = [f.name for f in OPTIONAL_FIELDS]
SAMPLE_SCHEMA = pa.schema(REQUIRED_FIELDS + OPTIONAL_FIELDS)

# Keys of the file's schema metadata.
META_SCHEMA_VERSION = b"shardrl.schema_version"
META_RUN_ID = b"shardrl.run_id"
META_WORKER_ID = b"shardrl.worker_id"
META_SEQ = b"shardrl.seq"


def schema_with_metadata(run_id: str, worker_id: str, seq: int) -> pa.Schema:
    return SAMPLE_SCHEMA.with_metadata(
        {
            META_SCHEMA_VERSION: str(SCHEMA_VERSION).encode(),
            META_RUN_ID: run_id.encode(),
            META_WORKER_ID: worker_id.encode(),
            META_SEQ: str(seq).encode(),
        }
    )


def schema_problem(schema: pa.Schema) -> str | None:
    """Why ``schema`` is not a shardrl sample schema, or None when it is."""
    meta = schema.metadata or {}
    version = meta.get(META_SCHEMA_VERSION)
    if version != str(SCHEMA_VERSION).encode():
        return f"schema version {version!r}, expected {SCHEMA_VERSION}"
    for f in REQUIRED_FIELDS:
        idx = schema.get_field_index(f.name)
        if idx < 0:
            return f"required column {f.name!r} missing"
        if not schema.field(idx).type.equals(f.type):
            return f"column {f.name!r} has type {schema.field(idx).type}, expected {f.type}"
    return None
