"""`inflight bench engine --backend vllm` at tiny settings on the tiny model: vLLM (serve-engine in its own
process) runs the same requests as the built-in engine and HF, its multi-LoRA case split into calls of at
most the server's adapters per batch, and every key of the built-in run is still reported beside the vLLM
ones.

Reference: the issue's "`inflight bench engine --backend vllm`: vLLM (CPU build here) against the built-in
engine and HF `generate` on the same model and requests; report the ratios as measured"; the numbers
themselves belong in docs/benchmarks.md, measured alone, not here.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from conftest import require_vllm_env

pytestmark = pytest.mark.slow
REPO_ROOT = Path(__file__).resolve().parents[1]
BUILTIN_KEYS = [
    "tokens_per_s", "hf_tokens_per_s", "ratio_vs_hf", "multi_lora_tokens_per_s",
    "multi_lora_one_at_a_time_tokens_per_s", "ratio_multi_lora_batched", "adapters", "adapter_requests",
    "lora_rank", "batch_size", "new_tokens", "prompt_tokens", "top_k", "params", "vocab_size", "threads",
    "dtype", "device", "timing",
]  # fmt: skip


def test_vllm_runs_the_same_requests(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_vllm_env()
    monkeypatch.syspath_prepend(str(REPO_ROOT))  # benchmarks/ lives beside src/, as `inflight bench` finds it
    bench = importlib.import_module("benchmarks.engine")
    tiny = ["--repeats", "1", "--batch-size", "2", "--new-tokens", "2", "--prompt-tokens", "4"]
    tiny += ["--adapters", "5", "--adapter-requests", "1", "--threads", "1"]  # 5 adapters: two vLLM calls
    result = bench.main([*tiny, "--backend", "vllm", "--model", str(tiny_model_dir)])
    assert list(result)[: len(BUILTIN_KEYS)] == BUILTIN_KEYS
    positive = [
        "vllm_tokens_per_s",
        "ratio_vllm_vs_builtin",
        "ratio_vllm_vs_hf",
        "vllm_multi_lora_tokens_per_s",
        "vllm_multi_lora_one_at_a_time_tokens_per_s",
        "ratio_vllm_multi_lora_batched",
        "ratio_vllm_multi_lora_vs_builtin",
    ]
    assert all(result[key] > 0 for key in positive), {key: result[key] for key in positive}
    assert result["vllm_adapters_per_call"] == 4 and result["vllm_threads"] == 1


def test_a_vocabulary_of_any_size(capsys: pytest.CaptureFixture[str]) -> None:
    """`--vocab-size`: the tiny preset's shape with another vocabulary, built in memory; every key reported
    at tiny settings; and refused beside a model of its own."""
    bench = importlib.import_module("benchmarks.engine")
    settings = ["--batch-size", "3", "--new-tokens", "2", "--prompt-tokens", "3", "--repeats", "1"]
    result = bench.main([*settings, "--adapters", "2", "--adapter-requests", "2", "--vocab-size", "50000"])
    assert result["vocab_size"] == 50000 and set(BUILTIN_KEYS) <= set(result) and result["device"] == "cpu"
    assert result["tokens_per_s"] > 0 and result["multi_lora_tokens_per_s"] > 0
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--vocab-size", "50000", "--model", "some/dir"])
    assert exit_info.value.code == 2 and "not with --model" in capsys.readouterr().err
