"""``trainer.kernels``: the compiled decoder layers give the eager step's numbers, and the switch falls back to eager
where it should.  The compiled path runs here for real: inductor's C++ backend on the CPU (the GPU build generates
Triton kernels from the same graphs; `tests/integration/test_gpu.py` trains with them on a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from buffer.config import ShardRLConfig
from tests.unit.test_packing import _actor, _samples
from trainer import dist as tdist
from trainer.model import build_optimizer, build_scheduler
from trainer.phases import PhaseTimer, phase, timing
from trainer.sharding import compile_layers, decoder_layers, resolve_kernels
from trainer.step import Models, train_step


def test_auto_compiles_on_cuda_only_and_an_explicit_choice_stands() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kernels("auto", cpu) == "eager" and resolve_kernels("auto", cuda) == "compile"
    assert resolve_kernels("compile", cpu) == "compile" and resolve_kernels("eager", cuda) == "eager"
    assert ShardRLConfig.model_validate({"reward": {"function": "max_digit"}}).trainer.kernels == "auto"


def test_without_a_c_compiler_auto_stays_eager_and_compile_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("trainer.sharding.shutil.which", lambda name: None)
    cuda = torch.device("cuda")
    assert resolve_kernels("auto", cuda) == "eager" and "no C compiler" in caplog.text
    with pytest.raises(RuntimeError, match=r'^trainer\.kernels = "compile" needs a C compiler') as e:
        resolve_kernels("compile", cuda)
    assert "\n" not in str(e.value)
    assert resolve_kernels("eager", cuda) == "eager"


def _step(model_dir: Path, compiled: bool) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One GRPO step with an entropy bonus and a KL term, packed micro-batches of two lengths (the second length
    makes the compiled layers recompile with dynamic shapes); the metrics and the gradients before the update."""
    cfg = ShardRLConfig.model_validate(
        {
            "reward": {"function": "max_digit"},
            "algorithm": {"name": "grpo", "entropy_coef": 0.01, "kl_coef": 0.05, "kl_mode": "loss"},
            "trainer": {"max_tokens_per_microbatch": 24},
        }
    )
    torch.manual_seed(0)
    actor, reference = _actor(model_dir), _actor(model_dir).requires_grad_(False).eval()
    if compiled:
        for model in (actor, reference):
            compile_layers(decoder_layers(model.lm.base_model))
    opt = build_optimizer(actor, lr=1e-5)
    models = Models(
        actor, opt, build_scheduler(opt, warmup_steps=0, schedule="constant", total_steps=1), reference
    )
    grads: dict[str, torch.Tensor] = {}

    def keep(ms: Models) -> None:
        grads.update({n: p.grad.clone() for n, p in ms.actor.named_parameters() if p.grad is not None})

    vocab = actor.config.vocab_size
    samples = _samples(vocab, seed=3, shapes=[(4, 8), (3, 9), (5, 6), (2, 11)])
    return train_step(cfg, models, samples, pad_id=0, grad_hook=keep), grads


def test_compiled_layers_train_like_eager_ones_in_fp32(
    tiny_model_untied: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tdist, "_device", torch.device("cpu"))
    eager, eager_grads = _step(tiny_model_untied, compiled=False)
    fused, fused_grads = _step(tiny_model_untied, compiled=True)
    for key in ("loss", "grad_norm", "kl_ref", "entropy"):
        assert fused[key] == pytest.approx(eager[key], rel=1e-5, abs=1e-7), key
    assert eager_grads.keys() == fused_grads.keys() and len(eager_grads) > 10
    worst = max(
        float((fused_grads[n] - g).norm() / g.norm().clamp(min=1e-12)) for n, g in eager_grads.items()
    )
    assert worst < 1e-4


def test_compiled_layers_compile_twice_whatever_the_micro_batches_hold(
    tiny_model_untied: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real run's micro-batches differ in length and in how many sequences they pack: the layers compile for the
    first shape, once more with dynamic shapes, and never again (a guard on the number of sequences recompiled them
    for every new count until the cache limit, then ran them eager)."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(tdist, "_device", torch.device("cpu"))
    cfg = ShardRLConfig.model_validate(
        {"reward": {"function": "max_digit"}, "trainer": {"max_tokens_per_microbatch": 64}}
    )
    actor = _actor(tiny_model_untied)
    compile_layers(decoder_layers(actor.lm.base_model))
    opt = build_optimizer(actor, lr=1e-5)
    models = Models(actor, opt, build_scheduler(opt, warmup_steps=0, schedule="constant", total_steps=8))
    vocab = actor.config.vocab_size
    # two steps to settle (the second length turns the shapes dynamic), then packs of 1 to 8 sequences
    batches = [[(4, 20), (5, 20), (3, 20)], [(2, 9), (3, 7)]]
    batches += [[(2 + i % 3, 3 + (5 * i + k) % 11) for i in range(k)] for k in (1, 5, 8, 3, 6)]
    graphs = []
    for i, shapes in enumerate(batches):
        train_step(cfg, models, _samples(vocab, seed=i, shapes=shapes), pad_id=0)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[2:] == [graphs[1]] * (len(batches) - 2), graphs


def test_phases_are_exclusive_and_keyed_by_path(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter(range(100))
    monkeypatch.setattr("trainer.phases.time.perf_counter", lambda: float(next(clock)))
    syncs: list[int] = []
    with phase("outside"):  # no timer: nothing is charged
        pass
    with timing(lambda: syncs.append(1)) as timer:  # the clock: 0 at the first enter
        with phase("forward"):  # 0
            with phase("decoder"):  # 1
                pass  # 2
            with phase("head"):  # 3
                pass  # 4
        # forward exits at 5
        with phase("backward"):  # 6
            pass  # 7
    assert isinstance(timer, PhaseTimer)
    assert timer.seconds == {"forward": 3.0, "forward/decoder": 1.0, "forward/head": 1.0, "backward": 1.0}
    assert len(syncs) == 8  # every boundary waits for the device
    with pytest.raises(RuntimeError, match="already active"), timing(lambda: None), timing(lambda: None):
        pass
