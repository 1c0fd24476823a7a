"""Arrow schema of one experience sample (one row per sampled response) and its schema version.

Sample columns version 2 adds the multi-turn columns (``MULTITURN_NAMES``, docs/DATA.md): optional, null on a
single-turn row, so a single-turn shard reads as before and a shard written before them (no
``shardrl.sample_version`` key: version 1) still validates.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

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
    # Multi-turn episodes (version 2).  ``response_ids`` is then every turn after the prompt back to back, the
    # model's as the engine produced them and the environment's as they were appended, never re-tokenised.
    pa.field("loss_mask", pa.list_(pa.int8())),  # per response token: 1 sampled by the model, 0 environment
    pa.field("turn_lengths", pa.list_(pa.int32())),  # tokens of each turn, in order; they sum to the response
    pa.field(
        "turn_versions", pa.list_(pa.int64())
    ),  # policy version of each model turn; -1 on environment turns
    pa.field("episode", pa.string()),  # JSON object: turns, tool calls and errors, why it ended
    # Version 3: the policy version that sampled each response token (-1 on an environment token), set only on a
    # response generated across a weight update (streaming workers); null: every token is ``policy_version``.
    pa.field("token_versions", pa.list_(pa.int64())),
]
MULTITURN_NAMES = ["loss_mask", "turn_lengths", "turn_versions", "episode"]
TYPED_OPTIONAL = [*MULTITURN_NAMES, "token_versions"]  # optional columns whose type is checked
REQUIRED_NAMES = [f.name for f in REQUIRED_FIELDS]
OPTIONAL_NAMES = [f.name for f in OPTIONAL_FIELDS]
SAMPLE_SCHEMA = pa.schema(REQUIRED_FIELDS + OPTIONAL_FIELDS)

# Logprobs are log-softmax outputs: <= 0 up to float32 rounding.  The one tolerance every writer and reader uses.
LOGPROB_TOLERANCE = 1e-4


def logprobs_ok(values: Iterable[float]) -> bool:
    """Whether every value is a logprob a shard may hold: finite and not above 0 (up to ``LOGPROB_TOLERANCE``)."""
    return all(math.isfinite(x) and x <= LOGPROB_TOLERANCE for x in values)


# Keys of the file's schema metadata.
META_SCHEMA_VERSION = b"shardrl.schema_version"
META_RUN_ID = b"shardrl.run_id"
META_WORKER_ID = b"shardrl.worker_id"
META_SEQ = b"shardrl.seq"
META_SAMPLE_VERSION = b"shardrl.sample_version"
SAMPLE_VERSION = 3  # of the sample columns; the run layout's version is SCHEMA_VERSION


def schema_with_metadata(run_id: str, worker_id: str, seq: int) -> pa.Schema:
    return SAMPLE_SCHEMA.with_metadata(
        {
            META_SCHEMA_VERSION: str(SCHEMA_VERSION).encode(),
            META_RUN_ID: run_id.encode(),
            META_WORKER_ID: worker_id.encode(),
            META_SEQ: str(seq).encode(),
            META_SAMPLE_VERSION: str(SAMPLE_VERSION).encode(),
        }
    )


def schema_problem(schema: pa.Schema) -> str | None:
    """Why ``schema`` is not a shardrl sample schema, or None when it is."""
    meta = schema.metadata or {}
    version = meta.get(META_SCHEMA_VERSION)
    if version != str(SCHEMA_VERSION).encode():
        return f"schema version {version!r}, expected {SCHEMA_VERSION}"
    sample_version = meta.get(META_SAMPLE_VERSION, b"1")
    if sample_version not in {str(v).encode() for v in range(1, SAMPLE_VERSION + 1)}:
        return f"sample version {sample_version!r}, expected 1 to {SAMPLE_VERSION}"
    for f in REQUIRED_FIELDS:
        idx = schema.get_field_index(f.name)
        if idx < 0:
            return f"required column {f.name!r} missing"
        if not schema.field(idx).type.equals(f.type):
            return f"column {f.name!r} has type {schema.field(idx).type}, expected {f.type}"
    for f in OPTIONAL_FIELDS:
        idx = schema.get_field_index(f.name)
        if f.name in TYPED_OPTIONAL and idx >= 0 and not schema.field(idx).type.equals(f.type):
            return f"column {f.name!r} has type {schema.field(idx).type}, expected {f.type}"
    return None


def multiturn_problem(t: pa.Table) -> str | None:
    """Why the multi-turn columns of ``t`` (a table with the sample schema) do not describe its responses, or None.

    A multi-turn row has ``loss_mask``, ``turn_lengths`` and ``turn_versions`` together; its turns (each of at least
    one token) cover ``response_ids`` exactly; the mask is 1 on exactly the tokens of the model's turns (those with
    a version >= 0) and 0 elsewhere; an environment token's behaviour logprob is 0.
    """
    if "loss_mask" not in t.column_names:
        return None  # written before version 2: single-turn only
    present = [pc.is_valid(t[c]) for c in ("loss_mask", "turn_lengths", "turn_versions")]
    if not (
        pc.all(pc.equal(present[0], present[1])).as_py() and pc.all(pc.equal(present[0], present[2])).as_py()
    ):
        return "loss_mask, turn_lengths and turn_versions must be set together"
    multi = t.filter(present[0])
    if multi.num_rows == 0:
        return None
    n_resp = pc.list_value_length(multi["response_ids"])
    if not pc.all(pc.equal(pc.list_value_length(multi["loss_mask"]), n_resp)).as_py():
        return "loss_mask and response_ids differ in length"
    if not pc.all(
        pc.equal(pc.list_value_length(multi["turn_versions"]), pc.list_value_length(multi["turn_lengths"]))
    ).as_py():
        return "turn_versions and turn_lengths differ in length"
    lengths = _flat(multi["turn_lengths"], np.int64)
    if lengths.size and lengths.min() < 1:
        return "a turn of 0 tokens in turn_lengths"
    turns = np.asarray(pc.list_value_length(multi["turn_lengths"]).to_numpy(zero_copy_only=False), np.int64)
    if turns.min() < 1:
        return "a multi-turn row without turns (turn_lengths empty)"
    starts = np.concatenate([[0], np.cumsum(turns)[:-1]])
    per_row = np.add.reduceat(lengths, starts)
    if not np.array_equal(per_row, np.asarray(n_resp.to_numpy(zero_copy_only=False), np.int64)):
        return "turn_lengths do not sum to the length of response_ids"
    mask = _flat(multi["loss_mask"], np.int64)
    expected = np.repeat((_flat(multi["turn_versions"], np.int64) >= 0).astype(np.int64), lengths)
    if not np.array_equal(mask, expected):
        return "loss_mask is not 1 on exactly the model's turns (turn_versions >= 0)"
    logprobs = _flat(multi["response_logprobs"], np.float64)
    if np.any(logprobs[mask == 0] != 0):
        return "response_logprobs not 0 on an environment token (loss_mask 0)"
    return None


def token_versions_problem(t: pa.Table) -> str | None:
    """Why the ``token_versions`` of ``t`` do not describe its responses, or None: one per response token, -1 on
    exactly the environment's tokens (``loss_mask`` 0), and the oldest model token's version is ``policy_version``
    (what staleness is judged by)."""
    if "token_versions" not in t.column_names:
        return None
    rows = t.filter(pc.is_valid(t["token_versions"]))
    if rows.num_rows == 0:
        return None
    if not pc.all(
        pc.equal(pc.list_value_length(rows["token_versions"]), pc.list_value_length(rows["response_ids"]))
    ).as_py():
        return "token_versions and response_ids differ in length"
    versions = rows["token_versions"].to_pylist()
    masks = rows["loss_mask"].to_pylist() if "loss_mask" in rows.column_names else [None] * rows.num_rows
    for vs, mask, oldest in zip(versions, masks, rows["policy_version"].to_pylist(), strict=True):
        model = [v for i, v in enumerate(vs) if mask is None or mask[i]]
        if mask is not None and any((v < 0) != (not m) for v, m in zip(vs, mask, strict=True)):
            return "token_versions not -1 on exactly the environment's tokens (loss_mask 0)"
        if mask is None and any(v < 0 for v in vs):
            return "a negative token version on a single-turn row"
        if model and min(model) != oldest:
            return f"policy_version {oldest} is not the oldest token version {min(model)}"
    return None


def _flat(col: pa.ChunkedArray, dtype: type) -> np.ndarray:
    """Every value of a list column, rows back to back (each row's slice, whatever offset it starts at)."""
    return np.asarray(pc.list_flatten(col).to_numpy(zero_copy_only=False), dtype=dtype)
