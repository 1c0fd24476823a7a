"""Trainer-side work for the FSDP integration tests, run under torchrun (or as one plain process).

    python -m torch.distributed.run --nproc_per_node=2 tests/integration/_fsdp_worker.py MODE ARGS...

Modes:
  publish OUT TIED_MODEL UNTIED_MODEL   train one step on each model, publish it, write references into OUT
  train-save RUN MODEL OUT TAG STEPS    train STEPS steps, checkpoint after each, dump the final state as OUT/TAG.*
  load-once OUT MODEL                   build the actor (plain and LoRA), the reference and a LoRA critic as the trainer
                                        does; write what each rank read from disk, and on rank 0 compare the gathered
                                        weights, buffers and logprobs with an unsharded load, into OUT/load-once.json
  prefetch OUT MODEL                    one forward and backward of a checkpointed actor per trainer.fsdp_prefetch
                                        setting (1, 2), profiled: FSDP2's prefetch ranges, the loss and the gradient
                                        norm of each, into OUT/prefetch.json
  resume RUN MODEL OUT TAG [STEPS]      load the newest complete checkpoint, dump it as OUT/TAG.*, then optionally
                                        train and checkpoint STEPS more steps, dump again as OUT/TAG-after.* and
                                        publish weight version 1 (float32) into RUN

A dump is ``TAG.safetensors`` (full parameters ``param/NAME`` and optimizer state ``optim/NAME/KEY``, gathered on
rank 0 through torch's own full-state-dict path, independent of trainer/publish.py) and ``TAG.json`` (learning
rate, scheduler epoch, extra state, and a draw from the RNG right after save/load).

Ranks run on the CPU with gloo unless SHARDRL_WORKER_DEVICE says otherwise (auto, cuda).  ``launch`` starts it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from buffer.layout import RunLayout
from tests.integration._common import free_port
from trainer import dist as tdist
from trainer.__main__ import leave
from trainer.checkpoint import latest_complete_checkpoint, load_checkpoint, save_checkpoint
from trainer.model import (
    build_actor,
    build_optimizer,
    build_scheduler,
    clip_grad_norm_,
    token_logprobs_and_entropy,
)
from trainer.publish import publish_weights

WORKER = Path(__file__).resolve()
REPO = WORKER.parents[2]
CHUNK = 5  # several chunks per micro-batch, so the chunked path is exercised under FSDP


def launch(args: list[str | Path], nproc: int, timeout_s: float = 600.0) -> float:
    """Run this worker with ``nproc`` ranks (torchrun), or as one plain process when ``nproc`` is 1; return the
    wall time.  A failure raises with the tail of the workers' output."""
    import time

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # a rank that dies in C++ (abort) leaves its Python and C++ stacks in the failure message
    env.update(PYTHONFAULTHANDLER="1", TORCH_SHOW_CPP_STACKTRACES="1")
    head = [sys.executable]
    if nproc > 1:
        head += ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]
    t0 = time.monotonic()
    proc = subprocess.run(
        [*head, str(WORKER), *map(str, args)], env=env, capture_output=True, text=True, timeout=timeout_s
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"worker {args[0]} x{nproc} exited with {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return time.monotonic() - t0


def batch(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    return ids, mask


def build(model_dir: str, device: torch.device, ac: bool = False):
    actor = build_actor(model_dir, device, param_dtype="float32", activation_checkpointing=ac)
    opt = build_optimizer(actor, lr=1e-3, weight_decay=0.01)
    sched = build_scheduler(opt, warmup_steps=2, schedule="cosine", total_steps=10)
    return actor, opt, sched


def train_step(actor, opt, sched, step: int, device: torch.device) -> None:
    # Each rank gets its own batch, as in training; FSDP averages the gradients.
    ids, mask = batch(actor.config.vocab_size, 1000 * step + tdist.rank())
    logp, ent = token_logprobs_and_entropy(actor, ids.to(device), attention_mask=mask.to(device), chunk=CHUNK)
    m = mask.to(device).float()
    loss = -(logp * m).sum() / m.sum() - 0.01 * (ent * m).sum() / m.sum()
    loss.backward()
    clip_grad_norm_(actor.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def full_state(actor, opt) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    out = {f"param/{k}": v.clone() for k, v in get_model_state_dict(actor, options=opts).items()}
    if opt is not None:
        osd = get_optimizer_state_dict(actor, opt, options=opts)
        for fqn, st in osd.get("state", {}).items():  # empty off rank 0
            for k, v in st.items():
                out[f"optim/{fqn}/{k}"] = torch.as_tensor(v).clone()
    return out


def dump(path: Path, actor, opt, sched, info: dict) -> None:
    from safetensors.torch import save_file

    tensors = full_state(actor, opt)  # collective
    if tdist.is_main():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path.with_suffix(".safetensors")))
        info = {**info, "lr": opt.param_groups[0]["lr"], "last_epoch": sched.last_epoch}
        path.with_suffix(".json").write_text(json.dumps(info))


def mode_publish(out: Path, tied_dir: str, untied_dir: str, device: torch.device) -> None:
    from safetensors.torch import save_file

    for tag, model_dir, tied in (("tied", tied_dir, True), ("untied", untied_dir, False)):
        actor, opt, sched = build(model_dir, device, ac=not tied)
        train_step(actor, opt, sched, 1, device)
        layout = RunLayout.of(out / f"run-{tag}")
        layout.create()
        publish_weights(actor, layout, 1, 1, dtype="float32", tied=tied, src_model_dir=Path(model_dir))
        publish_weights(actor, layout, 2, 1, dtype="bfloat16", tied=tied, src_model_dir=Path(model_dir))
        ids, mask = batch(actor.config.vocab_size, 7)
        with torch.no_grad():
            logp, ent = token_logprobs_and_entropy(
                actor, ids.to(device), attention_mask=mask.to(device), chunk=CHUNK
            )
        ref = {k.removeprefix("param/lm."): v for k, v in full_state(actor, None).items()}
        if tdist.is_main():
            save_file(ref, str(out / f"ref-{tag}.safetensors"))
            save_file(
                {"ids": ids, "mask": mask, "logp": logp.cpu(), "entropy": ent.cpu()},
                str(out / f"logp-{tag}.safetensors"),
            )


def mode_train_save(run: Path, model_dir: str, out: Path, tag: str, steps: int, device: torch.device) -> None:
    layout = RunLayout.of(run)
    layout.create()
    actor, opt, sched = build(model_dir, device)
    for step in range(1, steps + 1):
        train_step(actor, opt, sched, step, device)
        save_checkpoint(layout, step, actor, opt, sched, {"next_version": step + 1, "tag": tag}, keep=2)
    draw = torch.rand(4).tolist()
    dump(out / tag, actor, opt, sched, {"step": steps, "rand": draw})


def mode_resume(run: Path, model_dir: str, out: Path, tag: str, more: int, device: torch.device) -> None:
    layout = RunLayout.of(run)
    actor, opt, sched = build(model_dir, device)
    step = latest_complete_checkpoint(layout)
    assert step is not None, "no complete checkpoint"
    extra = load_checkpoint(layout, step, actor, opt, sched)
    draw = torch.rand(4).tolist()
    dump(out / tag, actor, opt, sched, {"step": step, "rand": draw, "extra": extra})
    if more:
        for s in range(step + 1, step + more + 1):
            train_step(actor, opt, sched, s, device)
            save_checkpoint(layout, s, actor, opt, sched, {"next_version": s + 1, "tag": tag}, keep=2)
        draw = torch.rand(4).tolist()
        dump(out / f"{tag}-after", actor, opt, sched, {"step": step + more, "rand": draw})
        publish_weights(
            actor,
            layout,
            1,
            step + more,
            dtype="float32",
            tied=actor.config.tie_word_embeddings,
            src_model_dir=Path(model_dir),
        )


def mode_load_once(out: Path, model_dir: str, device: torch.device) -> None:
    """Only rank 0 reads the weights; every rank ends with the weights, buffers and outputs of an unsharded load."""
    import transformers

    from buffer.config import AdapterConfig
    from trainer.model import build_critic, build_reference, load_causal_lm

    reads = 0
    original = transformers.AutoModelForCausalLM.from_pretrained

    def counting(*args, **kwargs):
        nonlocal reads
        reads += 1
        return original(*args, **kwargs)

    transformers.AutoModelForCausalLM.from_pretrained = counting  # type: ignore[method-assign]
    lora = AdapterConfig(rank=4, alpha=8.0)
    actor = build_actor(model_dir, device, param_dtype="float32", activation_checkpointing=True)
    lora_actor = build_actor(model_dir, device, param_dtype="float32", lora=lora)
    reference = build_reference(model_dir, device, param_dtype="float32")
    critic = build_critic(model_dir, device, param_dtype="float32", lora=lora)
    transformers.AutoModelForCausalLM.from_pretrained = original  # type: ignore[method-assign]

    ids, mask = batch(actor.config.vocab_size, 7)  # the same batch on every rank
    outputs = {
        tag: token_logprobs_and_entropy(m, ids.to(device), attention_mask=mask.to(device), chunk=CHUNK)[0]
        for tag, m in (("actor", actor), ("lora", lora_actor), ("reference", reference))
    }
    values = critic.values(ids.to(device), mask.to(device))
    states = {
        tag: full_state(m, None) for tag, m in (("actor", actor), ("lora", lora_actor), ("critic", critic))
    }
    buffers = {n: b.detach().cpu() for n, b in actor.named_buffers()}
    reads_by_rank = tdist.all_gather_object(reads)
    if not tdist.is_main():
        return
    plain = load_causal_lm(model_dir).eval()
    want = {f"param/lm.{k}": v for k, v in plain.state_dict().items()}
    with torch.no_grad():
        ref_logp = token_logprobs_and_entropy(plain, ids, attention_mask=mask, chunk=CHUNK)[0]

    def diff(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.detach().cpu().float() - b.float()).abs().max())

    def strip(k: str) -> str:
        return k.replace("_checkpoint_wrapped_module.", "").replace(".base_layer.", ".")

    lora_a = {k: v for k, v in states["lora"].items() if ".lora_A." in k}
    report = {
        "reads_by_rank": reads_by_rank,
        "actor_weights_max_diff": max(diff(states["actor"][k], v) for k, v in want.items()),
        "actor_missing": sorted(set(want) - set(states["actor"])),
        "lora_base_max_diff": max(
            diff(v, want[strip(k)]) for k, v in states["lora"].items() if strip(k) in want
        ),
        "lora_b_max_abs": max(float(v.abs().max()) for k, v in states["lora"].items() if ".lora_B." in k),
        # kaiming-uniform init: |a| <= 1/sqrt(fan_in) and std = bound / sqrt(3), in every row block of every rank
        "lora_a_rows": [
            [float(v.abs().max() * v.shape[1] ** 0.5), float(v[half].std() * (3 * v.shape[1]) ** 0.5)]
            for v in lora_a.values()
            for half in (slice(0, v.shape[0] // 2), slice(v.shape[0] // 2, None))
        ],
        "critic_base_max_diff": max(
            diff(v, want["param/lm.model." + strip(k)[len("param/base.") :]])
            for k, v in states["critic"].items()
            if k.startswith("param/base.") and ".lora_" not in k
        ),
        "critic_head_max_abs": max(
            float(v.abs().max()) for k, v in states["critic"].items() if "value_head" in k
        ),
        "buffers_max_diff": max(
            diff(b, dict(plain.named_buffers())[n[len("lm.") :]]) for n, b in buffers.items()
        ),
        "buffers": len(buffers),
        "logprob_max_diff": {tag: diff(v, ref_logp) for tag, v in outputs.items()},
        "values_max_abs": float(values.abs().max()),
    }
    (out / "load-once.json").write_text(json.dumps(report, indent=1))


def mode_prefetch(out: Path, model_dir: str, device: torch.device) -> None:
    from torch.profiler import profile

    report = {}
    for depth in (1, 2):
        actor = build_actor(
            model_dir, device, param_dtype="float32", activation_checkpointing=True, prefetch=depth
        )
        ids, mask = batch(actor.config.vocab_size, 7 + tdist.rank())
        with profile() as prof:
            logp, _ = token_logprobs_and_entropy(
                actor, ids.to(device), attention_mask=mask.to(device), chunk=CHUNK
            )
            loss = -(logp * mask.to(device)).sum()
            loss.backward()
        names = [e.name.split(" for ")[0] for e in prof.events()]
        report[str(depth)] = {
            "forward_prefetch": names.count("FSDP::forward_prefetch"),
            "backward_prefetch": names.count("FSDP::backward_prefetch"),
            "loss": float(loss),
            "grad_norm": float(clip_grad_norm_(actor.parameters(), 1e9)),
        }
    if tdist.is_main():
        (out / "prefetch.json").write_text(json.dumps(report, indent=1))


def main() -> None:
    mode, *args = sys.argv[1:]
    device = tdist.init(os.environ.get("SHARDRL_WORKER_DEVICE", "cpu"))  # type: ignore[arg-type]
    torch.manual_seed(1234 + tdist.rank())
    if mode == "publish":
        mode_publish(Path(args[0]), args[1], args[2], device)
    elif mode == "train-save":
        mode_train_save(Path(args[0]), args[1], Path(args[2]), args[3], int(args[4]), device)
    elif mode == "load-once":
        mode_load_once(Path(args[0]), args[1], device)
    elif mode == "prefetch":
        mode_prefetch(Path(args[0]), args[1], device)
    elif mode == "resume":
        more = int(args[4]) if len(args) > 4 else 0
        mode_resume(Path(args[0]), args[1], Path(args[2]), args[3], more, device)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    tdist.teardown()
    leave(0)  # a finished rank skips the interpreter's finalization, as the trainer does


if __name__ == "__main__":
    main()
