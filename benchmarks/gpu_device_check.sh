#!/usr/bin/env bash
# The checks that need a GPU, in one run of about three minutes: the tests under the `cuda`
# marker (among them: batches dropped at once under slow kernels with device="cuda", and a
# refusal of registration forced by registering an unmapped range: a warning, intact pinned
# items, and a next kernel that runs), the lambda refusal on this machine's Python and the
# small-/dev/shm test with real pinning, then benchmarks/gpu_feed.py (figures and its
# corruption check). Run it from
# anywhere in a checkout on a machine with CUDA:
#
#     bash benchmarks/gpu_device_check.sh
#
# Such a machine may have Python and torch but not torchdata: carry its wheel (and a wheel
# of any other missing requirement: psutil, numpy, pytest, pytest-timeout) in .wheels/ at
# the checkout's root, fetched beforehand on a machine that can reach the package index:
#
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#         --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .wheels torchdata==0.9.0
#
# (one version of each package: two stop the install).
#
# They are installed without their dependencies into .deps/, and the checkout and .deps/
# go on PYTHONPATH: nothing is installed into the machine's own Python. Results go to
# $OUT when it is set (else benchmarks/results/). Every step runs, bounded in time; the
# exit status is that of the first step that failed. GPU_TESTS (default tests/test_gpu.py)
# and GPU_FEED_ARGS (below) change what runs; PYTHON, which interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
RESULTS=${OUT:-$ROOT/benchmarks/results}
mkdir -p "$RESULTS"
PYTHON=${PYTHON:-python3}
# One interleaved run at 8 workers, short enough for the whole script to take about three minutes.
GPU_FEED_ARGS=${GPU_FEED_ARGS:---workers 8 --seconds 1 --repetitions 2}
status=0
step() { # step NAME SECONDS COMMAND...: run it bounded, its output kept in $RESULTS/NAME.txt
    local name=$1 limit=$2
    shift 2
    echo "== $name" >&2
    timeout --kill-after=15 "$limit" "$@" 2>&1 | tee "$RESULTS/$name.txt"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc" >&2
    if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}

if compgen -G ".wheels/*.whl" >/dev/null; then
    step install 120 "$PYTHON" -m pip install --quiet --no-deps --no-index --no-compile --no-cache-dir --upgrade \
        --target .deps .wheels/*.whl
fi
export PYTHONPATH="$ROOT:$ROOT/.deps${PYTHONPATH:+:$PYTHONPATH}"

{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
    nproc
    "$PYTHON" - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
for name in ("torch", "torchdata", "numpy", "psutil", "pytest", "pytest_timeout", "dill"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "present"))
    except Exception as exc:  # a missing one is reported; the steps that need it fail and say so
        print(name, "MISSING:", type(exc).__name__, exc)
import torch
print("cuda", torch.version.cuda, "available:", torch.cuda.is_available())
EOF
} 2>&1 | tee "$RESULTS/machine.txt"

# pytest.ini's addopts ask for pytest-xdist; these runs are small and need none of it.
# shellcheck disable=SC2086  # GPU_TESTS is a list of paths
step gpu-tests 240 "$PYTHON" -m pytest -p no:cacheprovider -o addopts=-ra -m cuda ${GPU_TESTS:-tests/test_gpu.py}
# On this machine's Python, without dill: the lambda refusal; and large tensors, pinned for
# real, through a 32 MiB /dev/shm (skipped, saying why, where a mount namespace is refused).
step host-tests 300 "$PYTHON" -m pytest -p no:cacheprovider -o addopts=-ra tests/test_serialization.py tests/test_small_shm.py
# shellcheck disable=SC2086  # the arguments are words on purpose
step gpu-feed 420 "$PYTHON" benchmarks/gpu_feed.py $GPU_FEED_ARGS --out "$RESULTS"
exit "$status"
