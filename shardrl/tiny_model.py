"""The built-in tiny model: a randomly initialised Qwen2-architecture causal LM and a small byte-level BPE tokenizer.

Tests and the CPU demo need a model that both transformers and vLLM load, that the trainer can shard and publish, and
that is small enough to train on a laptop; it is built locally from a config, never downloaded.  The tokenizer is
trained on a small built-in corpus that includes the demo tasks' text, and every digit is its own token, so that
``max(3,9)=`` is seven tokens and a one-digit answer is one token.

Built by ``shardrl init`` when the config asks for ``tiny`` / ``tiny-tied``, by ``shardrl tiny-model OUT [--tied]``,
and by the tests' session fixtures.  Importing this module imports nothing heavy; the builder imports torch,
transformers and tokenizers.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any, cast

from buffer.fsio import chmod_file, fsync_dir, modes, tmp_name

# Shape: vLLM's CPU attention kernel needs head_dim >= 32, so 4 heads x 32 on a hidden size of 128.
HIDDEN = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 384
MAX_POSITIONS = 512
TARGET_VOCAB = 384
# Wider than the usual 0.02 so that a fresh model's next-token distributions are far from uniform: a logprob check
# against a near-uniform model cannot tell a right position or weight from a wrong one.
INIT_STD = 0.2

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]

# Tools are named with their parameters in a system turn, ``Tools: lookup(code)``: the tiny model's positions hold
# no JSON schemas.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}("
    "{{ t['function']['parameters']['properties'] | join(',') }}){% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_PROSE = """\
The answer is a single digit. Write the answer and stop.
What is the largest digit in the list? The largest digit is the answer.
Add the two numbers and keep the last digit: that is the sum modulo ten.
A question is followed by an answer. The model reads the prompt and writes a response.
Each step of training reads samples from the buffer, computes the advantage of every response in its group,
and updates the policy with a clipped objective. Rewards are one for a correct answer and zero otherwise.
The rollout workers generate text with the latest weights they can find on shared storage.
The trainer publishes new weights, and the workers load them without restarting their engines.
Question: which number is the maximum? Answer: the maximum is the greatest number of the list.
Let us think step by step. First compare the first two numbers, then compare the result with the next one.
"""


def corpus(seed: int = 0) -> list[str]:
    """Text the tokenizer is trained on: the demo tasks in several spellings, a chat frame and some prose."""
    rng = random.Random(seed)
    lines = _PROSE.splitlines()
    for a in range(10):
        for b in range(10):
            lines.append(f"max({a},{b})={max(a, b)}")
            lines.append(f"{a}+{b}={(a + b) % 10}")
            lines.append(f"({a}+{b})%10={(a + b) % 10}")
            lines.append(f"{a} + {b} = {a + b}")
    for _ in range(200):
        digits = [rng.randrange(10) for _ in range(rng.randint(2, 6))]
        lines.append(f"max({','.join(map(str, digits))})={max(digits)}")
        lines.append(
            f"Question: what is the largest digit in {' '.join(map(str, digits))}? Answer: {max(digits)}"
        )
    for a, b in [(3, 9), (7, 2), (5, 5), (0, 8), (4, 1), (6, 3)]:
        lines.append(f"{IM_START}system\nYou are a helpful assistant.{IM_END}\n")
        lines.append(f"{IM_START}user\nmax({a},{b})={IM_END}\n{IM_START}assistant\n{max(a, b)}{IM_END}\n")
    return lines


def _train_tokenizer(vocab_size: int):  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # Digits and punctuation are split off before byte-level BPE, so no merge can ever join two digits or glue
    # `)=` together: numbers are read digit by digit and every demo answer is exactly one token.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Punctuation(behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def _as_qwen2_tokenizer(tok):  # tokenizers.Tokenizer -> transformers.Qwen2Tokenizer
    """The trained vocabulary and merges inside transformers' own Qwen2 tokenizer pipeline.

    ``AutoTokenizer`` (and so vLLM) always rebuilds a ``qwen2`` model's tokenizer from vocab and merges with Qwen's
    pre-tokenizer, ignoring the one in tokenizer.json; saving through that same class keeps the file and every loader
    in agreement.  Qwen's split also isolates single digits, and the merges were learned on finer pieces (punctuation
    isolated), so no merge can glue two digits or two punctuation marks at run time either.
    """
    import json

    from transformers import Qwen2Tokenizer

    model = json.loads(tok.to_str())["model"]
    merges: Any = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=merges,
        eos_token=EOS,
        pad_token=EOS,
        extra_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITIONS,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(
    out: Path,
    *,
    tied: bool = False,
    seed: int = 0,
    init_std: float = INIT_STD,
    shape: dict[str, int] | None = None,
) -> Path:
    """Build the tiny model and tokenizer into ``out`` (HF format, float32) and return ``out``.

    ``shape`` replaces the decoder's size (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads``, ``intermediate_size``, ``max_position_embeddings``) while the tokenizer, and so the vocabulary, stays the tiny one:
    a model of a published model's compute with the built-in tasks' tokens, for benchmarks that run the demo task.

    Deterministic: the same ``seed`` and ``tied`` give the same files.  The directory appears complete or not at all
    (built beside it, then renamed); an existing non-empty ``out`` is an error.  ``init_std`` is the initializer
    range: the wide default suits tests; training from scratch (the demo) learns better from the usual 0.02.
    """
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: tiny model directory already exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)

    tok = _train_tokenizer(TARGET_VOCAB)
    eos_id = tok.token_to_id(EOS)
    im_end_id = tok.token_to_id(IM_END)
    size: dict[str, Any] = dict(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
    )
    if shape is not None:
        unknown = set(shape) - set(size)
        if unknown:
            raise ValueError(f"tiny model shape: unknown key(s) {sorted(unknown)}; accepted: {sorted(size)}")
        size |= shape
    config = Qwen2Config(
        vocab_size=tok.get_vocab_size(),
        **size,
        initializer_range=init_std,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=tied,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = cast(Any, Qwen2ForCausalLM(config))
        model.to(torch.float32)
    # A chat turn ends with <|im_end|>; plain completions end with <|endoftext|>.  Both stop generation.
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=[eos_id, im_end_id], pad_token_id=eos_id
    )

    hf_tok = _as_qwen2_tokenizer(tok)

    tmp = tmp_name(out)
    try:
        model.save_pretrained(tmp)
        hf_tok.save_pretrained(tmp)
        for f in tmp.iterdir():
            _seal(f)
        os.chmod(tmp, modes().dir)
        fsync_dir(tmp)
        if out.exists():
            out.rmdir()  # empty (checked above); rename cannot replace a directory on every platform
        os.rename(tmp, out)
        fsync_dir(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def pretraining_task(task: str) -> str:
    """What ``model.tiny_pretrain_steps`` pretrains on for a run of ``task``: the other digit task, or, for the tool
    task, its call format (``pretrain(..., "lookup", ...)``)."""
    return {"max_digit": "mod_add", "mod_add": "max_digit"}.get(task, task)


PROGRESS_S = 5.0  # a pretraining progress line at most this often


class _Progress:
    """One stderr line every PROGRESS_S while the base pretrains (the demo's first minutes show nothing else)."""

    def __init__(self, task: str, steps: int, show: bool):
        self.task, self.steps, self.show = task, steps, show
        self.start = self.last = time.monotonic()

    def __call__(self, step: int, loss: float) -> None:
        now = time.monotonic()
        if self.show and (now - self.last >= PROGRESS_S or step == self.steps):
            self.last = now
            print(
                f"pretraining the tiny base on {self.task}: step {step}/{self.steps}, loss {loss:.3f}, "
                f"{now - self.start:.0f} s",
                file=sys.stderr,
                flush=True,
            )


def pretrain(
    model_dir: Path, task: str, steps: int, *, seed: int = 0, lr: float = 3e-3, progress: bool = False
) -> None:
    """Train the tiny model in ``model_dir`` (in place) for ``steps`` supervised steps on the answers of the
    built-in ``task``: a base that has learnt to answer such prompts with a digit, as a pretrained model has seen
    related tasks.  A random tiny base does not know that format, and LoRA adapters on its frozen embeddings cannot
    teach it (``shardrl demo --lora`` pretrains on the task it does not train).  ``lookup`` teaches the tool task's
    format only (``_lookup_examples``).  Deterministic for a ``seed``.  ``progress``: a line on stderr every few
    seconds."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        report = _Progress(task, steps, progress)
        if task == "lookup":
            _pretrain_format(model, opt, tok, steps, seed, report)
        else:
            _pretrain_answers(model, opt, tok, task, steps, report)
    tmp = tmp_name(model_dir)
    try:
        model.save_pretrained(tmp)
        for f in tmp.iterdir():
            _seal(f)
            os.replace(f, model_dir / f.name)
        fsync_dir(model_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _pretrain_answers(model: Any, opt: Any, tok: Any, task: str, steps: int, report: _Progress) -> None:
    """Full-batch steps on the one-token answers of a digit task's prompts."""
    import torch

    from rollout_worker.tasks import task_prompts

    examples = task_prompts(task)
    prompts = [tok(t.prompt)["input_ids"] for t in examples]
    if len({len(p) for p in prompts}) != 1:
        raise ValueError(f"{task}: prompts of unequal length; pretraining expects one length")
    answers = torch.tensor([tok(t.answer)["input_ids"][0] for t in examples])
    ids = torch.tensor(prompts)
    for step in range(1, steps + 1):
        loss = torch.nn.functional.cross_entropy(model(ids).logits[:, -1], answers)
        opt.zero_grad()
        loss.backward()
        opt.step()
        report(step, float(loss.detach()))


# Examples per step of the tool task's format pretraining, each with a fresh code and a fresh random answer.
FORMAT_BATCH = 16


def _pretrain_format(model: Any, opt: Any, tok: Any, steps: int, seed: int, report: _Progress) -> None:
    """Steps on whole episodes of the lookup task, the loss on the model's own turns only."""
    import torch

    from rollout_worker.tasks import LOOKUP_CODES, lookup_codes

    rng = random.Random(seed)
    held_out = set(lookup_codes("eval"))
    codes = [c for c in LOOKUP_CODES if c not in held_out]
    pad = int(tok.pad_token_id)
    for step in range(1, steps + 1):
        examples = _lookup_examples(tok, rng.sample(codes, FORMAT_BATCH), rng)
        width = max(len(ids) for ids, _ in examples)
        ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in examples])
        labels = torch.tensor([la + [-100] * (width - len(la)) for _, la in examples])
        mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in examples])
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        report(step, float(loss.detach()))


def _lookup_examples(tok: Any, codes: list[int], rng: random.Random) -> list[tuple[list[int], list[int]]]:
    """Lookup episodes of ``codes`` as the rollout worker renders them (ids) and what is learnt of them (labels,
    -100 elsewhere): the call with the prompt's code copied into it, then the reply to the tool's result: ``none``
    to ``unknown`` (a code the table has no entry for), else a *random* digit.

    So the base knows how to call the tool, and looks at its result to tell a value from ``unknown``, but its
    answers are independent of the value: it starts at chance, and reading the value is what RL has to learn.
    """
    from rollout_worker.envs.episode import ChatRenderer
    from rollout_worker.envs.tools import resolve_tools
    from rollout_worker.tasks import (
        LOOKUP_NONE,
        LOOKUP_UNKNOWN,
        TOOL_TASKS,
        lookup,
        lookup_call,
        lookup_prompt,
    )

    renderer = ChatRenderer(tok)
    tools = resolve_tools([TOOL_TASKS["lookup"]])
    out = []
    for code in codes:
        user = {"role": "user", "content": lookup_prompt(code)}
        prompt = renderer.encode(renderer.render([user], tools, generation_prompt=True))
        call = renderer.encode(lookup_call(code) + IM_END)
        history = [user, {"role": "assistant", "content": lookup_call(code)}]
        value = lookup(code)
        env = renderer.env_turn(history, [{"role": "tool", "name": "lookup", "content": value}], tools, call)
        reply = LOOKUP_NONE if value == LOOKUP_UNKNOWN else str(rng.randrange(10))
        answer = renderer.encode(reply + IM_END)
        out.append((prompt + call + env + answer, [-100] * len(prompt) + call + [-100] * len(env) + answer))
    return out


def _seal(path: Path) -> None:
    """Give a file the run's mode and make it durable (transformers writes model.safetensors 0600: unreadable to
    the run's group)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        chmod_file(fd)
        os.fsync(fd)
    finally:
        os.close(fd)
