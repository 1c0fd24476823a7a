"""Property tests of the two parsers that take hostile input: control.json and shard bytes.

Whatever a person echoes into control.json, `parse_command` either accepts a command whose desired count is within
bounds or raises ControlError with one line; never another exception.  Whatever bytes sit under a shard name,
`validate_bytes` either returns the exact table that was written or raises ShardError; a damaged shard never
validates.
"""

from __future__ import annotations

import json
import zlib

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from buffer import shards
from buffer.control import ControlError, parse_command

from .buffer_helpers import sample

MAX_WORKERS = 16

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
commands = st.fixed_dictionaries(
    {"action": st.sampled_from(["add", "remove", "set", "ADD", "", "scale"]) | json_values},
    optional={"count": json_values | st.integers(-3, 40), "extra": json_values},
)
raw_inputs = (
    st.binary(max_size=64)
    | commands.map(lambda c: json.dumps(c).encode())
    | json_values.map(lambda v: json.dumps(v).encode())
)


@settings(max_examples=400, deadline=None)
@given(raw=raw_inputs, current=st.integers(0, MAX_WORKERS))
def test_control_parser_accepts_in_bounds_or_rejects_with_one_line(raw: bytes, current: int) -> None:
    try:
        cmd, desired = parse_command(raw, current, MAX_WORKERS, source="RUN/control.json")
    except ControlError as e:
        msg = str(e)
        assert msg.startswith("RUN/control.json: ") and "\n" not in msg
        return
    assert 0 <= desired <= MAX_WORKERS
    assert cmd["action"] in ("add", "remove", "set") and type(cmd["count"]) is int
    expected = {"add": current + cmd["count"], "remove": current - cmd["count"], "set": cmd["count"]}
    assert desired == expected[cmd["action"]]


def _shard_bytes() -> tuple[str, bytes, pa.Table]:
    rows = [sample(i, group=f"g{i // 2}") | {"sample_id": f"s{i}", "worker_id": "w0"} for i in range(4)]
    table = shards.build_table(rows, run_id="r", worker_id="w0", seq=0)
    sink = pa.BufferOutputStream()
    with ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    data = sink.getvalue().to_pybytes()
    name = shards.ShardName(0, "w0", "inc", 0, table.num_rows, zlib.crc32(data)).name
    return name, data, table


SHARD = _shard_bytes()


def test_the_intact_shard_validates() -> None:
    name, data, table = SHARD
    assert shards.validate_bytes(name, data).equals(table)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    edits=st.lists(st.tuples(st.integers(0, 10**9), st.integers(1, 255)), min_size=1, max_size=4),
    cut=st.none() | st.integers(0, 10**9),
)
def test_any_damage_to_a_shard_is_detected(edits: list[tuple[int, int]], cut: int | None) -> None:
    name, data, _ = SHARD
    damaged = bytearray(data)
    for pos, xor in edits:
        damaged[pos % len(damaged)] ^= xor
    if cut is not None:
        damaged = damaged[: cut % len(damaged)]
    if bytes(damaged) == data:  # two flips of one byte can cancel out
        return
    with pytest.raises(shards.ShardError):
        shards.validate_bytes(name, bytes(damaged))


@settings(max_examples=100, deadline=None)
@given(name=st.text(max_size=40))
def test_names_that_are_not_shard_names_are_refused(name: str) -> None:
    _, data, _ = SHARD
    if shards.ShardName.parse(name) is not None:
        return
    with pytest.raises(shards.ShardError, match="not a shard name"):
        shards.validate_bytes(name, data)
