"""Built-in engine vs Hugging Face `generate`: sampled tokens/s on the same model, prompts and settings;
and multi-LoRA serving: --adapters adapters x --adapter-requests requests in one engine run (rows of every
adapter in each decode step) vs one adapter at a time (one run per adapter), on the same engine.

Both sample from the same distribution (temperature 1, top-k as given, 0 = off; note HF's own default
is top_k=50) and produce exactly --new-tokens per prompt. Prints one JSON line last.
Run: `inflight bench engine [--model DIR]` (default: the tiny preset, built locally). `--vocab-size N` times
the tiny preset's shape with an N-token vocabulary instead (random weights, no tokenizer: the prompts are
random ids), where sampling over the vocabulary costs what it does for a real model (Qwen2.5: 151,936).
`--device cuda` runs both sides on a GPU (the engine's `device`, HF's model and prompts), each timed run
ending when the device has finished; the default stays the CPU.

`--backend vllm` also times vLLM (CPU build, `serve-engine --backend vllm` in the environment
`launch/vllm_env.py` builds, float32) on the same model and requests, keys `vllm_*`. Its figures include
the HTTP hop: the server runs in its own process and is reached through `HttpEngine` on loopback (token ids
in JSON), while the built-in engine and HF run in this process. One side runs at a time (the server idles
while this process times its runs), so the server gets --threads threads too. The server keeps
serve-engine's defaults: LoRA enabled (max 4 adapters per batch, rank <= 16), which wraps every projection
even for base rows. Its base run is timed with the others, before it has any adapter: from the first
adapter on, vLLM's base rows run on an all-zero adapter (`vllm_engine.py`). Its multi-LoRA case follows,
on the same adapters and requests as the built-in engine's, its two runs alternating with each other:
batched sends the requests of at most 4 adapters per call (the server's limit), one at a time one
adapter's per call. vLLM keeps only a few adapters loaded, so with more than that it reloads them from
files between calls, in both runs: part of its cost.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from benchmarks import at_least
from inflight.preflight import check_model_dir

if TYPE_CHECKING:
    from inflight.inference.engine import Engine
    from inflight.inference.http_engine import HttpEngine
    from inflight.types import SampleRequest


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


def _tokens(engine: Engine, requests: Sequence[SampleRequest]) -> int:
    return sum(len(c.token_ids) for c in engine.generate(requests))


def _start_vllm(
    stack: contextlib.ExitStack, model_dir: str, max_batch_size: int, max_seq_len_tokens: int, threads: int
) -> HttpEngine:
    """vLLM's serve-engine in a process of its own, stopped when `stack` closes, and a client for it."""
    from inflight.inference.http_engine import HttpEngine
    from inflight.launch.engine_process import EngineProcess

    server = EngineProcess(
        model_dir,
        backend="vllm",
        max_batch_size=max_batch_size,
        max_seq_len_tokens=max_seq_len_tokens,
        threads=threads,
    )
    stack.enter_context(server)
    return stack.enter_context(HttpEngine([server.url]))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="inflight bench engine", description=__doc__)
    parser.add_argument(
        "--batch-size", type=at_least(1), default=64, help="prompts sampled together (default %(default)s)"
    )
    parser.add_argument(
        "--new-tokens",
        type=at_least(1),
        default=32,
        help="tokens generated per prompt, exactly (default %(default)s)",
    )
    parser.add_argument(
        "--prompt-tokens", type=at_least(1), default=16, help="tokens per prompt (default %(default)s)"
    )
    parser.add_argument(
        "--repeats", type=at_least(1), default=5, help="timed runs of each, best kept (default %(default)s)"
    )
    parser.add_argument("--top-k", type=at_least(0), default=0, help="applied to all (0 = off, the default)")
    parser.add_argument(
        "--threads",
        type=at_least(1),
        default=None,
        help="torch threads, and the vLLM server's with --backend vllm (default: torch's, one per core)",
    )
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="for all (vLLM: float32)"
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="auto, cpu, cuda or cuda:N, for the engine and HF alike (default %(default)s; not with vllm)",
    )
    parser.add_argument(
        "--backend",
        choices=["builtin", "vllm"],
        default="builtin",
        help="vllm: also time vLLM on the same requests, over HTTP (vllm_* keys; see above)",
    )
    parser.add_argument("--model", default=None, help="HF model dir or hub id (default: the tiny preset)")
    parser.add_argument(
        "--vocab-size",
        type=at_least(2),
        default=None,
        help="the tiny preset's shape with this many tokens (random weights; not with --model)",
    )
    parser.add_argument("--adapters", type=at_least(1), default=8, help="multi-LoRA case: adapters")
    parser.add_argument(
        "--adapter-requests", type=at_least(1), default=8, help="multi-LoRA case: requests per adapter"
    )
    parser.add_argument(
        "--lora-rank", type=at_least(1), default=8, help="multi-LoRA case: rank (attention and MLP)"
    )
    args = parser.parse_args(argv)
    if args.backend == "vllm" and args.dtype != "float32":
        parser.error("--backend vllm runs float32 (serve-engine's vLLM dtype): drop --dtype")
    if args.vocab_size is not None and (args.model or args.backend == "vllm"):
        parser.error("--vocab-size builds a model in memory: not with --model or --backend vllm")
    if args.backend == "vllm" and args.device != "cpu":
        parser.error("--backend vllm times the CPU build of vLLM: drop --device")
    if args.model:
        check_model_dir(args.model)  # what `inflight run` checks: one line for a path that holds no model
    from inflight.models.device import resolve_device

    device = resolve_device(args.device, key="--device")  # one line where this machine lacks it
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from inflight.inference import BuiltinEngine, BuiltinEngineConfig
    from inflight.inference.vllm_engine import VllmEngineConfig  # imports vLLM only when one is made
    from inflight.types import AdapterUpdate, SampleRequest, SamplingParams

    served_vllm = VllmEngineConfig()  # the limits serve-engine --backend vllm starts vLLM with
    if args.vocab_size is not None:
        from inflight.models.tiny import PRESETS, model_config

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            config = model_config(PRESETS["tiny"])
            config.vocab_size = args.vocab_size
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    else:
        if args.model is None:
            from inflight.models import build_tiny

            args.model = str(build_tiny(tempfile.mkdtemp(prefix="inflight-bench-engine-"), preset="tiny"))
        model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    model = model.to(getattr(torch, args.dtype))
    generator = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompts = torch.randint(0, vocab, (args.batch_size, args.prompt_tokens), generator=generator)

    lora_rows = args.adapters * args.adapter_requests
    max_batch_size, max_seq_len_tokens = max(args.batch_size, lora_rows), args.prompt_tokens + args.new_tokens
    engine = BuiltinEngine(
        model,
        config=BuiltinEngineConfig(
            max_batch_size=max_batch_size,
            max_seq_len_tokens=max_seq_len_tokens,
            dtype=args.dtype,
            device=str(device),
        ),
    )
    # HF's side on the same device (the engine keeps copies of its own); prompts go as ids to both.
    model, hf_prompts = model.to(device), prompts.to(device)
    # No stop tokens: exactly new_tokens per request, like HF with min_new_tokens.
    params = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, top_k=args.top_k)

    def requests() -> list[SampleRequest]:
        return [SampleRequest(prompt_token_ids=p, params=params) for p in prompts.tolist()]

    def run_hf() -> int:
        with torch.inference_mode():
            out = model.generate(
                hf_prompts,
                attention_mask=torch.ones_like(hf_prompts),
                do_sample=True,
                temperature=1.0,
                top_k=args.top_k,
                top_p=1.0,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                pad_token_id=0,
            )
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the engine's side returns token lists, so it has waited too
        return (out.shape[1] - prompts.shape[1]) * out.shape[0]

    # Multi-LoRA: random adapters (B nonzero, as after training) on every attention and MLP projection.
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    linears = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets
    ]
    adapters = []
    for i in range(args.adapters):
        tensors = {}
        for name, m in linears:
            tensors[f"base_model.model.{name}.lora_A.weight"] = 0.01 * torch.randn(
                args.lora_rank, m.in_features, generator=generator
            )
            tensors[f"base_model.model.{name}.lora_B.weight"] = 0.01 * torch.randn(
                m.out_features, args.lora_rank, generator=generator
            )
        adapters.append(AdapterUpdate(f"adapter{i}", 1, args.lora_rank, 32 / args.lora_rank, tensors))
        engine.set_adapter(adapters[-1])
    lora_prompts = torch.randint(0, vocab, (lora_rows, args.prompt_tokens), generator=generator).tolist()

    def lora_requests(adapter: int) -> list[SampleRequest]:
        rows = lora_prompts[adapter * args.adapter_requests : (adapter + 1) * args.adapter_requests]
        return [SampleRequest(p, params, adapter=f"adapter{adapter}") for p in rows]

    def lora_batched(on: Engine, adapters_per_call: int) -> int:
        """The requests of every adapter, those of at most `adapters_per_call` adapters in one call."""
        firsts = range(0, args.adapters, adapters_per_call)
        calls = [range(first, min(first + adapters_per_call, args.adapters)) for first in firsts]
        return sum(_tokens(on, [r for a in call for r in lora_requests(a)]) for call in calls)

    def lora_one_at_a_time(on: Engine) -> int:
        return sum(_tokens(on, lora_requests(a)) for a in range(args.adapters))

    runs: dict[str, Callable[[], int]] = {
        "engine": lambda: _tokens(engine, requests()),
        "hf": run_hf,
        "lora_batched": lambda: lora_batched(engine, args.adapters),
        "lora_one_at_a_time": lambda: lora_one_at_a_time(engine),
    }
    vllm_threads = torch.get_num_threads()
    vllm_lora = args.lora_rank <= served_vllm.max_lora_rank
    with contextlib.ExitStack() as stack:
        if args.backend == "vllm":
            vllm = _start_vllm(stack, args.model, max_batch_size, max_seq_len_tokens, vllm_threads)
            runs["vllm"] = lambda: _tokens(vllm, requests())
        times = _best_times(runs, args.repeats)
        if args.backend == "vllm" and vllm_lora:
            for update in adapters:  # only now: from the first adapter on, vLLM's base rows run on a zero one
                vllm.set_adapter(update)
            vllm_lora_runs: dict[str, Callable[[], int]] = {
                "vllm_lora_batched": lambda: lora_batched(vllm, served_vllm.max_loras),
                "vllm_lora_one_at_a_time": lambda: lora_one_at_a_time(vllm),
            }
            times |= _best_times(vllm_lora_runs, args.repeats)
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
        "device": str(device),
        "timing": f"best of {args.repeats} after a warm-up, all four runs alternating",
    }
    if args.backend == "vllm":
        from inflight.launch.vllm_env import VLLM_PACKAGE

        vllm_s, vllm_tokens = times["vllm"]
        assert vllm_tokens == args.batch_size * args.new_tokens, vllm_tokens
        result |= {
            "vllm_tokens_per_s": round(vllm_tokens / vllm_s, 1),
            "ratio_vllm_vs_builtin": round(engine_s / vllm_s, 2),
            "ratio_vllm_vs_hf": round(hf_s / vllm_s, 2),
        }
        if vllm_lora:
            (vllm_batched_s, vllm_batched_tokens), (vllm_serial_s, vllm_serial_tokens) = (
                times["vllm_lora_batched"],
                times["vllm_lora_one_at_a_time"],
            )
            assert vllm_batched_tokens == vllm_serial_tokens == lora_rows * args.new_tokens
            result |= {
                "vllm_multi_lora_tokens_per_s": round(vllm_batched_tokens / vllm_batched_s, 1),
                "vllm_multi_lora_one_at_a_time_tokens_per_s": round(vllm_serial_tokens / vllm_serial_s, 1),
                "ratio_vllm_multi_lora_batched": round(vllm_serial_s / vllm_batched_s, 2),
                "ratio_vllm_multi_lora_vs_builtin": round(batched_s / vllm_batched_s, 2),
                "vllm_adapters_per_call": min(served_vllm.max_loras, args.adapters),
            }
        else:
            result["vllm_multi_lora_skipped"] = (
                f"--lora-rank {args.lora_rank} > {served_vllm.max_lora_rank}, serve-engine's max for vLLM"
            )
        result |= {
            "vllm_threads": vllm_threads,
            "vllm_package": VLLM_PACKAGE,
            "timing": f"best of {args.repeats} after a warm-up, all five runs alternating",
            "vllm_timing": "through HTTP (serve-engine --backend vllm on loopback, token ids in JSON); its "
            "two LoRA runs after the five, alternating with each other, best of as many",
        }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
