#!/usr/bin/env bash
# Speed on a CUDA device, in one pass that fits a short lease on a GPU machine; run from the repository
# root: `bash scripts/gpu_bench.sh` (its last figures: docs/benchmarks.md, the `bench engine --device cuda`
# row). Dependencies as in scripts/gpu_check.sh (wheels in .whl/ where the machine lacks them). Each step
# has its own time limit and its log lands in $OUT.
#
# `inflight bench engine --device cuda`: the built-in engine against HF `generate` on the GPU, on the tiny
# preset (float32) and on a model of Qwen2.5-0.5B's shape (random weights built here, no download; 494 M
# parameters, bfloat16), each with its multi-LoRA case.
set -u
OUT=${OUT:-/tmp/inflight-gpu-bench}
STEP_TAIL_LINES=4
source scripts/gpu_common.sh
QWEN=/tmp/inflight-qwen2.5-0.5b-shape
python3 - "$QWEN" <<'PY'
import sys, torch, transformers
config = transformers.Qwen2Config(  # Qwen2.5-0.5B's config.json
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
torch.manual_seed(0)
with torch.device("cuda"):
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.save_pretrained(sys.argv[1])
print(sys.argv[1], sum(p.numel() for p in model.parameters()), "parameters")
PY
step engine_tiny 120 python3 -m inflight.cli bench engine --device cuda --repeats 3
step engine_qwen_0_5b 300 python3 -m inflight.cli bench engine --device cuda --model "$QWEN" \
    --dtype bfloat16 --batch-size 64 --prompt-tokens 128 --new-tokens 64 --repeats 3
