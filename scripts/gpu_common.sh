# Sourced by scripts/gpu_check.sh and scripts/gpu_bench.sh, from the repository root, with OUT set: the
# dependencies a GPU machine lacks taken from wheels in .whl/ (see gpu_check.sh for how to make them), src/ on
# the path, and `step NAME SECONDS COMMAND...`, which runs a command under its own time limit, its log in
# $OUT/NAME.log, and prints the log's last $STEP_TAIL_LINES lines and the exit code.
mkdir -p "$OUT"
if ! python3 -c "import fastapi, tinker" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=src:.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
step() {  # name, seconds, command...
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "=== $name"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n "${STEP_TAIL_LINES:-25}" "$OUT/$name.log"
    echo "=== $name: exit $rc after $((SECONDS - start)) s"
}
nvidia-smi -L
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
