"""Typed records that cross the process boundary: status records, the LATEST pointer, the weights manifest, slot
leases, plans and trainer epoch claims.

One process writes each of these small JSON files and another reads it, so each has one definition here, with a
``schema_version``.  Writing validates (a misspelt or mistyped field fails in the writer); reading is strict: every
field must be present with the right type, and anything else is one ``RecordError`` line naming the file and the
field, never a silent default.  Defaults exist only so that a writer need not name every field it does not know yet;
they are written out, so a reader always sees every field.

Bump a record's ``schema_version`` (its ``Literal``) when its fields change; a reader then names the mismatch.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, ClassVar, Literal, Self, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .fsio import FileRefused, create_exclusive, json_bytes, read_capped, retry_transient, write_atomic

# The phases each process reports.  A process in one of the final states is not coming back by itself.
WorkerState = Literal["starting", "loading", "running", "reloading", "paused", "stopped", "failed"]
SupervisorState = Literal["starting", "running", "draining", "stopped"]
TrainerState = Literal["starting", "waiting", "training", "stopped"]
FINAL_STATES = frozenset({"stopped", "failed"})


class RecordError(ValueError):
    """A record file that is not valid JSON, lacks a field or has a wrong one; the message is one line."""

    def __init__(self, source: Path | str, field: str | None, problem: str):
        where = f"{source}: field {field}: " if field else f"{source}: "
        super().__init__(where + problem)
        self.source = str(source)
        self.field = field
        self.problem = problem


class _Strict(BaseModel):
    """Strict types and no unknown fields (parts of records, which carry no version of their own)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Record(_Strict):
    """Base of every record: strict types, no unknown fields, ``schema_version`` checked first on reading."""

    schema_version: int
    # A reader refuses a larger file unread: a damaged or hostile file must not exhaust its memory.
    max_bytes: ClassVar[int] = 1 << 20

    @classmethod
    def expected_version(cls) -> int:
        return int(cls.model_fields["schema_version"].default)

    @classmethod
    def validated(cls, data: dict[str, Any], source: Path | str) -> Self:
        """``data`` as this record for writing (defaults fill what the writer did not name), or RecordError."""
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise _record_error(e, source) from None

    @classmethod
    def parse(cls, data: Any, source: Path | str) -> Self:
        """``data`` as read from ``source``: every field must be there; no default is applied."""
        if not isinstance(data, dict):
            raise RecordError(
                source, None, f"expected a JSON object ({cls.__name__}), got {type(data).__name__}"
            )
        expected = cls.expected_version()
        if data.get("schema_version", None) != expected:
            got = "missing" if "schema_version" not in data else f"is {data['schema_version']!r}"
            raise RecordError(
                source,
                "schema_version",
                f"{got}; this shardrl reads {expected} (written by another version?)",
            )
        missing = [name for name in cls.model_fields if name not in data]
        if missing:
            raise RecordError(source, missing[0], f"missing from this {cls.__name__} record")
        return cls.validated(data, source)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_bytes(self) -> bytes:
        return json_bytes(self.to_json())


def _record_error(e: ValidationError, source: Path | str) -> RecordError:
    err = e.errors()[0]
    field = ".".join(str(p) for p in err["loc"]) or None
    if err["type"] == "missing":
        return RecordError(source, field, "missing")
    if err["type"] == "extra_forbidden":
        return RecordError(source, field, "not a field of this record (misspelt?)")
    shown = repr(err.get("input"))
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return RecordError(source, field, f"{err['msg'].lower()}, got {shown}")


R = TypeVar("R", bound=Record)


def read_record(kind: type[R], path: Path, *, attempts: int = 5) -> R:
    """Read and check one record file; FileNotFoundError when it is absent (after the transient retries).

    OSErrors name the file; one that is not a regular file or is over ``kind.max_bytes`` is a RecordError, unread.
    """
    try:
        raw = retry_transient(lambda: read_capped(path, kind.max_bytes), attempts=attempts)
    except FileRefused as e:
        raise RecordError(path, None, f"{e.reason} (a {kind.__name__} record)") from None
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise RecordError(path, None, f"not valid JSON ({getattr(e, 'msg', e)})") from None
    return kind.parse(data, path)


def write_record(path: Path, record: Record) -> None:
    """Replace ``path`` with ``record`` atomically (tmp, fsync, rename)."""
    write_atomic(path, record.to_bytes())


def create_record(path: Path, record: Record) -> bool:
    """Create ``path`` with ``record`` only if it does not exist yet; True when this call created it."""
    return create_exclusive(path, record.to_bytes())


# ---------------------------------------------------------------------------------------------- status records


class StatusRecord(Record):
    """What every status record carries: who wrote it, and a counter that grows with each write.

    Staleness is judged by ``beat`` no longer changing on the observer's own monotonic clock; ``updated_at`` (the
    writer's wall clock) is for people.
    """

    host: str
    pid: int
    beat: int = Field(ge=0)
    updated_at: float

    def age_s(self) -> float:
        """Seconds since the record was written, by the wall clock (for display only)."""
        return max(0.0, time.time() - self.updated_at)


class WorkerStatus(StatusRecord):
    """``status/workers/ID.json``: one rollout worker, written by the worker (and by its supervisor on giving up)."""

    schema_version: Literal[2] = 2
    id: str
    slot: int = Field(ge=0)
    state: WorkerState = "starting"
    supervisor: str | None = None
    incarnation: str | None = None
    engine: str | None = None
    weights_version: int | None = None
    latest_version: int | None = None
    last_reload_s: float | None = None
    paused_reason: Literal["stale", "backlog"] | None = None
    backlog: int | None = None
    # Samples this worker is generating or holds unpublished: the other workers count them as on their way to the
    # trainer when they decide whether a step is coming (``heartbeats.samples_in_flight``).
    in_flight: int = Field(0, ge=0)
    # Samples this incarnation has published as shards: the trainer copies it into its record with the backlog it
    # counted right after, so a worker can tell its own shards that count is not yet covering.
    published_samples: int = Field(0, ge=0)
    prompt_source: str | None = None
    prompt_epoch: int = 0
    prompt_cursor: int = 0
    batches: int = 0
    tokens_per_s: float | None = None
    reward_mean: float | None = None
    samples: int = 0
    tokens: int = 0
    shards: int = 0
    dropped_too_long: int = 0
    dropped_reward_groups: int = 0
    dropped_reward_samples: int = 0
    first_reward_error: str | None = None  # why the first group dropped for its reward was dropped
    dropped_bad_logprob_groups: int = 0
    # Streaming workers (rollout.streaming): samples scored 0.0 because their reward call timed out or crashed;
    # requests in the engine; the engine's busy share of the time the worker was not paused; weight versions
    # loaded under requests in flight; samples stopped while generating because the trainer would drop them (their
    # group started more than trainer.max_staleness versions before LATEST).
    reward_timeouts: int = 0
    aborted_stale_samples: int = 0
    requests_in_flight: int | None = None
    engine_busy: float | None = None
    reloads_in_flight: int = 0
    # Multi-turn workers (env.tools / env.agent): episodes published, their model turns, tool calls, tool errors and
    # time-outs, and episodes ended by a limit (truncated).
    episodes: int = 0
    model_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    truncated_episodes: int = 0
    errors: int = 0
    last_error: str | None = None
    gave_up: str | None = None


class SupervisedWorker(_Strict):
    """One slot as its node supervisor sees it (inside ``SupervisorStatus.workers``)."""

    worker_id: str
    pid: int | None
    state: Literal["running", "draining", "restarting"]
    restarts: int
    device: str
    # Copied from the worker's own record at each of the supervisor's writes, so that the trainer reads one record
    # per node instead of one per worker (``trainer/feed.py``); a worker with no live record yet has no incarnation.
    incarnation: str | None = None
    in_flight: int = Field(0, ge=0)
    published_samples: int = Field(0, ge=0)


class SupervisorStatus(StatusRecord):
    """``status/supervisors/ID.json``: one node supervisor."""

    schema_version: Literal[1] = 1
    id: str
    capacity: int = Field(ge=0)
    state: SupervisorState = "starting"
    slots: list[int] = Field(default_factory=list)
    desired: int = 0
    workers: dict[str, SupervisedWorker] = Field(default_factory=dict)
    failed_slots: dict[str, str] = Field(default_factory=dict)
    control_generation: int | None = None
    last_rejection: str | None = None  # why the last control.json command was rejected
    control_problem: str | None = None  # why the newest control generation is not followed (damaged)
    last_error: str | None = (
        None  # the last storage error the supervisor kept going through (e.g. a full disk)
    )


class FleetEntry(_Strict):
    """One live worker as the trainer last read it (inside ``TrainerStatus.fleet``)."""

    incarnation: str | None
    in_flight: int = Field(ge=0)
    published_samples: int = Field(ge=0)


class NodeEntry(_Strict):
    """One node's live workers as the trainer last read them from its supervisor's record (``TrainerStatus.nodes``):
    their ``in_flight`` and ``published_samples`` summed."""

    in_flight: int = Field(ge=0)
    published_samples: int = Field(ge=0)
    workers: int = Field(ge=0)


class TrainerStatus(StatusRecord):
    """``status/trainer.json``: the trainer's rank 0 (step, published version, the run's backlog counts)."""

    schema_version: Literal[1] = 1
    state: TrainerState = "starting"
    epoch: int | None = None
    resumed_from: int | None = None
    step: int = 0
    published_version: int = 0  # the newest version started, committed or still being written
    publishing: int | None = None  # the version whose files are being written (not yet in LATEST), if any
    samples_trained: int = 0
    dropped_stale: int = 0
    quarantined: int = 0
    waiting: str | None = None  # what the trainer waits for, while it waits (samples, a publish retry...)
    last_error: str | None = None  # the last storage error it kept going through (a full disk...)
    # buffer.status.Backlog, as of the last write
    ready_samples: int = 0
    consumed_samples: int = 0
    dropped_samples: int = 0
    unconsumed_samples: int = 0
    # What rollout workers judge by, rewritten about once a second even during a long step (``feed_at``), so that
    # no worker lists the run or reads the others' records: the highest planned step, the oldest shard bucket with
    # unconsumed samples (``open_from``) and the samples consumed from that bucket on (``window_consumed``), and each
    # live worker's ``in_flight`` and ``published_samples`` read *before* the backlog was counted: per node
    # supervisor (``nodes``, from one record per node), and per worker only for workers no live supervisor record
    # lists (``fleet``: started by hand, or a node whose supervisor is gone), so the record grows with the nodes.
    planned_step: int = 0
    open_from: int | None = None
    window_consumed: int = 0
    fleet: dict[str, FleetEntry] = Field(default_factory=dict)
    nodes: dict[str, NodeEntry] = Field(default_factory=dict)
    feed_at: float | None = None


class RunFinished(Record):
    """``finished.json``: written once, by the trainer that trained step ``trainer.total_steps``; the run is over.

    A trainer started on a finished run exits at once; node supervisors drain their workers and exit."""

    schema_version: Literal[1] = 1
    step: int = Field(ge=1)
    total_steps: int = Field(ge=1)
    published_version: int = Field(ge=0)
    epoch: int | None
    host: str
    pid: int
    at: float


LIVE_STATES = (
    frozenset(get_args(WorkerState) + get_args(SupervisorState) + get_args(TrainerState)) - FINAL_STATES
)


# ---------------------------------------------------------------------------------------------- weights


class LatestPointer(Record):
    """``weights/LATEST``: the newest complete weight version (replaced atomically after the version is sealed)."""

    schema_version: Literal[2] = 2
    version: int = Field(ge=1)
    path: str
    step: int = Field(ge=0)
    delta_of: int | None = Field(
        None, ge=1
    )  # a delta against this full version (``buffer.deltas``); None: full


class ManifestFile(_Strict):
    size: int = Field(ge=0)
    # with chunk_bytes: sha256 over the sha256 digests of the file's chunk_bytes-sized pieces (buffer.weights);
    # without (older manifests): the sha256 of the whole file
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    chunk_bytes: int | None = Field(None, ge=1)


class WeightsManifest(Record):
    """``weights/vXXXXXX/manifest.json``, written last into a version: every file with its size and sha256.

    ``kind`` says what the directory is: ``full`` HF weights, or a peft LoRA ``adapter`` for the base model
    ``base_model`` (whose ``buffer.weights.base_model_hash`` is ``base_sha256``).  ``adapter`` is where the adapter
    lies in the version (``.`` for an adapter version; a subdirectory of a full version merged from an adapter),
    None when there is none.
    """

    schema_version: Literal[3] = 3
    max_bytes: ClassVar[int] = 16 << 20
    version: int = Field(ge=1)
    step: int = Field(ge=0)
    dtype: str
    created_at: float
    files: dict[str, ManifestFile]
    kind: Literal["full", "adapter"] = "full"
    adapter: str | None = None
    base_model: str | None = None
    base_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    # a delta against this full version: its safetensors are XOR + zstd files and delta.json (``buffer.deltas``)
    delta_of: int | None = Field(None, ge=1)


# ---------------------------------------------------------------------------------------------- control


class ControlGeneration(Record):
    """``control/gen-XXXXXXXX.json``: the desired worker count after each applied or rejected command."""

    schema_version: Literal[1] = 1
    max_bytes: ClassVar[int] = 16 << 20  # the history grows with every command
    generation: int = Field(ge=0)
    desired: int = Field(ge=0)
    last_applied: dict[str, Any] | None
    last_rejection: dict[str, Any] | None
    history: list[str]  # keys of the commands handled, newest last


class Lease(Record):
    """``leases/slot-XXXX/GGGGGGGG.json``: generation ``generation`` of worker slot ``slot``'s lease, held by
    supervisor ``holder``, which bumps ``counter`` each heartbeat and sets ``released`` when it gives the slot back."""

    schema_version: Literal[1] = 1
    slot: int = Field(ge=0)
    generation: int = Field(ge=1)
    holder: str
    counter: int = Field(ge=0)
    released: bool = False
    host: str
    pid: int
    written_at: float


# ---------------------------------------------------------------------------------------------- consumption log


RowRange = list[int]
"""[index into a plan's ``shards``, first row, row after the last]: rows of one shard, in the plan's order."""


class Plan(Record):
    """``plans/sSSSSS/step-XXXXXXXX.eE.json``: what trainer step ``step`` of incarnation ``epoch`` consumes.

    ``takes`` are the trained rows in training order and ``drops`` the rows dropped as too stale, as row ranges of
    the shards named in ``shards`` (a step of whole groups is a few ranges a shard): a plan's size follows the
    shards it touches, not the samples."""

    schema_version: Literal[2] = 2
    max_bytes: ClassVar[int] = 16 << 20
    step: int = Field(ge=1)
    epoch: int = Field(ge=1)
    shards: list[str]
    takes: list[RowRange]
    drops: list[RowRange] = Field(default_factory=list)
    samples: int = Field(ge=0)
    dropped: int = Field(0, ge=0)
    extra: dict[str, Any] = Field(default_factory=dict)
    created_at: float = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _ranges_fit(self) -> Plan:
        for name, ranges in (("takes", self.takes), ("drops", self.drops)):
            for r in ranges:
                if len(r) != 3 or not 0 <= r[0] < len(self.shards) or not 0 <= r[1] < r[2]:
                    raise ValueError(f"{name}: {r} is not [shard index, first row, after the last row]")
        for name, ranges, n in (("samples", self.takes, self.samples), ("dropped", self.drops, self.dropped)):
            if sum(b - a for _i, a, b in ranges) != n:
                raise ValueError(f"{name} is {n}, its ranges hold {sum(b - a for _i, a, b in ranges)} rows")
        return self

    def rows(self, ranges: list[RowRange]) -> list[tuple[str, int]]:
        """(shard, row) of every row of ``ranges`` (``takes`` or ``drops``), in order."""
        return [(self.shards[i], r) for i, a, b in ranges for r in range(a, b)]


class LogSummary(Record):
    """``plans/summaries/step-XXXXXXXX.eE.json``: the consumption log up to ``step`` as trainer incarnation
    ``epoch`` knew it.  Valid by the plans' rule (``buffer.plans``); a resumed trainer starts from the newest valid
    one and reads only the plans after it.

    ``open_from``: the oldest shard bucket that may hold unconsumed samples (every shard before it is consumed);
    ``consumed``: the consumed rows of each shard from ``open_from`` on, as [first, after-last) ranges;
    ``writers``: per writer incarnation, the seqs of the shards consumed from, as ranges (for the whole run; absent
    in summaries written before it: those copies are then known from the plans after the summary only)."""

    schema_version: Literal[1] = 1
    max_bytes: ClassVar[int] = 64 << 20
    step: int = Field(ge=0)
    epoch: int = Field(ge=1)
    open_from: int = Field(ge=0)
    consumed_samples: int = Field(ge=0)
    dropped_samples: int = Field(ge=0)
    trained_steps: int = Field(ge=0)
    consumed: dict[str, list[list[int]]]
    writers: dict[str, list[list[int]]] = Field(default_factory=dict)
    at: float = Field(default_factory=time.time)


class PoisonedStep(Record):
    """``plans/poisoned/step-XXXXXXXX.json``: a step whose data made the trainer fail (out of memory, a loss that
    is not finite).  Its plan stays the record of what it consumed; a replay trains it without its samples."""

    schema_version: Literal[1] = 1
    step: int = Field(ge=1)
    epoch: int = Field(ge=1)
    reason: str
    at: float = Field(default_factory=time.time)


class EpochClaim(Record):
    """``plans/epochs/EEEEEE.json``: a trainer incarnation and the highest valid plan step it saw when claiming."""

    schema_version: Literal[1] = 1
    epoch: int = Field(ge=1)
    max_step: int = Field(ge=0)
    host: str
    pid: int
    at: float


class EpochProgress(Record):
    """``plans/epochs/EEEEEE.progress.json``: the highest step trainer incarnation ``epoch`` has started writing a
    plan for, replaced before each plan is created.  A newer incarnation reads it by name when it claims, so a plan
    that its node cannot list yet (a lookup cache) is still covered by its claim's ``max_step``."""

    schema_version: Literal[1] = 1
    epoch: int = Field(ge=1)
    step: int = Field(ge=1)
    at: float
