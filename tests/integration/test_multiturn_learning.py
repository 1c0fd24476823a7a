"""The trainer learns from multi-turn shards alone, in seconds: the fast check beside the full tool-learning run
(`test_tool_learning.py`, minutes of real rollouts).

Each synthetic episode is a model turn (a call), an environment turn that holds one digit (the tool's answer), and
a one-token model turn, the answer; the reward is 1 when the answer repeats the environment's digit. The behaviour
logprobs are the base model's own, so version 0's samples are on-policy. Ten trainer steps (one real trainer
process) must raise the right answer's logprob after each environment turn, and its lead over the other digits: the
trainer read the answer through the environment's tokens (in its context, out of its loss).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from buffer.layout import RunLayout
from buffer.run import open_run
from buffer.shards import ShardWriter
from buffer.weights import latest_version

from ._trainer_helpers import command, make_run, metrics, run_ok, safetensors_dir, trainer_args

STEPS = 10
GROUP = 4
PER_STEP = 32
PROMPT, CALL = "Look the code up.", " lookup()"


def _tokens(model: Path) -> tuple[list[int], list[int], list[list[int]], list[int]]:
    """The prompt's and the call's ids, each digit's environment turn, and each digit's answer token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    ids = lambda text: list(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    envs = [ids(f"\nresult: {d}\n") for d in range(10)]
    answers: list[int] = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]  # type: ignore[misc]
    return ids(PROMPT), ids(CALL), envs, answers


def _logprobs(model: torch.nn.Module, prompt: list[int], response: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    return logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()


def _write_episodes(layout: RunLayout, model: torch.nn.Module, toks: tuple) -> None:
    """STEPS x PER_STEP samples in groups of GROUP: half of them the right answer after the group's digit, half wrong."""
    prompt, call, envs, answers = toks
    rng = random.Random(0)
    writer = ShardWriter(layout, open_run(layout.root).run_id, "synth")
    for g in range(STEPS * PER_STEP // GROUP):
        d = rng.randrange(10)
        wrong = rng.sample([x for x in range(10) if x != d], GROUP // 2)
        for x in [d] * (GROUP // 2) + wrong:  # half right: as much pushed up as down
            response = call + envs[d] + [answers[x]]
            lp = _logprobs(model, prompt, response)
            n_call, n_env = len(call), len(envs[d])
            writer.add(
                {
                    "group_id": f"synth.{writer.incarnation}.g{g}",
                    "prompt_ids": prompt,
                    "response_ids": response,
                    "response_logprobs": [min(v, 0.0) for v in lp[:n_call]]
                    + [0.0] * n_env
                    + [min(lp[-1], 0.0)],
                    "reward": float(x == d),
                    "policy_version": 0,
                    "finish_reason": "stop",
                    "loss_mask": [1] * n_call + [0] * n_env + [1],
                    "turn_lengths": [n_call, n_env, 1],
                    "turn_versions": [0, -1, 0],
                    "episode": '{"model_turns": 2, "tool_calls": 1}',
                }
            )
        if writer.pending >= PER_STEP:
            assert writer.flush() is not None


def _answer_scores(model: torch.nn.Module, toks: tuple) -> tuple[float, float]:
    """Over the ten digits: the right answer's mean logprob after the environment's turn, and its mean lead over
    the mean of the nine wrong digits'."""
    prompt, call, envs, answers = toks
    right, lead = [], []
    for d in range(10):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + call + envs[d]])).logits[0, -1].log_softmax(-1)
        digits = logits[torch.tensor(answers)]
        right.append(float(digits[d]))
        lead.append(float(digits[d] - torch.cat([digits[:d], digits[d + 1 :]]).mean()))
    return sum(right) / 10, sum(lead) / 10


def test_the_trainer_learns_the_answer_from_the_environments_turn(
    tmp_path: Path, tiny_model_untied: Path
) -> None:
    from transformers import AutoModelForCausalLM

    layout = make_run(
        tmp_path / "run",
        tiny_model_untied,
        **{
            "rollout.sampling.n": GROUP,
            "rollout.sampling.max_response_length": 32,
            "trainer.samples_per_step": PER_STEP,
            "trainer.save_every": 100,
            "algorithm.entropy_coef": 0.0,
        },
    )
    toks = _tokens(tiny_model_untied)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_untied, dtype=torch.float32).eval()
    before = _answer_scores(model, toks)
    _write_episodes(layout, model, toks)

    run_ok(command(1, *trainer_args(layout, "--max-steps", STEPS)), tmp_path / "trainer.log")
    assert [r["step"] for r in metrics(layout)] == list(range(1, STEPS + 1))
    final = latest_version(layout)
    model.load_state_dict(safetensors_dir(layout.weight_version(final)))
    after = _answer_scores(model, toks)
    print(f"right answer's logprob {before[0]:.3f} -> {after[0]:.3f}, lead {before[1]:.3f} -> {after[1]:.3f}")
    assert after[0] - before[0] > 0.5 and after[1] - before[1] > 0.5, (before, after)
