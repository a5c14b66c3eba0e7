#!/usr/bin/env bash
# What needs a CUDA device, in one pass that fits a short lease on a GPU machine; run from the repository
# root: `bash scripts/gpu_check.sh` (what it verified last: docs/architecture.md, "Verified on a GPU").
# Where inflight's dependencies are not installed (a machine with only torch, transformers, peft and pytest),
# they are taken from wheels in .whl/, made beforehand on a machine with the same Python and network:
#   python3.12 -m pip download -d .whl pydantic sqlalchemy fastapi uvicorn tinker==0.38.0 'psycopg[binary]' \
#       redis websockets openenv-core==0.3.0 'math-verify[antlr4-13-2]'
# (then remove the wheels of what that machine already has). Each step has its own time limit and its
# log lands in $OUT.
set -u
OUT=${OUT:-/tmp/inflight-gpu-check}
source scripts/gpu_common.sh
# 1. The gpu-marked tests: engine (fast and HF runners, sampled and raw logprobs, seeded rows), each model
#    family's engine against HF, trainer, and the data-parallel trainer and the sharded (FSDP2) one on one
#    NCCL rank.
step gpu_tests 180 python3 -m pytest -p no:cacheprovider -q -rA -m gpu tests/test_engine_lora.py tests/test_trainer_lora.py \
    tests/test_trainer_distributed.py tests/test_trainer_fsdp.py tests/test_model_families.py
# 2. The Engine contract (tests/test_engine_contract.py) against the built-in engine on CUDA.
INFLIGHT_TEST_VLLM=0 step engine_contract 90 python3 -m pytest -p no:cacheprovider -q -rfE \
    tests/test_engine_contract.py -k cuda
# 3. The service on its default device (auto: CUDA here), driven by the tinker SDK.
step service_sdk 150 python3 -m pytest -p no:cacheprovider -q -rfE -x tests/test_api_sdk.py tests/test_service_compute.py
# 4. The pipeline: BlackJack with the engine and the trainer on the GPU, a few steps end to end, training
#    every parameter and then a LoRA adapter (trainer.lora_rank: weight sync ships the adapter alone). Run
#    directories (/tmp/inflight-gpu-STEP) stay outside $OUT, whose file count is limited.
BJ=(grpo.steps=6 warmup.sft_steps=20 eval.num_episodes=400 eval.num_episodes_sampled=200 eval.every_steps=3
    eval.num_episodes_during=200 metrics.print_every_steps=1 engine.device=cuda trainer.device=cuda)
step blackjack 130 python3 -m inflight.cli run blackjack "${BJ[@]}" run_dir=/tmp/inflight-gpu-blackjack
step blackjack_lora 130 python3 -m inflight.cli run blackjack "${BJ[@]}" trainer.lora_rank=8 \
    run_dir=/tmp/inflight-gpu-blackjack_lora
# What the CUDA runs did: shared prefixes in the trainer (forward tokens below the batch's), engine-trainer
# parity, and any layout the trainer fell back from (a warning in its log).
for run in blackjack blackjack_lora; do
    echo "=== $run, per training step"
    python3 - "/tmp/inflight-gpu-$run/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
keys = ("num_tokens", "forward_tokens", "logprob_parity_max_abs", "step_s", "weight_publish_s")
for r in rows:
    if r.get("phase") == "train":
        print({k: r.get(k) for k in keys})
PY
    grep -i "warn" "$OUT/$run.log" | head -5 || true
done
