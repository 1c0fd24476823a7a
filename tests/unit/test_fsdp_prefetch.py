"""``trainer.fsdp_prefetch``: which layers each sharded decoder layer gathers ahead, and the setting's bounds.

Where FSDP2 really gathers: ``tests/integration/test_fsdp_prefetch.py`` profiles the prefetches on 2 gloo ranks, and
the PPO case of ``tests/integration/test_trainer_dist.py`` trains with two layers in flight and compares the gradient
with one process's.
"""

from __future__ import annotations

import pytest

from buffer.config import ConfigError, validate
from trainer.sharding import set_prefetch


class Unit:
    """Records what ``set_prefetch`` asks of an FSDP2 module."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.forward: list[int] | None = None
        self.backward: list[int] | None = None

    def set_modules_to_forward_prefetch(self, modules: list[Unit]) -> None:
        self.forward = [m.index for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[Unit]) -> None:
        self.backward = [m.index for m in modules]


def test_each_layer_gathers_the_next_k_in_forward_and_the_previous_k_nearest_first_in_backward() -> None:
    units = [Unit(i) for i in range(5)]
    set_prefetch(units, 2)
    assert [u.forward for u in units] == [[1, 2], [2, 3], [3, 4], [4], []]
    assert [u.backward for u in units] == [[], [0], [1, 0], [2, 1], [3, 2]]


def test_one_layer_leaves_fsdp2s_own_order() -> None:
    units = [Unit(i) for i in range(3)]
    set_prefetch(units, 1)
    assert all(u.forward is None and u.backward is None for u in units)


def test_the_setting_is_refused_outside_1_to_8() -> None:
    base = {"reward": {"function": "max_digit"}}
    assert validate(base, "cfg.toml").trainer.fsdp_prefetch == 1
    assert validate({**base, "trainer": {"fsdp_prefetch": 3}}, "cfg.toml").trainer.fsdp_prefetch == 3
    for bad in (0, 9):
        with pytest.raises(ConfigError, match=r"trainer\.fsdp_prefetch"):
            validate({**base, "trainer": {"fsdp_prefetch": bad}}, "cfg.toml")
