"""`inflight bench train`: the trainer alone on the batch of `make run`, against a plain Hugging Face step.

The batch: 128 BlackJack episodes, 16 groups of 8 as the recipe's step has them (the 8 episodes of a
group play the same hand, so they share their first turn, ~40 tokens), played by random legal replies on
the tiny model's chat format (~42 tokens each, replies ~4, lengths 30-150), their reply tokens trained
with behaviour log-probs near the policy's and advantages of +-1, under the recipe's own TrainerConfig
(PPO with its top-3 entropy bonus and the exact KL to a frozen reference; the trainer's defaults for
micro-batches, packing and shared prefixes, unless overridden: `trainer.share_prefixes=false`). One step
is forward/backward over the batch and the AdamW step.

The baseline is what a user writes with `transformers` alone on the same batch and model: one padded
forward of the whole batch (`model(input_ids, attention_mask).logits`), log-softmax and gather, the
token-mean policy-gradient loss, backward, `torch.optim.AdamW`. It does less than the trainer (no
reference model, no entropy bonus, no clipping), so `ratio_vs_hf` understates the trainer's advantage.

`--beside-busy` measures the trainer once more beside a CPU-burning neighbour (another process multiplying
matrices on as many OpenMP threads as there are cores, with OpenMP's default spinning wait policy, as any
torch program would): `slowdown_beside_busy` is its step time there over the step time alone (issue 16
item 3: a fair share of 2 cores beside one such process is a slowdown of about 2, not fifteen).

Keys: `train_tokens_per_s` (every token of the batch, prompt and environment tokens included, over the
step time; the trainer's own `train_tokens_per_s` counts the same), `hf_tokens_per_s`, `ratio_vs_hf`
(goal >= 3, issue 16), `forward_tokens` (the tokens the trainer's forward pass computed: a shared prefix
once) and `mfu`: model FLOPs per step (6 x matmul parameters x forward tokens for the policy, 2 x ... for
the reference's forward; the embedding and attention left out) over the CPU's peak
(`--peak-gflops`, by default from /proc/cpuinfo: two FMA units of the widest vector per core and cycle at
the nominal clock, in float32, the precision the model trains in).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import torch

from benchmarks import at_least
from inflight.config import apply_overrides
from inflight.envs.blackjack import BlackJackEnv
from inflight.orchestrator.setup import build_trainer, load_policy, pad_id
from inflight.preflight import check_model_dir
from inflight.recipes.blackjack import preset
from inflight.rollouts.chat import ChatFormat
from inflight.rollouts.episodes import run_scripted_episode
from inflight.types import TrainSample


def make_batch(chat: ChatFormat, size: int, seed: int, group_size: int = 8) -> list[TrainSample]:
    """`size` BlackJack episodes of random legal play as RL samples, `group_size` of each hand (advantage
    +-1, behaviour logprobs of a near-uniform two-way choice: ratios near 1, as on policy)."""
    rng = random.Random(seed)
    env = BlackJackEnv()
    samples = []
    hand = 0
    for i in range(size):
        if i % group_size == 0:
            hand = rng.getrandbits(62)
        rollout = run_scripted_episode(env, hand, lambda obs: str(rng.choice(obs.legal_actions)), chat, 8)
        sample = TrainSample.from_rollout(rollout, advantage=1.0 if i % 2 else -1.0)
        sample.behaviour_logprobs = [-0.7 * m for m in sample.loss_mask]
        samples.append(sample)
    env.close()
    return samples


def hf_step(model: torch.nn.Module, lr: float, pad: int) -> Callable[[list[TrainSample]], None]:
    """A plain transformers training step over the whole batch (one padded forward)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95))

    def step(samples: list[TrainSample]) -> None:
        width = max(len(s.token_ids) for s in samples)
        ids = torch.full((len(samples), width), pad, dtype=torch.long)
        attention = torch.zeros((len(samples), width), dtype=torch.long)
        mask = torch.zeros((len(samples), width))
        adv = torch.zeros((len(samples), width))
        for i, s in enumerate(samples):
            n = len(s.token_ids)
            ids[i, :n] = torch.tensor(s.token_ids)
            attention[i, :n] = 1
            mask[i, :n] = torch.tensor(s.loss_mask)
            adv[i, :n] = torch.tensor(s.advantages)
        model.train()
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        lp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        m = mask[:, 1:]
        loss = -(lp * adv[:, 1:] * m).sum() / m.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def peak_gflops() -> float:
    """The CPU's nominal fp32 peak over the cores this process may use (lscpu's flags and clock)."""
    flags, mhz = "", 0.0
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags") and not flags:
                flags = line
            elif line.startswith("cpu MHz") and not mhz:
                mhz = float(line.split(":")[1])
    lanes = 16 if " avx512f" in flags else 8 if " avx2" in flags else 4
    cores = len(os.sched_getaffinity(0))
    return cores * mhz / 1000 * lanes * 2 * 2  # 2 FMA units, 2 FLOPs per FMA


# A neighbour as any torch program is: matrix products on OpenMP's default threads, spinning between them.
BUSY_NEIGHBOUR = "import torch\na = torch.randn(384, 384)\nwhile True:\n    a @ a\n"


@contextlib.contextmanager
def busy_neighbour() -> Iterator[None]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    process = subprocess.Popen([sys.executable, "-c", BUSY_NEIGHBOUR], env=env)
    try:
        yield
    finally:
        process.kill()
        process.wait()


def timed(step: Callable[[], object], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="inflight bench train", description=__doc__)
    parser.add_argument(
        "--samples", type=at_least(1), default=128, help="samples per step (make run: 16 x 8)"
    )
    parser.add_argument(
        "--steps", type=at_least(1), default=10, help="measured steps per side, after 2 warm-up"
    )
    parser.add_argument(
        "--rounds", type=at_least(1), default=3, help="alternations of the two sides; median taken"
    )
    parser.add_argument("--peak-gflops", type=float, default=None, help="the CPU's peak (default: lscpu)")
    parser.add_argument(
        "--beside-busy", action="store_true", help="also measure beside a CPU-burning neighbour process"
    )
    parser.add_argument("--model", default=None, help="model dir or hub id (default: the tiny preset)")
    parser.add_argument(
        "set", nargs="*", help="key=value overrides of the recipe (e.g. trainer.autocast_bf16=true)"
    )
    args = parser.parse_args(argv)
    if args.model:
        check_model_dir(args.model)  # what `inflight run` checks: one line for a path that holds no model

    cfg = apply_overrides(preset(), args.set)
    if args.model:
        cfg.model.path = args.model
    model, tokenizer = load_policy(cfg)
    chat = ChatFormat.for_model(tokenizer, model)
    pad = pad_id(tokenizer)
    batch = make_batch(chat, args.samples, seed=0, group_size=cfg.grpo.group_size)
    tokens = sum(len(s.token_ids) for s in batch)
    baseline_model = copy.deepcopy(model)
    trainer = build_trainer(model, tokenizer, cfg.trainer, cfg.grpo.steps)
    baseline = hf_step(baseline_model, cfg.trainer.lr, pad)
    print(f"batch: {len(batch)} samples, {tokens} tokens; {torch.get_num_threads()} threads", flush=True)

    for _ in range(2):
        warm = trainer.train_step(batch)
        baseline(batch)
    forward_tokens = int(warm["forward_tokens"])  # the batch's tokens as laid out (shared prefixes once)
    ours: list[float] = []
    theirs: list[float] = []
    for r in range(args.rounds):
        ours += timed(lambda: trainer.train_step(batch), args.steps)
        theirs += timed(lambda: baseline(batch), args.steps)
        print(
            f"round {r + 1}/{args.rounds}: inflight {statistics.median(ours) * 1e3:.1f} ms/step, "
            f"hf {statistics.median(theirs) * 1e3:.1f} ms/step",
            flush=True,
        )
    ours_s, theirs_s = statistics.median(ours), statistics.median(theirs)
    busy: dict[str, float] = {}
    if args.beside_busy:
        with busy_neighbour():
            time.sleep(2.0)  # its threads are up and spinning
            beside = statistics.median(timed(lambda: trainer.train_step(batch), args.steps))
        print(f"beside a busy neighbour: inflight {beside * 1e3:.1f} ms/step", flush=True)
        busy = {
            "step_ms_beside_busy": round(beside * 1e3, 1),
            "slowdown_beside_busy": round(beside / ours_s, 2),
        }
    params = sum(p.numel() for p in model.parameters())
    # Model FLOPs the usual way: 6 per parameter and token for the policy's forward and backward, 2 for the
    # reference's forward, over every matmul parameter (the embedding is a lookup; the LM head counts in
    # full, although the trainer runs it only at trained positions), attention's own FLOPs left out.
    matmul_params = params - model.get_input_embeddings().weight.numel()
    flops = (6 + (2 if cfg.trainer.loss.kl_coef > 0 else 0)) * matmul_params * forward_tokens
    peak = args.peak_gflops or peak_gflops()
    result = {
        "benchmark": "train",
        "train_tokens_per_s": round(tokens / ours_s, 1),
        "hf_tokens_per_s": round(tokens / theirs_s, 1),
        "ratio_vs_hf": round(theirs_s / ours_s, 3),
        "mfu": round(flops / ours_s / (peak * 1e9), 4),
        "step_ms": round(ours_s * 1e3, 1),
        "hf_step_ms": round(theirs_s * 1e3, 1),
        "batch": f"{len(batch)} samples, {tokens} tokens",
        "params": params,
        "peak_gflops": round(peak, 1),
        "autocast_bf16": trainer._bf16,
        "packing": trainer.packing,
        "share_prefixes": trainer.share_prefixes,
        "forward_tokens": forward_tokens,
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY") or "(unset)",
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT") or "(libgomp default)",
        **busy,
    }
    print(json.dumps(result))
    return result
