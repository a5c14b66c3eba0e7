"""Built-in engine vs Hugging Face `generate`: sampled tokens/s on the same model, prompts and settings;
and multi-LoRA serving: --adapters adapters x --adapter-requests requests in one engine run (rows of every
adapter in each decode step) vs one adapter at a time (one run per adapter), on the same engine.

Both sample from the same distribution (temperature 1, top-k as given, 0 = off; note HF's own default
is top_k=50) and produce exactly --new-tokens per prompt. Prints one JSON line last.
Run: `inflight bench engine [--model DIR]` (default: the tiny preset, built locally).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable

import torch


def _best_times(runs: dict[str, Callable[[], int]], repeats: int) -> dict[str, tuple[float, int]]:
    """Best seconds per run and the tokens it produced, after one warm-up each.

    Repeats alternate between the runs so that load from other processes hits both alike.
    """
    tokens = {name: fn() for name, fn in runs.items()}
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: (best[name], tokens[name]) for name in runs}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each, best kept")
    parser.add_argument("--top-k", type=int, default=0, help="applied to both (0 = off)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="for both")
    parser.add_argument("--model", default=None, help="HF model dir or hub id (default: the tiny preset)")
    parser.add_argument("--adapters", type=int, default=8, help="multi-LoRA case: adapters")
    parser.add_argument(
        "--adapter-requests", type=int, default=8, help="multi-LoRA case: requests per adapter"
    )
    parser.add_argument("--lora-rank", type=int, default=8, help="multi-LoRA case: rank (attention and MLP)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from inflight.inference import BuiltinEngine, BuiltinEngineConfig
    from inflight.types import AdapterUpdate, SampleRequest, SamplingParams

    if args.model is None:
        from inflight.models import build_tiny

        args.model = str(build_tiny(tempfile.mkdtemp(prefix="inflight-bench-engine-"), preset="tiny"))
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    model = model.to(getattr(torch, args.dtype))
    generator = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompts = torch.randint(0, vocab, (args.batch_size, args.prompt_tokens), generator=generator)

    lora_rows = args.adapters * args.adapter_requests
    engine = BuiltinEngine(
        model,
        config=BuiltinEngineConfig(
            max_batch_size=max(args.batch_size, lora_rows),
            max_seq_len_tokens=args.prompt_tokens + args.new_tokens,
            dtype=args.dtype,
        ),
    )
    # No stop tokens: exactly new_tokens per request, like HF with min_new_tokens.
    params = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, top_k=args.top_k)

    def run_engine() -> int:
        requests = [SampleRequest(prompt_token_ids=p, params=params) for p in prompts.tolist()]
        return sum(len(c.token_ids) for c in engine.generate(requests))

    def run_hf() -> int:
        with torch.inference_mode():
            out = model.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                do_sample=True,
                temperature=1.0,
                top_k=args.top_k,
                top_p=1.0,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                pad_token_id=0,
            )
        return (out.shape[1] - prompts.shape[1]) * out.shape[0]

    # Multi-LoRA: random adapters (B nonzero, as after training) on every attention and MLP projection.
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    linears = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets
    ]
    for i in range(args.adapters):
        tensors = {}
        for name, m in linears:
            tensors[f"base_model.model.{name}.lora_A.weight"] = 0.01 * torch.randn(
                args.lora_rank, m.in_features, generator=generator
            )
            tensors[f"base_model.model.{name}.lora_B.weight"] = 0.01 * torch.randn(
                m.out_features, args.lora_rank, generator=generator
            )
        engine.set_adapter(AdapterUpdate(f"adapter{i}", 1, args.lora_rank, 32 / args.lora_rank, tensors))
    lora_prompts = torch.randint(0, vocab, (lora_rows, args.prompt_tokens), generator=generator).tolist()

    def lora_requests(adapter: int) -> list[SampleRequest]:
        rows = lora_prompts[adapter * args.adapter_requests : (adapter + 1) * args.adapter_requests]
        return [SampleRequest(p, params, adapter=f"adapter{adapter}") for p in rows]

    def run_lora_batched() -> int:
        requests = [r for a in range(args.adapters) for r in lora_requests(a)]
        return sum(len(c.token_ids) for c in engine.generate(requests))

    def run_lora_one_at_a_time() -> int:
        return sum(len(c.token_ids) for a in range(args.adapters) for c in engine.generate(lora_requests(a)))

    times = _best_times(
        {
            "engine": run_engine,
            "hf": run_hf,
            "lora_batched": run_lora_batched,
            "lora_one_at_a_time": run_lora_one_at_a_time,
        },
        args.repeats,
    )
    (engine_s, engine_tokens), (hf_s, hf_tokens) = times["engine"], times["hf"]
    assert engine_tokens == hf_tokens == args.batch_size * args.new_tokens, (engine_tokens, hf_tokens)
    (batched_s, batched_tokens), (serial_s, serial_tokens) = (
        times["lora_batched"],
        times["lora_one_at_a_time"],
    )
    assert batched_tokens == serial_tokens == lora_rows * args.new_tokens, (batched_tokens, serial_tokens)
    result = {
        "tokens_per_s": round(engine_tokens / engine_s, 1),
        "hf_tokens_per_s": round(hf_tokens / hf_s, 1),
        "ratio_vs_hf": round(hf_s / engine_s, 2),
        "multi_lora_tokens_per_s": round(batched_tokens / batched_s, 1),
        "multi_lora_one_at_a_time_tokens_per_s": round(serial_tokens / serial_s, 1),
        "ratio_multi_lora_batched": round(serial_s / batched_s, 2),
        "adapters": args.adapters,
        "adapter_requests": args.adapter_requests,
        "lora_rank": args.lora_rank,
        "batch_size": args.batch_size,
        "new_tokens": args.new_tokens,
        "prompt_tokens": args.prompt_tokens,
        "top_k": args.top_k,
        "params": sum(p.numel() for p in model.parameters()),
        "vocab_size": vocab,
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "timing": f"best of {args.repeats} after a warm-up, all four runs alternating",
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
