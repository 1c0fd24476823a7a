"""`shardrl synth`: valid synthetic shards written through the real shard writer.

For load tests, benchmarks and trainer tests that need no rollout workers: prompts come from the run's task and are
tokenized with the run's tokenizer, responses are random token ids valid for the run's model with plausible
logprobs, and samples come in groups of the run's configured group size (``rollout.sampling.n``).
"""

from __future__ import annotations

import random
from pathlib import Path

from buffer.run import Run
from buffer.shards import ShardWriter
from rollout_worker.tasks import digit_reward, task_prompts


def synth_shards(
    run: Run, n_shards: int, samples: int, seed: int = 0, worker_id: str = "synth"
) -> list[Path]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(run.tokenizer_dir))
    cfg = run.config
    vocab = cfg.model.vocab_size or len(tok)
    task = cfg.data.task if cfg.data.task != "file" else "max_digit"
    prompts = task_prompts(task)
    group = cfg.rollout.sampling.n
    max_resp = cfg.rollout.sampling.max_response_length
    rng = random.Random(seed)
    digits: list[int] = [int(tok.convert_tokens_to_ids(str(d))) for d in range(10)]  # type: ignore[arg-type]
    writer = ShardWriter(run.layout, run.run_id, worker_id)
    paths = []
    for s in range(n_shards):
        while writer.pending < samples:
            p = rng.choice(prompts)
            prompt_ids = tok(p.prompt, add_special_tokens=False)["input_ids"]
            gid = f"{worker_id}.{writer.incarnation}.{s}.g{writer.pending}"
            for _ in range(min(group, samples - writer.pending)):
                length = rng.randint(1, max_resp)
                resp = [
                    rng.choice(digits) if rng.random() < 0.5 else rng.randrange(vocab) for _ in range(length)
                ]
                text = str(tok.decode(resp))
                writer.add(
                    {
                        "group_id": gid,
                        "prompt_ids": prompt_ids,
                        "response_ids": resp,
                        "response_logprobs": [-rng.uniform(0.01, 6.0) for _ in resp],
                        "reward": digit_reward(text, p.answer),
                        "policy_version": 0,
                        "finish_reason": "length" if length == max_resp else "stop",
                        "prompt_text": p.prompt,
                        "response_text": text,
                        "answer": p.answer,
                    }
                )
        path = writer.flush()
        assert path is not None
        paths.append(path)
    return paths
