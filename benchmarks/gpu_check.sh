#!/usr/bin/env bash
# The distributed and CUDA checks, for the day a GPU is at hand: under 8 minutes on one GPU
# (each check has a time limit; together they are 7 min 45 s).
#
#   benchmarks/gpu_check.sh            # from anywhere; PYTHON=... to pick the interpreter
#
# 1. sync:      a bf16-autocast training step on CUDA with the capture engine attached
#               (and with inline K-FAC statistics) makes no host sync
#               (torch.cuda.set_sync_debug_mode("error")); gradients within bf16 rounding
#               of an fp32 CPU capture.
# 2. capture:   `tda capture --device cuda` stores the CPU capture's gradients.
# 3. attribute: `tda attribute --device cuda`, and under torchrun with NCCL (one rank per
#               GPU, at most 2), give the CPU scores (graddot, gradcos, kfac, ekfac).
# 4. torchrun:  the multi-process tests (gloo on the CPU: DDP/FSDP2 callbacks, OLMo-core,
#               the CLI on 2 ranks), which must still pass on the GPU machine.
# 5. peers:     the peer harness's CUDA cells, ours only (bf16, Qwen2-0.5B's shape, 512
#               tokens, 64 training rows, 8 queries; EK-FAC left out: its fp64
#               eigendecompositions run on the CPU and alone take minutes at this size).
#
# The CPU results stay the reference. Prints a summary; exits 1 if any check failed, 2 at
# once when torch sees no CUDA device.
set -u -o pipefail

cd "$(dirname "$0")/.." || exit 2
PYTHON=${PYTHON:-.venv/bin/python}
if [ ! -x "$PYTHON" ]; then
    PYTHON=$(command -v python3) || { echo "gpu_check: no python (set PYTHON=...)" >&2; exit 2; }
fi
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: torch ($PYTHON) sees no CUDA device; run this on a GPU machine with a" \
        "CUDA build of torch (nothing was checked)" >&2
    exit 2
fi
"$PYTHON" -c 'import torch; print("gpu_check:", torch.cuda.get_device_name(0), "x",
    torch.cuda.device_count(), "| torch", torch.__version__)'

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
names=()
results=()
failed=0

# check NAME SECONDS COMMAND...: run COMMAND with a time limit, record PASS/FAIL and time
check() {
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    local start=$SECONDS
    if timeout "$limit" "$@" > "$WORK/$name.log" 2>&1; then
        results+=("PASS  $name ($((SECONDS - start)) s)")
    else
        local code=$?
        results+=("FAIL  $name ($((SECONDS - start)) s, exit $code; log below)")
        failed=1
        tail -n 30 "$WORK/$name.log"
    fi
    grep -E '^(PASS|[0-9]+ passed)' "$WORK/$name.log" || true
    names+=("$name")
}

check sync 60 "$PYTHON" benchmarks/gpu_checks.py sync
check capture 45 "$PYTHON" benchmarks/gpu_checks.py capture
check attribute 120 "$PYTHON" benchmarks/gpu_checks.py attribute
check torchrun 120 "$PYTHON" -m pytest -q -p no:cacheprovider -m multiprocess \
    tests/test_cli_ranks.py tests/test_hf_distributed.py tests/test_olmo_core_distributed.py
check peers 120 "$PYTHON" benchmarks/bench_peers.py --device cuda --dtype bf16 \
    --models qwen2 --libraries ours --methods graddot graddot_proj kfac --queries 8 \
    --train 64 --seq 512 --rounds 1 --no-write --out "$WORK/peers" --chart ''

echo
echo "gpu_check summary (${#names[@]} checks, ${SECONDS} s):"
printf '  %s\n' "${results[@]}"
exit "$failed"
