"""Activation checkpointing with each layer's saved input in host memory (``trainer.activation_offload``).

On CPU the "host copy" is a second CPU tensor, so what these tests check is the mechanism, not the bandwidth: the
gradients are those of plain checkpointing bit for bit (the same recompute from the same values), and the GPU-side
input (here: the original tensor) is no longer held by the graph between forward and backward, where plain
checkpointing holds it.  The GPU run is in ``bench/run_gpu.sh`` (section ``long7b``).
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

from buffer.config import ConfigError, validate
from tests.unit.test_packing import _actor
from trainer import activations
from trainer.activations import checkpointed
from trainer.sharding import decoder_layers


def _run(model_dir: Path, offload: bool, device: str = "cpu") -> tuple[bool, dict[str, torch.Tensor]]:
    """Forward and backward of the tiny actor with every layer checkpointed; whether layer 1's input was still alive
    between forward and backward, and the gradients."""
    actor = _actor(model_dir).to(device)
    layers = decoder_layers(actor.lm.base_model)
    for i, layer in enumerate(layers):
        layers[i] = checkpointed(layer, offload=offload)
    inputs: list[weakref.ref[torch.Tensor]] = []
    layers[1].register_forward_pre_hook(lambda _m, args: inputs.append(weakref.ref(args[0])))
    ids = torch.randint(0, actor.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0)).to(
        device
    )
    logits = actor.lm(input_ids=ids).logits
    gc.collect()
    alive = inputs[0]() is not None
    logits.float().pow(2).mean().backward()
    return alive, {n: p.grad.cpu() for n, p in actor.named_parameters() if p.grad is not None}


def test_offloaded_inputs_give_the_gradients_of_plain_checkpointing_and_leave_the_graph(
    tiny_model_untied: Path,
) -> None:
    kept, want = _run(Path(tiny_model_untied), offload=False)
    still_held, got = _run(Path(tiny_model_untied), offload=True)
    assert kept, "control: plain checkpointing keeps each layer's input for the recompute"
    assert not still_held, "with offload the graph holds a copy of layer 1's input, not the tensor itself"
    assert got.keys() == want.keys() and len(want) > 10
    for name, g in want.items():
        assert g.abs().max() > 0, name
        assert torch.equal(got[name], g), name


@pytest.mark.gpu
def test_on_cuda_the_inputs_go_to_pinned_host_memory_and_come_back_in_order(tiny_model_untied: Path) -> None:
    """On a GPU the copies are asynchronous on the compute stream (pinned host memory, ``non_blocking``): the
    gradients must still be those of plain checkpointing, which they would not be if backward read a host copy
    before its copy had landed, or if the GPU block were reused before the copy had read it."""
    kept, want = _run(Path(tiny_model_untied), offload=False, device="cuda")
    still_held, got = _run(Path(tiny_model_untied), offload=True, device="cuda")
    assert kept and not still_held
    assert got.keys() == want.keys() and len(want) > 10
    for name, g in want.items():
        # the same kernels on the same values; a tolerance only for any nondeterministic reduction order
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6 * float(g.abs().max()), msg=name)


class _Layer(torch.nn.Module):
    """A layer that takes its hidden states by keyword, as some decoder layers are called."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, *, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(hidden_states)) * hidden_states


def test_hidden_states_passed_by_keyword_stay_and_say_so(caplog: pytest.LogCaptureFixture) -> None:
    # The checkpoint keeps keyword tensors in a dict beside the graph, out of the hooks' reach: the step must still
    # be plain checkpointing's, and the run must say that nothing moved (once per layer class).
    activations._warn_keyword_input.cache_clear()
    torch.manual_seed(0)
    layer = checkpointed(_Layer(), offload=True)
    x = torch.randn(3, 8, requires_grad=True)
    with caplog.at_level("WARNING", logger="trainer.activations"):
        layer(hidden_states=x * 2).sum().backward()
        layer(hidden_states=x * 2).sum().backward()
    said = [r.getMessage() for r in caplog.records if "activation_offload" in r.getMessage()]
    assert said == [
        "trainer.activation_offload: _Layer takes its hidden states by keyword; its checkpointed inputs stay on the "
        "device"
    ]
    torch.manual_seed(0)
    plain, y = _Layer(), x.detach().clone().requires_grad_()
    for _ in range(2):
        plain(hidden_states=y * 2).sum().backward()
    assert x.grad is not None and y.grad is not None and torch.equal(x.grad, y.grad)


def test_offload_wraps_the_layer_under_the_names_of_plain_checkpointing(tiny_model_untied: Path) -> None:
    # Checkpoints and published weights are keyed by parameter names: both wrappings must give the same ones.
    plain, offloaded = _actor(Path(tiny_model_untied)), _actor(Path(tiny_model_untied))
    for actor, offload in ((plain, False), (offloaded, True)):
        layers = decoder_layers(actor.lm.base_model)
        for i, layer in enumerate(layers):
            layers[i] = checkpointed(layer, offload=offload)
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in offloaded.named_parameters()]


def test_offload_without_checkpointing_is_refused_in_one_line() -> None:
    base = {"reward": {"function": "max_digit"}}
    on = {**base, "trainer": {"activation_checkpointing": True, "activation_offload": True}}
    assert validate(on, "cfg.toml").trainer.activation_offload
    assert not validate(base, "cfg.toml").trainer.activation_offload
    with pytest.raises(ConfigError) as e:
        validate(
            {**base, "trainer": {"activation_checkpointing": False, "activation_offload": True}}, "cfg.toml"
        )
    assert str(e.value) == (
        "cfg.toml: trainer.activation_offload = true needs trainer.activation_checkpointing = true: the layers' "
        "saved inputs it moves to host memory are those of checkpointing"
    )
