#!/usr/bin/env bash
# One command, under 5 minutes on a CUDA machine with flash-linear-attention (fla) and Triton installed:
# checks our PyTorch KDA path and the tiny K3 model against fla's Triton kernels, then prints speeds.
# See bench/gpu_check.py for what is checked and the tolerances.
#
#   bash bench/gpu_check.sh                      # the CUDA check (prints SKIP and exits 0 without a GPU)
#   bash bench/gpu_check.sh --sections ops       # only the op checks (also: model, paths, parallel, speed)
#   bash bench/gpu_check.sh --device cpu --dry   # every code path but the Triton calls, on the CPU
#
# Exit status: 0 PASS or SKIP; 1 a mismatch or error; 3 checks left undone within the time budget;
# 124 the hard time limit (GPU_CHECK_TIMEOUT, default 290 s) was hit.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
PYTHON="${PYTHON:-python}"
LIMIT="${GPU_CHECK_TIMEOUT:-290}"

dry=0
for arg in "$@"; do
    [[ "$arg" == "--dry" ]] && dry=1
done

if [[ $dry == 0 ]]; then
    if ! cuda=$("$PYTHON" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null); then
        echo "FAIL: cannot import torch with $PYTHON"
        exit 1
    fi
    if [[ "$cuda" != 1 ]]; then
        echo "SKIP: no CUDA device (torch.cuda.is_available() is False); nothing was checked."
        echo "      (bash bench/gpu_check.sh --device cpu --dry exercises the script on the CPU)"
        exit 0
    fi
fi

# Check this tree's code, whether or not (or whichever version of) transformers_k3 is installed.
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PYTHON" -c 'import transformers_k3' >/dev/null 2>&1; then
    echo "transformers_k3 does not import from src/ (a dependency is missing?); trying: pip install -e ."
    "$PYTHON" -m pip install -q -e . || echo "pip install -e . failed; continuing, the import error will follow"
fi

timeout -k 10 "$LIMIT" "$PYTHON" bench/gpu_check.py --budget "$((LIMIT - 25))" "$@"
rc=$?
if [[ $rc == 124 || $rc == 137 ]]; then
    echo "FAIL: bench/gpu_check.py did not finish within ${LIMIT} s (GPU_CHECK_TIMEOUT); see the checks above"
    exit 124
fi
exit $rc
