"""The pieces of Ulysses sequence parallelism that need no process group: how a packed row is split over K ranks,
the layouts around the two all-to-all exchanges (the exchange simulated here), the repeat of KV heads for grouped
queries, and the refusals.  ``tests/integration/test_sequence_parallel.py`` runs the real thing on gloo ranks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from buffer.config import ConfigError, validate
from trainer import sequence_parallel as seqpar
from trainer.attention import PackedRow


def _row(lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, PackedRow]:
    n = sum(lens)
    ids = torch.arange(100, 100 + n).unsqueeze(0)
    positions = torch.cat([torch.arange(k) for k in lens]).unsqueeze(0)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return ids, positions, PackedRow(lens, cu)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_split_covers_the_row_and_scores_each_wanted_token_once(k: int) -> None:
    lens = [3, 5, 2]
    ids, positions, row = _row(lens)
    want = torch.ones_like(ids, dtype=torch.bool)
    want[0, 3:5] = False  # a prompt
    shards = [seqpar.split(ids, positions, want, row, seqpar.SPGroup(k, r, None)) for r in range(k)]
    c = -(-10 // k)
    pad = c * k - 10
    for s in shards:
        assert s.ids.shape == s.positions.shape == (1, c)
        assert s.target_ids.shape == s.target_want.shape == (1, c + 1)
        assert s.row.lens == lens + ([pad] if pad else []) and s.row.sp is not None
        assert s.row.cu_seqlens.tolist() == [0, 3, 8, 10] + ([c * k] if pad else [])
        assert torch.equal(s.positions_full, positions) and s.length == 10
    # the chunks are the padded row, whose padding is a sequence of its own starting at position 0
    assert torch.cat([s.ids for s in shards], 1)[0, :10].tolist() == ids[0].tolist()
    assert torch.cat([s.positions for s in shards], 1)[0, 10:].tolist() == list(range(pad))
    # each rank's targets are its positions shifted by one: the token after each of them
    for r, s in enumerate(shards):
        assert torch.equal(s.target_ids[:, :-1], s.ids)
        nxt = shards[r + 1].ids[0, 0].item() if r + 1 < k else 0
        assert s.target_ids[0, -1].item() == nxt
    # a token is scored once, on the rank that holds the position before it, and only if wanted and not first
    scored = [r * c + j for r, s in enumerate(shards) for j in range(1, c + 1) if s.target_want[0, j]]
    expected = [t for t in range(10) if want[0, t] and positions[0, t] != 0]
    assert scored == expected


@pytest.mark.parametrize("k", [2, 4])
def test_the_exchange_layouts_give_each_rank_its_heads_over_the_whole_row(k: int) -> None:
    h, n, d = 8, 12, 3
    c, hk = n // k, h // k
    full = torch.randn(1, h, n, d)  # q, k or v of the whole row

    def exchange(sends: list[torch.Tensor]) -> list[torch.Tensor]:  # all_to_all_single with equal splits
        return [torch.stack([sends[i][r] for i in range(k)]) for r in range(k)]

    sends = [seqpar.heads_major(full[:, :, r * c : (r + 1) * c], k) for r in range(k)]
    got = [seqpar.full_sequence(x) for x in exchange(sends)]
    for r in range(k):
        assert torch.equal(got[r], full[:, r * hk : (r + 1) * hk])
    out = torch.randn(1, n, h, d)  # attention output [1, N, heads, D] as SDPA returns it
    sends = [seqpar.sequence_major(out[:, :, r * hk : (r + 1) * hk], k) for r in range(k)]
    back = [seqpar.all_heads(x) for x in exchange(sends)]
    for r in range(k):
        assert torch.equal(back[r], out[:, r * c : (r + 1) * c])


@pytest.mark.parametrize(("heads", "kv", "k"), [(4, 2, 2), (4, 2, 4), (12, 2, 4), (12, 2, 3), (28, 4, 4)])
def test_repeated_kv_heads_keep_every_query_with_its_own_kv_head(heads: int, kv: int, k: int) -> None:
    rep = seqpar.kv_repeats(kv, k)
    # the fewest repeats that give every rank whole KV heads
    assert (kv * rep) % k == 0 and all((kv * fewer) % k for fewer in range(1, rep))
    labels = torch.arange(kv).repeat_interleave(rep)  # the original KV head of each repeated one
    q_local, kv_local = heads // k, kv * rep // k
    for r in range(k):
        mine = labels[r * kv_local : (r + 1) * kv_local]
        for i in range(q_local):
            query = r * q_local + i
            # SDPA pairs local query i with local KV head i // (q_local / kv_local)
            assert mine[i // (q_local // kv_local)] == query // (heads // kv)


def test_refusals_name_the_field_and_what_is_accepted() -> None:
    with pytest.raises(
        ValueError, match=r"^trainer.sequence_parallel = 3 must divide .*\(4 ranks\): one of \[1, 2, 4\]$"
    ):
        seqpar.check_world(3, 4)
    seqpar.check_world(2, 4)
    qwen = SimpleNamespace(num_attention_heads=12, num_key_value_heads=2)
    with pytest.raises(
        ValueError, match=r"^trainer.sequence_parallel = 8 must divide the model's 12 attention"
    ):
        seqpar.check_heads(8, qwen)
    seqpar.check_heads(4, qwen)  # 2 KV heads, repeated to 4
    assert seqpar.group(1) is None


def test_config_bounds_and_the_packing_rule() -> None:
    base = {"reward": {"function": "max_digit"}}
    assert validate(base, "cfg.toml").trainer.sequence_parallel == 1
    assert validate({**base, "trainer": {"sequence_parallel": 2}}, "cfg.toml").trainer.sequence_parallel == 2
    with pytest.raises(ConfigError, match="sequence_parallel"):
        validate({**base, "trainer": {"sequence_parallel": 0}}, "cfg.toml")
    with pytest.raises(ConfigError) as e:
        validate({**base, "trainer": {"sequence_parallel": 2, "packing": False}}, "cfg.toml")
    assert str(e.value) == (
        "cfg.toml: trainer.sequence_parallel (2) needs trainer.packing = true: sequences are split over ranks as "
        "chunks of a packed row"
    )


def test_bench_passes_sequence_parallel_to_the_packed_trainer_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "trainer.py"
    monkeypatch.syspath_prepend(str(path.parent))  # run as a script, it imports its neighbours
    spec = importlib.util.spec_from_file_location("bench_trainer", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = bench.parse_args(["--preset", "tiny", "--sequence-parallel", "2"])
    assert bench.make_config(args, packing=True).trainer.sequence_parallel == 2
    assert bench.make_config(args, packing=False).trainer.sequence_parallel == 1
    with pytest.raises(SystemExit):
        bench.parse_args(["--preset", "tiny", "--sequence-parallel", "2", "--padded"])
