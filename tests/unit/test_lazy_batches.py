"""Micro-batches built when the step first asks for each (``trainer.step.LazyBatches``).

What must hold: planning a step's micro-batches builds no tensor; a GRPO update without a reference pass builds
micro-batch i+1 only after micro-batch i's backward has been launched (so on a GPU the host builds it while the device
runs that backward); a step that needs every micro-batch before its first update (a reference pass, a critic's
targets) builds each once; and the laziness changes no number: a step gives the metrics and gradients of the same step
on eagerly built micro-batches.  What the overlap buys on a GPU is in the ``batches`` and ``forward`` rows of
``bench/trainer.py --profile``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from buffer.config import ShardRLConfig
from tests.unit.test_packing import _assert_grads_close, _grads, _models, _samples
from trainer import dist as tdist
from trainer import step
from trainer.batching import batch_to, collate, microbatches
from trainer.step import Models, train_step

GRPO = {"name": "grpo", "entropy_coef": 0.01, "off_policy": "none"}
PPO = {"name": "ppo", "kl_coef": 0.05, "whiten_advantages": True}


def _cfg(algorithm: dict[str, Any]) -> ShardRLConfig:
    return ShardRLConfig.model_validate(
        {
            "reward": {"function": "max_digit"},
            "algorithm": algorithm,
            # small micro-batches: the samples of `_samples` make several
            "trainer": {"packing": True, "max_tokens_per_microbatch": 64},
        }
    )


def _grpo_models(model_dir: Path, cfg: ShardRLConfig) -> Models:
    models = _models(model_dir, cfg)
    models.reference = None
    models.critic = models.critic_optimizer = models.critic_scheduler = None
    return models


@pytest.fixture(autouse=True)
def _cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tdist, "_device", torch.device("cpu"))


def test_planning_builds_nothing_and_indexing_builds_each_micro_batch_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = _cfg(GRPO)
    samples = _samples(300, seed=1)
    built: list[int] = []
    real = step._microbatch_of

    def counting(*args: Any) -> dict[str, torch.Tensor]:
        built.append(args[-1])
        return real(*args)

    monkeypatch.setattr(step, "_microbatch_of", counting)
    (mini,) = step.minibatches(cfg, samples, pad_id=0)
    n = len(mini.batches)
    assert n >= 3 and built == []
    last = mini.batches[-1]
    assert mini.batches[n - 1] is last and mini.batches[1:][-1] is last
    assert built == [n - 1, *range(1, n - 1)]
    # each is what collating that micro-batch and sending it to the device gives
    for b, mb in zip(mini.batches, microbatches(samples, 64, packed=True), strict=True):
        want = batch_to(collate(mb, 0, packed=True), torch.device("cpu"))
        assert b.keys() == want.keys()
        for k in want:
            assert torch.equal(b[k], want[k]), k
    assert sorted(built) == list(range(n)) and mini.batches.built() == n  # type: ignore[attr-defined]


def test_a_grpo_update_builds_the_next_micro_batch_after_launching_this_ones_backward(
    tiny_model_untied: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _cfg(GRPO)
    models = _grpo_models(tiny_model_untied, cfg)
    events: list[str] = []
    build, loss_of = step._microbatch_of, step._microbatch_loss

    def building(*args: Any) -> dict[str, torch.Tensor]:
        events.append(f"build {args[-1]}")
        return build(*args)

    def losing(*args: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, m = loss_of(*args)
        i = len([e for e in events if e.startswith("loss")])
        events.append(f"loss {i}")
        loss.register_hook(lambda g: events.append(f"backward {i}"))
        return loss, m

    monkeypatch.setattr(step, "_microbatch_of", building)
    monkeypatch.setattr(step, "_microbatch_loss", losing)
    train_step(cfg, models, _samples(models.actor.config.vocab_size, seed=2), pad_id=0)
    n = len([e for e in events if e.startswith("build")])
    assert n >= 3
    assert events == [e for i in range(n) for e in (f"build {i}", f"loss {i}", f"backward {i}")]


@pytest.mark.parametrize("algorithm", [GRPO, PPO], ids=["grpo", "ppo-reference-critic-whitened"])
def test_lazy_micro_batches_give_the_step_of_eager_ones(
    algorithm: dict[str, Any], tiny_model_untied: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _cfg(algorithm)
    results = []
    for eager in (True, False):
        models = (
            _grpo_models(tiny_model_untied, cfg) if algorithm is GRPO else _models(tiny_model_untied, cfg)
        )
        plan = step.minibatches
        if eager:  # every micro-batch built before the step starts, as before the laziness

            def built_up_front(*args: Any, _plan: Any = plan) -> list[step.MiniBatch]:
                minis = _plan(*args)
                return [step.MiniBatch(m.samples, list(m.batches), m.tokens, m.counts) for m in minis]

            monkeypatch.setattr(step, "minibatches", built_up_front)
        grads: list[dict[str, torch.Tensor]] = []
        metrics = train_step(
            cfg,
            models,
            _samples(models.actor.config.vocab_size, seed=3),
            pad_id=0,
            grad_hook=lambda m, out=grads: out.append(_grads(m.actor)),
        )
        monkeypatch.setattr(step, "minibatches", plan)
        results.append((metrics, grads[0]))
    (m_eager, g_eager), (m_lazy, g_lazy) = results
    assert m_eager.keys() == m_lazy.keys() and m_eager["grad_norm"] > 1e-4
    for k in m_eager:
        assert m_lazy[k] == pytest.approx(m_eager[k], rel=1e-6, abs=1e-7), k
    _assert_grads_close(g_lazy, g_eager)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")
def test_on_cuda_a_micro_batchs_copies_do_not_wait_for_the_work_already_launched() -> None:
    """The copies queue behind the device's work: after ``batch_to`` returns, a second of matrix products launched
    before it is still running (a copy from pageable memory would have waited for all of it), and the tensors that
    arrive are the host's.  A first call fills torch's pinned-memory cache, as a run's first step does: allocating
    pinned memory is not what is under test."""
    samples = _samples(1000, seed=5)
    host = collate(samples, 0, packed=True)
    batch_to(host, torch.device("cuda"))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    for _ in range(400):  # ~0.4 PFLOP: about a second of an H100's bf16 products
        a = (a @ a).clamp_(-1, 1)
    b = batch_to(host, torch.device("cuda"))
    assert not torch.cuda.current_stream().query(), "the copy waited for the launched work"
    torch.cuda.synchronize()
    for k, v in host.items():
        assert b[k].device.type == ("cpu" if k == "packed_lens" else "cuda"), k
        assert torch.equal(b[k].cpu(), v), k
