"""Trainer checkpoints: model + optimizer through DCP, everything else as JSON, complete once COMMITTED exists.

``layout.checkpoint(step)`` holds:

- DCP's files (``.metadata``, ``__R_0.distcp``...): for each part (``actor``, optionally ``critic``) the model and
  optimizer state from ``get_state_dict``, saved sharded by every rank.  DCP reshards on load, so a checkpoint saved
  at one world size loads at another.  Only what trains is saved: with LoRA the adapters (and the critic's value
  head) and their optimizer state, not the frozen base, which is reloaded from the base model.
- ``trainer_state.json`` (rank 0): step, world size, LR-scheduler states, the trainer's extra state (next weight
  version, counters...) and every rank's RNG states.  JSON, so resuming unpickles nothing but DCP's own files.
- ``COMMITTED`` (rank 0, written last, after a barrier): the commit record, with the sha256 of DCP's ``.metadata``.
  A directory without it is an interrupted save; it is ignored and deleted once a newer checkpoint is complete.
  Loading unpickles ``.metadata`` (DCP's format), so every rank checks that digest before DCP reads it.

All functions that take a model are collective: call them on every rank.
"""

from __future__ import annotations

import base64
import json
import random
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from buffer.fsio import read_json, read_json_or_none, write_json_atomic
from buffer.layout import RunLayout
from buffer.weights import sha256_file
from trainer import dist as tdist

TRAINER_STATE = "trainer_state.json"
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's pickled plan of the checkpoint

Models = nn.Module | Mapping[str, nn.Module]
Optimizers = torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer]
Schedulers = torch.optim.lr_scheduler.LRScheduler | Mapping[str, torch.optim.lr_scheduler.LRScheduler] | None


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not fit the model being resumed."""


class _ModelAndOptimizer(Stateful):
    """One model and its optimizer as DCP sees them (sharded state dicts with HF-like FQNs); a model with frozen
    parameters (a LoRA base) contributes only its trainable ones."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        # remove_duplicate=False: a tied LM head is a second name of the frozen embedding, and must go too
        self.frozen = {
            _plain(n) for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad
        }

    def _options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=bool(self.frozen), strict=not self.frozen)

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._options())
        if self.frozen:
            model_sd = {k: v for k, v in model_sd.items() if _plain(k) not in self.frozen}
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        result = set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
            options=self._options(),
        )
        # Not strict when the base is frozen (it is not in the checkpoint): every trainable key must still load.
        missing = [k for k in result.missing_keys if _plain(k) not in self.frozen]
        if missing or result.unexpected_keys:
            raise CheckpointError(
                f"checkpoint does not fit the model: missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}"
            )


_WRAPPERS = {"_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod"}


def _plain(name: str) -> str:
    """A parameter name without wrapper parts, as state-dict keys have it."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPERS)


def _parts(model: Models, optimizer: Optimizers, scheduler: Schedulers) -> dict[str, tuple[Any, Any, Any]]:
    """``{name: (model, optimizer, scheduler)}``; a single model is the part ``actor``."""
    if isinstance(model, nn.Module):
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(scheduler, Mapping):
            raise TypeError("a single model needs a single optimizer and scheduler")
        return {"actor": (model, optimizer, scheduler)}
    if not isinstance(optimizer, Mapping) or optimizer.keys() != model.keys():
        raise TypeError("models and optimizers must be mappings with the same keys")
    scheds = scheduler if isinstance(scheduler, Mapping) else {}
    return {k: (model[k], optimizer[k], scheds.get(k)) for k in sorted(model)}


# --------------------------------------------------------------------------------------------------------- RNG


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def rng_state() -> dict[str, Any]:
    """This process's RNG states (Python, NumPy, torch CPU and the current CUDA device) as JSON-able values."""
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()  # type: ignore[misc]
    state: dict[str, Any] = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_name, np.asarray(np_keys).tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = _b64(torch.cuda.get_rng_state())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_unb64(state["cuda"]))


# --------------------------------------------------------------------------------------------------- discovery


def _step_dirs(layout: RunLayout) -> dict[int, Path]:
    out: dict[int, Path] = {}
    if layout.checkpoints.is_dir():
        for p in layout.checkpoints.iterdir():
            name = p.name
            if name.startswith("step-") and name[5:].isdigit() and layout.checkpoint(int(name[5:])) == p:
                out[int(name[5:])] = p
    return out


def is_complete(layout: RunLayout, step: int) -> bool:
    record = read_json_or_none(layout.checkpoint_commit(step))
    return isinstance(record, dict) and record.get("step") == step


def complete_checkpoints(layout: RunLayout) -> list[int]:
    return sorted(s for s in _step_dirs(layout) if is_complete(layout, s))


def latest_complete_checkpoint(layout: RunLayout) -> int | None:
    """The newest step whose checkpoint has its commit record, or None."""
    done = complete_checkpoints(layout)
    return done[-1] if done else None


def _delete(layout: RunLayout, step: int) -> None:
    # The commit record goes first: a deletion cut short leaves an incomplete directory, never a "complete" one
    # with files missing.
    layout.checkpoint_commit(step).unlink(missing_ok=True)
    shutil.rmtree(layout.checkpoint(step), ignore_errors=True)


def prune_checkpoints(layout: RunLayout, keep: int) -> list[int]:
    """Keep the newest ``keep`` complete checkpoints; delete older ones and incomplete ones older than the newest
    complete one (interrupted saves).  Returns the deleted steps.  Not collective: rank 0 calls it."""
    done = complete_checkpoints(layout)
    if not done:
        return []
    doomed = set(done[:-keep] if keep > 0 else done)
    doomed |= {s for s in _step_dirs(layout) if s < done[-1] and s not in done}
    for s in sorted(doomed):
        _delete(layout, s)
    return sorted(doomed)


# ------------------------------------------------------------------------------------------------- save / load


def save_checkpoint(
    layout: RunLayout,
    step: int,
    model: Models,
    optimizer: Optimizers,
    scheduler: Schedulers,
    extra: dict[str, Any],
    *,
    keep: int = 2,
) -> Path:
    """Save a complete checkpoint of ``step`` and prune old ones (collective).

    ``model``/``optimizer``/``scheduler`` are one each, or mappings by part name (``{"actor": ..., "critic": ...}``).
    ``extra`` must be JSON-serialisable; ``load_checkpoint`` returns it.
    """
    import torch.distributed.checkpoint as dcp

    parts = _parts(model, optimizer, scheduler)
    try:
        extra_json = json.loads(json.dumps(extra))
        scheds = {k: s.state_dict() for k, (_, _, s) in parts.items() if s is not None}
        json.dumps(scheds)
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint step {step}: extra/scheduler state is not JSON-serialisable: {e}"
        ) from None
    path = layout.checkpoint(step)
    # a re-save of the same step replaces it
    _on_main(lambda: _delete(layout, step) if path.exists() else None)
    dcp.save({k: _ModelAndOptimizer(m, o) for k, (m, o, _) in parts.items()}, checkpoint_id=str(path))
    rngs = tdist.all_gather_object(rng_state())
    state = {
        "step": step,
        "world_size": tdist.world(),
        "parts": sorted(parts),
        "schedulers": scheds,
        "extra": extra_json,
        "rng": rngs,
    }
    # every rank's DCP files are written before the commit record exists
    _on_main(lambda: write_json_atomic(path / TRAINER_STATE, state))

    def commit() -> None:
        record = {
            "step": step,
            "world_size": tdist.world(),
            "time": time.time(),
            "metadata_sha256": sha256_file(path / DCP_METADATA),
        }
        write_json_atomic(layout.checkpoint_commit(step), record)
        prune_checkpoints(layout, keep)

    _on_main(commit)
    return path


def _on_main(fn: Callable[[], Any]) -> None:
    """``fn()`` on rank 0, then a barrier that also shares its OSError (a full disk): raised on every rank as a
    CheckpointError, so that no rank waits for the others in a collective that never comes."""
    error = None
    if tdist.is_main():
        try:
            fn()
        except OSError as e:
            error = str(e)
    error = tdist.broadcast_object(error)
    if error is not None:
        raise CheckpointError(error)


def verify_metadata(layout: RunLayout, step: int) -> None:
    """Refuse to let DCP unpickle a ``.metadata`` that is not the one saved (its sha256 in COMMITTED)."""
    meta = layout.checkpoint(step) / DCP_METADATA
    record = read_json_or_none(layout.checkpoint_commit(step))
    expected = record.get("metadata_sha256") if isinstance(record, dict) else None
    if not isinstance(expected, str):
        raise CheckpointError(
            f"{layout.checkpoint_commit(step)}: no metadata_sha256; loading would unpickle {meta} unchecked"
        )
    try:
        actual = sha256_file(meta)
    except FileNotFoundError:
        raise CheckpointError(f"{meta}: missing from a committed checkpoint") from None
    if actual != expected:
        raise CheckpointError(
            f"{meta}: sha256 {actual[:12]}... is not COMMITTED's metadata_sha256 {expected[:12]}...; not unpickled"
        )


def load_checkpoint(
    layout: RunLayout,
    step: int,
    model: Models,
    optimizer: Optimizers,
    scheduler: Schedulers,
) -> dict[str, Any]:
    """Load the complete checkpoint of ``step`` into the given objects (collective); return its extra state.

    The world size may differ from the one that saved it.  Each rank restores the RNG states of the rank with its
    number when there was one; ranks beyond the saved world size keep theirs.
    """
    import torch.distributed.checkpoint as dcp

    path = layout.checkpoint(step)
    if not is_complete(layout, step):
        raise CheckpointError(f"{path}: not a complete checkpoint (no {layout.checkpoint_commit(step).name})")
    try:
        state = read_json(path / TRAINER_STATE)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path / TRAINER_STATE}: unreadable: {e}") from None
    parts = _parts(model, optimizer, scheduler)
    if sorted(parts) != state["parts"]:
        raise CheckpointError(f"{path}: holds parts {state['parts']}, but resuming {sorted(parts)}")
    verify_metadata(layout, step)
    dcp.load({k: _ModelAndOptimizer(m, o) for k, (m, o, _) in parts.items()}, checkpoint_id=str(path))
    for k, (_, _, sched) in parts.items():
        if sched is not None:
            if k not in state["schedulers"]:
                raise CheckpointError(f"{path / TRAINER_STATE}: no scheduler state for part {k!r}")
            sched.load_state_dict(state["schedulers"][k])
    if tdist.rank() < len(state["rng"]):
        set_rng_state(state["rng"][tdist.rank()])
    tdist.barrier()
    return dict(state["extra"])
