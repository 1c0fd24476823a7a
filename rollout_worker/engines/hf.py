"""Generation with plain transformers: the fallback engine where vLLM is not installed (the lent GPU machines).

A hand-written sampling loop over a KV cache rather than ``model.generate``: the loop computes each sampled token's
logprob under exactly the distribution it was drawn from (temperature, then top-k, then top-p, then log-softmax, in
vLLM's order and with vLLM's tie and boundary rules), which is what PPO's behaviour logprobs must be.  Prompts are
left-padded into one batch with explicit position ids.  Hot reload copies safetensors into the live parameters.

With LoRA (``lora_rank`` > 0) peft injects the adapter's layers into the model in place (``PeftModel`` is kept aside
as ``self.peft`` for managing adapters; ``self.model`` stays the HF model, now with LoRA layers), and each new version
is loaded as a new named adapter, made active, and the previous one deleted: the base weights never move.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from rollout_worker.engines.base import (
    ADAPTER_CONFIG,
    Completion,
    EngineError,
    SamplingSpec,
    check_prompts,
    engine_base_hash,
    plan_load,
    require_model_dir,
    safetensors_files,
)
from rollout_worker.engines.ragged_attention import sdpa_backends
from rollout_worker.engines.spec import EngineSpec

if TYPE_CHECKING:
    import torch

_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
}


def process_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Logits of the sampling distribution: ``[B, V]`` float32 -> ``[B, V]`` with removed tokens at -inf.

    Greedy (temperature 0) leaves the logits untouched: a greedy token's logprob is reported under the unscaled
    distribution, as vLLM does.
    """
    import torch

    if temperature <= 0:
        return logits
    logits = logits / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        # Every token tied with the k-th largest logit stays in (vLLM keeps ties too).
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1)  # ascending
        tail_mass = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop the smallest tokens whose cumulative mass stays within 1 - p; the largest token always stays.
        drop = tail_mass <= 1.0 - top_p
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits


class HFEngine:
    """The ``Engine`` interface on a transformers causal LM, on the GPU when one is visible, else the CPU."""

    def __init__(self, spec: EngineSpec) -> None:
        model_dir, dtype, seed, max_model_len = spec.model_dir, spec.dtype, spec.seed, spec.max_model_len
        device, max_batch_size, lora_rank = spec.device, spec.max_batch_size, spec.lora_rank
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_dir = require_model_dir(Path(model_dir))
        if dtype not in _DTYPES:
            raise EngineError(f"hf engine: dtype {dtype!r} is not one of {sorted(_DTYPES)}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.max_model_len = max_model_len
        self.max_batch_size = max_batch_size
        self.lora_rank = lora_rank
        self.base_sha256 = engine_base_hash(self.model_dir, lora_rank)
        self.peft: Any = None  # peft's PeftModel around self.model once an adapter is loaded
        self.adapter: str | None = None  # the active adapter's name
        self._adapter_config: dict[str, Any] = {}  # and its adapter_config.json
        self._adapters = 0
        self._rng = random.Random(seed)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        # Any: transformers' typing of PreTrainedModel.to confuses the checker
        self.model: Any = cast(
            Any, AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=getattr(torch, _DTYPES[dtype]))
        )
        self.model.to(self.device).eval()
        self.model.requires_grad_(False)
        self.eos_ids = self._eos_ids()
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else min(self.eos_ids)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.model.generation_config.eos_token_id, self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source is not None:
                ids.update(int(i) for i in source)
        if not ids:
            raise EngineError(
                f"{self.model_dir}: neither generation_config.json nor the tokenizer names an EOS token"
            )
        return ids

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[list[Completion]]:
        import torch
        from torch.nn.attention import sdpa_kernel

        check_prompts(prompt_ids, sampling, self.max_model_len)
        seed = sampling.seed if sampling.seed is not None else self._rng.getrandbits(62)
        generator = torch.Generator(device=self.device).manual_seed(seed)
        rows = [list(p) for p in prompt_ids for _ in range(sampling.n)]
        each = sampling.max_tokens_each or [sampling.max_tokens] * len(rows)
        done: list[Completion] = []
        # Prompts of different lengths mean a padding mask, for which PyTorch would pick cuDNN's attention: it plans
        # its kernel on the host for every new shape, and the cache grows a column a step (ragged_attention.py).
        with torch.inference_mode(), sdpa_kernel(sdpa_backends()):
            for start in range(0, len(rows), self.max_batch_size):
                end = start + self.max_batch_size
                done.extend(self._generate_batch(rows[start:end], sampling, generator, each[start:end]))
        return [done[i * sampling.n : (i + 1) * sampling.n] for i in range(len(prompt_ids))]

    def _generate_batch(
        self, rows: list[list[int]], sampling: SamplingSpec, generator: torch.Generator, max_tokens: list[int]
    ) -> list[Completion]:
        import torch
        from transformers import DynamicCache

        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        budget = [min(m, self.max_model_len - len(r)) for m, r in zip(max_tokens, rows, strict=True)]
        out_ids: list[list[int]] = [[] for _ in rows]
        out_lps: list[list[float]] = [[] for _ in rows]
        finish: list[str | None] = [None] * len(rows)
        texts: list[str | None] = [None] * len(rows)

        cache = DynamicCache(config=self.model.config)
        logits = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            logits_to_keep=1,
        ).logits[:, -1, :]
        for _ in range(max(budget)):
            token, logprob = self._sample(logits.float(), sampling, generator)
            token_list, logprob_list = token.tolist(), logprob.tolist()
            for i in range(len(rows)):
                if finish[i] is None:
                    out_ids[i].append(token_list[i])
                    out_lps[i].append(logprob_list[i])
                    finish[i], texts[i] = self._finished(
                        out_ids[i], budget[i], sampling.stop, sampling.ignore_eos
                    )
            if all(f is not None for f in finish):
                break
            mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=-1)
            positions = positions[:, -1:] + 1
            logits = self.model(
                input_ids=token[:, None], attention_mask=mask, position_ids=positions, past_key_values=cache
            ).logits[:, -1, :]
        return [
            Completion(
                prompt_ids=row,
                response_ids=ids,
                response_logprobs=lps,
                finish_reason=reason or "length",
                response_text=self._decode(ids) if text is None else text,
            )
            for row, ids, lps, reason, text in zip(rows, out_ids, out_lps, finish, texts, strict=True)
        ]

    def _sample(
        self, logits: torch.Tensor, sampling: SamplingSpec, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, V]`` float32 logits -> sampled tokens ``[B]`` and their logprobs ``[B]`` under the used distribution."""
        import torch

        logprobs = process_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p).log_softmax(
            dim=-1
        )
        if sampling.temperature <= 0:
            token = logits.argmax(dim=-1)
        else:
            token = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)
        return token, logprobs.gather(-1, token[:, None]).squeeze(-1)

    def _finished(
        self, ids: list[int], budget: int, stop: list[str], ignore_eos: bool = False
    ) -> tuple[str | None, str | None]:
        """(finish reason, text cut before a stop string) once a response is complete, else (None, None)."""
        if not ignore_eos and ids[-1] in self.eos_ids:
            return "stop", None
        if stop:
            text = self._decode(ids)
            hits = [i for i in (text.find(s) for s in stop) if i >= 0]
            if hits:
                return "stop", text[: min(hits)]
        if len(ids) >= budget:
            return "length", None
        return None, None

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def load_weights(self, weights_dir: Path) -> None:
        """Copy every tensor of ``weights_dir/*.safetensors`` into the live parameters (with LoRA: apply the
        version's adapter, ``_load_adapter``).

        All names and shapes are checked before anything is copied, so a bad directory leaves the old weights whole.
        A tied model's directory carries no ``lm_head.weight``: the embedding it shares is loaded instead.
        """
        import torch

        plan = plan_load(
            Path(weights_dir), lora_rank=self.lora_rank, base_sha256=self.base_sha256, base_dir=self.model_dir
        )
        if plan.what == "adapter":
            self._load_adapter(plan.path)
            return
        state = self.read_weights(plan.path)  # a delta version's rebuilt copy
        with torch.no_grad():
            self.model.load_state_dict(state, strict=False)

    def read_weights(self, weights_dir: Path) -> dict[str, Any]:
        """The full weights of ``weights_dir`` on the engine's device, checked against the live model (names and
        shapes): EngineError, nothing loaded, when they do not fit."""
        from safetensors.torch import load_file

        state: dict[str, Any] = {}
        for f in safetensors_files(weights_dir):
            state.update(load_file(f, device=str(self.device)))
        live = self.model.state_dict()
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        missing = sorted(set(live) - set(state) - ({"lm_head.weight"} if tied else set()))
        unexpected = sorted(set(state) - set(live))
        wrong = sorted(k for k in set(state) & set(live) if tuple(state[k].shape) != tuple(live[k].shape))
        if missing or unexpected or wrong:
            raise EngineError(
                f"{weights_dir}: weights do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}, "
                f"wrong shape {wrong[:3]}"
            )
        return state

    def _load_adapter(self, adapter_dir: Path) -> None:
        """Serve the adapter in ``adapter_dir``: copied into the active adapter's tensors when it has the same
        config and tensors (every version of one run: no new modules), else loaded under a new name, made active,
        and the previous one deleted.

        ``plan_load`` has checked its config; a failure past that point may leave half-injected layers, so it is not
        an ``EngineError`` (which keeps the worker serving) but a crash, and the supervisor restarts a clean worker.
        """
        import json

        from peft import PeftModel

        config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
        if self.peft is not None and config == self._adapter_config and self._copy_adapter(adapter_dir):
            return
        self._adapters += 1
        name = f"v{self._adapters}"
        if self.peft is None:
            self.peft = PeftModel.from_pretrained(self.model, str(adapter_dir), adapter_name=name)
            self.peft.eval()
        else:
            self.peft.load_adapter(str(adapter_dir), adapter_name=name)
        self.peft.set_adapter(name)
        self.model.requires_grad_(False)
        if self.adapter is not None:
            self.peft.delete_adapter(self.adapter)
        self.adapter, self._adapter_config = name, config

    def _copy_adapter(self, adapter_dir: Path) -> bool:
        """Copy the file's tensors into the active adapter in place; False (nothing copied) unless its names and
        shapes are exactly the active adapter's."""
        import torch
        from peft import get_peft_model_state_dict
        from safetensors.torch import load_file

        assert self.adapter is not None
        live = get_peft_model_state_dict(self.peft, adapter_name=self.adapter)  # views of the live tensors
        new = load_file(str(adapter_dir / "adapter_model.safetensors"), device=str(self.device))
        if live.keys() != new.keys() or any(live[k].shape != new[k].shape for k in live):
            return False
        with torch.no_grad():
            for k, t in new.items():
                live[k].copy_(t)
        return True

    def close(self) -> None:
        import torch

        self.__dict__.pop("model", None)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
