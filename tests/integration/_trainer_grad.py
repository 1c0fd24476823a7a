"""The gradient of the trainer's first step, dumped in full: run under torchrun (or as one process) on a run dir.

    python -m torch.distributed.run --nproc_per_node=2 tests/integration/_trainer_grad.py RUN OUT.safetensors

Builds the models, claims the run and plans step 1 exactly as ``python -m trainer`` does (``trainer.loop``), then
runs the real ``trainer.step.train_step`` with a gradient hook that gathers every parameter's full gradient (actor
and, for PPO, critic) after the backward and before clipping, of the step's last update (so that with several
updates the later ones, which see moved weights and the proximal ratio, are compared); rank 0 writes them as
``actor/NAME`` / ``critic/NAME``.  The parameters at the first update are written too (``param/...``) to show that
both runs started from the same weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from buffer.run import open_run
from trainer import dist as tdist
from trainer import loop
from trainer.__main__ import leave
from trainer.step import Models, train_step


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def main() -> None:
    from safetensors.torch import save_file

    run_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    run = open_run(run_dir)
    tdist.init("cpu")
    torch.manual_seed(run.config.run.seed)
    plan_log, epoch = loop.claim(run)
    models = loop.build_models(run)
    state = loop.resume(run, models, epoch)
    feeder = loop.Feeder(run, state.step, plan_log, loop.StopFlag())
    batch = feeder.next(1, state.version, waiting=lambda what: None, idle=lambda: None)
    feeder.close()
    assert batch is not None
    dumped: dict[str, torch.Tensor] = {}

    def hook(m: Models) -> None:
        first = not dumped
        for part, model in (("actor", m.actor), ("critic", m.critic)):
            for name, p in model.named_parameters() if model is not None else []:
                if first:
                    dumped[f"param/{part}/{name}"] = full(p)
                if p.grad is not None:
                    dumped[f"{part}/{name}"] = full(p.grad)

    pad_id = int(getattr(models.actor.config, "pad_token_id", None) or 0)
    metrics = train_step(run.config, models, batch.samples, pad_id, grad_hook=hook)
    if tdist.is_main():
        save_file(dumped, str(out), metadata={"loss_metrics": repr(sorted(metrics.items()))})
    tdist.teardown()
    leave(0)  # a finished rank skips the interpreter's finalization, as the trainer does


if __name__ == "__main__":
    main()
