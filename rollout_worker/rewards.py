"""Reward functions by name, and the optional reward model, as the rollout worker scores samples.

``reward.function`` is a registered name (``math_answer``, ``exact_match``, ``max_digit``, ``mod_add``) or a user
function ``package.module:function`` with the signature ``(prompt: str, response: str, answer: str | None) -> float``.
An unknown name is one ``RewardConfigError`` line at start.  A function that raises or returns something that is not
a finite number for one sample fails its whole group (``RewardError``): the worker drops the group and counts it,
because dropping one sample of a GRPO group would shift the group's baseline.

``reward.reward_model`` (a HF sequence-classification directory with one output) adds its score of prompt + response,
times ``reward.reward_model_weight``; it runs on the worker's device.  Only that class imports torch, when built.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .tasks import digit_reward

RewardFn = Callable[[str, str, str | None], float]


class RewardConfigError(ValueError):
    """A user-caused reward configuration problem; the message is one line."""


class RewardError(RuntimeError):
    """Scoring a group failed: a function raised or returned a non-finite value."""


# ---------------------------------------------------------------------------------------------- math answers

_FRAC = r"\\[dt]?frac\{\s*(-?[\d.,]+)\s*\}\{\s*(-?[\d.,]+)\s*\}"
_NUM = r"-?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+(?:\.\d+)?)?"
_FINAL = re.compile(f"{_FRAC}|({_NUM})")


def last_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` (or ``\fbox{...}``), braces balanced; None when there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.index("{", start) if "{" in text[start:] else -1
    if i < 0 or text[start:i].strip() not in ("\\boxed", "\\fbox"):
        # `\boxed 5`: the content is the next whitespace-delimited token
        rest = text[start:].split(None, 2)
        return rest[1].rstrip("$.") if len(rest) > 1 else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None  # unbalanced: the response was cut off inside the box


def final_answer(text: str) -> str | None:
    r"""A response's final answer: the last ``\boxed{}``, else the last number (or ``\frac{a}{b}``) in the text."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    matches = list(_FINAL.finditer(text))
    if not matches:
        return None
    m = matches[-1]
    return f"{m.group(1)}/{m.group(2)}" if m.group(1) is not None else m.group(3)


def to_number(text: str) -> float | None:
    r"""``"1,234"``, ``"-3.5"``, ``"3/4"``, ``"\frac{3}{4}"``, ``"$12"``, ``"50%"`` -> a float; None when not a number."""
    s = text.strip().strip("$").replace("\\$", "").replace("\\!", "").replace("\\,", "").strip()
    s = s.removesuffix("\\%").removesuffix("%").rstrip(".").strip()
    m = re.fullmatch(_FRAC, s)
    if m:
        s = f"{m.group(1)}/{m.group(2)}"
    s = s.replace(" ", "")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    try:
        if "/" in s:
            num, den = s.split("/", 1)
            return float(num) / float(den)
        return float(s)
    except (ValueError, ZeroDivisionError):
        return None


def _normalize(s: str) -> str:
    return re.sub(r"\s+", "", s.strip().strip("$")).rstrip(".")


def math_answer(prompt: str, response: str, answer: str | None) -> float:
    r"""1.0 when the response's final answer (``\boxed{}`` or last number) equals ``answer`` numerically, else 0.0.

    ``answer`` may itself be a worked solution (GSM8K's ``... #### 72``, or one ending in ``\boxed{}``): its final
    answer is used.  A reference that is not a number is compared, whitespace removed, with the response's answer.
    """
    if answer is None:
        raise ValueError("math_answer needs an answer for every prompt (data.answer_field)")
    ref = answer.rsplit("####", 1)[-1]
    ref = last_boxed(ref) or ref
    got = final_answer(response)
    if got is None:
        return 0.0
    want = to_number(ref)
    if want is None:
        return 1.0 if _normalize(last_boxed(response) or got) == _normalize(ref) else 0.0
    value = to_number(got)
    if value is None:
        return 0.0
    return 1.0 if math.isclose(value, want, rel_tol=1e-6, abs_tol=1e-9) else 0.0


def exact_match(prompt: str, response: str, answer: str | None) -> float:
    """1.0 when the response equals the answer after stripping surrounding whitespace, else 0.0."""
    if answer is None:
        raise ValueError("exact_match needs an answer for every prompt (data.answer_field)")
    return 1.0 if response.strip() == answer.strip() else 0.0


def digit_task(prompt: str, response: str, answer: str | None) -> float:
    """The demo tasks (max_digit, mod_add): the first non-space character is the right digit."""
    if answer is None:
        raise ValueError("the digit tasks need an answer for every prompt")
    return digit_reward(response, answer)


REGISTRY: dict[str, RewardFn] = {
    "math_answer": math_answer,
    "exact_match": exact_match,
    "max_digit": digit_task,
    "mod_add": digit_task,
}


def needs_answers(name: str) -> bool:
    """Registered functions cannot score a prompt without an answer; user functions decide for themselves."""
    return name in REGISTRY


def resolve_reward(name: str) -> RewardFn:
    """The function named by ``reward.function``, or a one-line RewardConfigError."""
    if name in REGISTRY:
        return REGISTRY[name]
    accepted = f"accepted: {', '.join(REGISTRY)}, or a user function `package.module:function`"
    if ":" not in name:
        raise RewardConfigError(f"config: field reward.function: {name!r} is not a known reward; {accepted}")
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise RewardConfigError(
            f"config: field reward.function: cannot import {module_name!r} ({type(e).__name__}: {e}); {accepted}"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardConfigError(
            f"config: field reward.function: {module_name!r} has no function {attr!r}; {accepted}"
        )
    return fn  # type: ignore[no-any-return]


def score_group(fn: RewardFn, prompt: str, responses: list[str], answer: str | None) -> list[float]:
    """Rewards of one group (the n responses to one prompt); RewardError when any of them fails."""
    out = []
    for response in responses:
        try:
            value = float(fn(prompt, response, answer))
        except Exception as e:
            raise RewardError(f"reward function raised {type(e).__name__}: {e}") from e
        if not math.isfinite(value):
            raise RewardError(f"reward function returned {value} for {response!r:.60}")
        out.append(value)
    return out


# ---------------------------------------------------------------------------------------------- reward model


class RewardModel:
    """A HF sequence-classification model (one output) that scores prompt + response texts."""

    def __init__(self, path: str | Path, *, device: str | None = None, batch_size: int = 32):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = Path(path)
        if not (path / "config.json").is_file():
            raise RewardConfigError(
                f"{path}: reward.reward_model is not a HF model directory (no config.json)"
            )
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path).to(self.device).eval()
        if self.model.config.num_labels != 1:
            raise RewardConfigError(
                f"{path}: reward.reward_model must have one output (num_labels = 1), it has "
                f"{self.model.config.num_labels}"
            )
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.batch_size = batch_size

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        import torch

        texts = [p + r for p, r in zip(prompts, responses, strict=True)]
        out: list[float] = []
        with torch.inference_mode():
            for i in range(0, len(texts), self.batch_size):
                enc: Any = self.tokenizer(
                    texts[i : i + self.batch_size], return_tensors="pt", padding=True, truncation=True
                ).to(self.device)
                out.extend(self.model(**enc).logits[:, 0].float().tolist())
        return out
