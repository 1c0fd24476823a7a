"""``trainer.activation_checkpointing_skip``: some decoder layers keep their activations instead of being
checkpointed, trading memory for the recompute.

What must hold: the layers left out are the ones named, spread over the depth; each of them runs its forward once a
step where a checkpointed layer runs it twice (the recompute in backward); the gradients are those of every layer
checkpointed; the parameter names (hence checkpoints and published weights) do not change; and a setting that
cannot apply is refused in one line.  What it buys on a GPU is measured by ``bench/trainer.py --ac-skip K``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from buffer.config import ConfigError, validate
from shardrl.tiny_model import build_tiny_model
from trainer.activations import checkpoint_layers, kept_layers
from trainer.gather import hf_name
from trainer.model import Actor, load_causal_lm
from trainer.sharding import decoder_layers


def test_the_layers_left_out_are_spread_over_the_depth() -> None:
    assert kept_layers(28, 0) == set()
    assert kept_layers(28, 4) == {3, 10, 17, 24}
    assert kept_layers(28, 8) == {1, 5, 8, 12, 15, 19, 22, 26}
    assert kept_layers(4, 1) == {2}
    assert kept_layers(5, 5) == set(range(5))
    for n in range(1, 40):
        for skip in range(n + 1):
            assert len(kept_layers(n, skip)) == skip and kept_layers(n, skip) <= set(range(n))


def test_more_layers_than_the_model_has_is_refused_naming_the_setting() -> None:
    with pytest.raises(
        ValueError, match=r"trainer\.activation_checkpointing_skip = 5: the model has 4 decoder layers"
    ):
        kept_layers(4, 5)


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("skip") / "model", shape={"num_hidden_layers": 4})


def _step(model_dir: Path, checkpointing: bool, skip: int) -> tuple[list[int], dict[str, torch.Tensor]]:
    """One forward and backward of the 4-layer actor; how often each layer's MLP ran, and the gradients by HF name."""
    torch.manual_seed(0)
    actor = Actor(load_causal_lm(model_dir))
    layers = decoder_layers(actor.lm.base_model)
    calls = [0] * len(layers)
    for i, layer in enumerate(layers):
        # a pre-hook: a recompute stops as soon as the saved tensors are back, before any forward hook would run
        layer.mlp.register_forward_pre_hook(lambda *_a, i=i: calls.__setitem__(i, calls[i] + 1))
    if checkpointing:
        checkpoint_layers(layers, skip=skip)
    ids = torch.randint(0, actor.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    actor.lm(input_ids=ids).logits.float().pow(2).mean().backward()
    return calls, {hf_name(n): p.grad for n, p in actor.named_parameters() if p.grad is not None}


def test_a_layer_left_out_runs_once_and_the_gradients_are_those_of_full_checkpointing(
    four_layers: Path,
) -> None:
    every_calls, every = _step(four_layers, checkpointing=True, skip=0)
    skip_calls, skipped = _step(four_layers, checkpointing=True, skip=1)
    plain_calls, plain = _step(four_layers, checkpointing=False, skip=0)
    assert every_calls == [2, 2, 2, 2], "control: a checkpointed layer runs again in backward"
    assert skip_calls == [2, 2, 1, 2], "layer 2 is left out (kept_layers(4, 1)), so nothing recomputes it"
    assert plain_calls == [1, 1, 1, 1]
    assert every.keys() == skipped.keys() == plain.keys() and len(every) > 10
    for name, g in every.items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(skipped[name], g, rtol=1e-6, atol=1e-9, msg=name)
        torch.testing.assert_close(plain[name], g, rtol=1e-6, atol=1e-9, msg=name)


def test_the_parameter_names_are_those_of_full_checkpointing(four_layers: Path) -> None:
    names = []
    for skip in (0, 2):
        actor = Actor(load_causal_lm(four_layers))
        checkpoint_layers(decoder_layers(actor.lm.base_model), skip=skip)
        names.append([hf_name(n) for n, _ in actor.named_parameters()])
    assert names[0] == names[1]


def test_the_setting_is_refused_without_checkpointing_in_one_line() -> None:
    base = {"reward": {"function": "max_digit"}}
    assert validate(base, "cfg.toml").trainer.activation_checkpointing_skip == 0
    on = {**base, "trainer": {"activation_checkpointing": True, "activation_checkpointing_skip": 6}}
    assert validate(on, "cfg.toml").trainer.activation_checkpointing_skip == 6
    with pytest.raises(ConfigError) as e:
        validate({**base, "trainer": {"activation_checkpointing_skip": 6}}, "cfg.toml")
    assert str(e.value) == (
        "cfg.toml: trainer.activation_checkpointing_skip = 6 needs trainer.activation_checkpointing = true: it "
        "names the layers left out of checkpointing"
    )
    with pytest.raises(ConfigError, match=r"trainer\.activation_checkpointing_skip"):
        validate(
            {**base, "trainer": {"activation_checkpointing": True, "activation_checkpointing_skip": -1}}, "c"
        )
