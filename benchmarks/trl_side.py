"""TRL's side of `inflight bench trl`: `GRPOTrainer` on the benchmark's task, in TRL's own environment.

Started by `benchmarks/trl.py` as `python -m benchmarks.trl_side` from the repository root (so `import trl`
finds TRL, not benchmarks/trl.py); imports nothing of inflight. Writes OUT/steps.jsonl, one line per
optimizer step: {"step", "end_s" (seconds since `trainer.train()` began), "reward", "tokens" (generated,
the step's total)}, and OUT/meta.json: versions, the stop ids TRL generates with, the first prompt's ids.
The settings mirror inflight's side one for one; `benchmarks/trl.py` states them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

import trl
from benchmarks import at_least
from benchmarks.trl_task import prompt, reward
from trl import GRPOConfig, GRPOTrainer


def digits_reward(completions: list[list[dict[str, str]]], **kwargs: Any) -> list[float]:
    """trl_task's reward of each reply (TRL decodes it without special tokens, so without the stop token)."""
    return [reward(completion[0]["content"]) for completion in completions]


class StepLog(TrainerCallback):
    """One line per optimizer step, timed from the start of `train()` like inflight's metrics.jsonl."""

    def __init__(self, path: Path, steps: int, completions_per_step: int) -> None:
        self.path, self.steps, self.completions_per_step = path, steps, completions_per_step
        self.t0 = 0.0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.t0 = time.perf_counter()
        self.path.write_text("")

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if not logs or "reward" not in logs:
            return
        end_s = round(time.perf_counter() - self.t0, 3)
        tokens = logs["completions/mean_length"] * self.completions_per_step
        row = {"step": state.global_step - 1, "end_s": end_s, "reward": logs["reward"], "tokens": tokens}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(
            f"trl: step {state.global_step}/{self.steps} reward {logs['reward']:.3f} at {end_s:.1f} s",
            flush=True,
        )


class RecordingGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that keeps the token ids of the first prompt it tokenizes, to check they are inflight's."""

    first_prompt_ids: list[int] | None = None

    def _tokenize_prompts(self, prompts: list) -> Any:
        out = super()._tokenize_prompts(prompts)
        if self.first_prompt_ids is None:
            self.first_prompt_ids = [int(i) for i in out[0][0]]
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=at_least(1), required=True)
    parser.add_argument("--prompts", type=at_least(1), required=True)
    parser.add_argument("--samples", type=at_least(2), required=True)
    parser.add_argument("--new-tokens", type=at_least(1), required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--seed", type=at_least(0), required=True)
    args = parser.parse_args()
    out = Path(args.out)
    per_step = args.prompts * args.samples

    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": prompt(k)}]} for k in range(args.steps * args.prompts)]
    )
    config = GRPOConfig(
        output_dir=str(out / "trainer"),
        max_steps=args.steps,
        per_device_train_batch_size=per_step,  # one step = one generation batch = one optimizer update
        gradient_accumulation_steps=1,
        num_generations=args.samples,
        max_completion_length=args.new_tokens,
        shuffle_dataset=False,  # prompts in dataset order: problem k = prompts * step + i, as inflight's
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        loss_type="dapo",  # clipped surrogate, token mean over the whole step: inflight's ppo + token_mean
        epsilon=0.2,
        beta=0.0,
        scale_rewards="group",
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=0.9,
        adam_beta2=0.95,  # inflight's default
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        bf16=False,
        seed=args.seed,
    )
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    trainer = RecordingGRPOTrainer(
        model=model,
        reward_funcs=digits_reward,
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(args.model),
        callbacks=[StepLog(out / "steps.jsonl", args.steps, per_step)],
    )
    trainer.train()
    meta = {
        "trl_version": trl.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "eos_token_ids": [int(i) for i in trainer.eos_token_ids],
        "prompt_ids_0": trainer.first_prompt_ids,
    }
    (out / "meta.json").write_text(json.dumps(meta))


if __name__ == "__main__":
    main()
