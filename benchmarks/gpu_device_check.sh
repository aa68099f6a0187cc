#!/usr/bin/env bash
# The checks that need a GPU, in calls that each stand alone and each end well inside
# 8 minutes, start-up of the machine aside:
#
#     bash benchmarks/gpu_device_check.sh tests     the `cuda` tests (batches dropped at once under
#                                                   slow kernels, a refused registration, a graph
#                                                   captured while another thread takes items...),
#                                                   then the lambda refusal and the small-/dev/shm
#                                                   test with real pinning
#     bash benchmarks/gpu_device_check.sh figures   benchmarks/gpu_feed.py: GB/s against the pinned
#                                                   copy limit of the same run, torch's pinned
#                                                   DataLoader beside it, the corruption checks (and
#                                                   one that must fail), the loop's step time
#     bash benchmarks/gpu_device_check.sh all       both, one after the other (no time cap)
#
# Run from anywhere in a checkout. A machine with Python and torch but no package index
# gets the rest from wheels carried in .wheels/ at the checkout's root, fetched
# beforehand where the index can be reached:
#
#     bash benchmarks/gpu_device_check.sh wheels    # DEVICE_PYTHON (default 3.12) and this Python
#
# torchdata 0.9.0 ships one wheel per Python version (cp312 is not cp311), and a few of the
# others do too (charset-normalizer); the rest are pure Python. Each call installs the
# wheels that fit its Python, without their dependencies, into .deps/, and puts the
# checkout and .deps/ on PYTHONPATH: nothing is installed into the machine's own Python.
#
#     bash benchmarks/gpu_device_check.sh dry-run   on a machine without CUDA: the wheels resolve
#                                                   for DEVICE_PYTHON, install for this Python,
#                                                   the tests run (the cuda ones skip) and the
#                                                   report is written (gpu_feed.py --check-cpu)
#
# Results go to $OUT when it is set (else benchmarks/results/), each step's output in
# NAME.txt as it runs; gpu_feed.py rewrites its report after every figure, so a call cut
# off keeps what it measured. Every step is bounded; the exit status is that of the first
# step that failed. GPU_TESTS (default tests/test_gpu.py) and GPU_FEED_ARGS change what
# runs; PYTHON, which interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
MODE=${1:-all}
RESULTS=${OUT:-$ROOT/benchmarks/results}
mkdir -p "$RESULTS"
PYTHON=${PYTHON:-python3}
DEVICE_PYTHON=${DEVICE_PYTHON:-3.12}
# What conftest.py and the suite import beyond torch and numpy (torchdata's DataPipes import requests).
WHEELS="torchdata==0.9.0 requests charset-normalizer idna urllib3 certifi pytest pluggy iniconfig packaging pytest-timeout psutil"
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
# 8 workers, 1 s per measurement, 32 and 4 MiB items, the contenders that answer the
# questions asked; --budget keeps the whole run inside the step's limit below.
GPU_FEED_ARGS=${GPU_FEED_ARGS:---workers 8 --seconds 1 --repetitions 2 --sizes 32,4 --contenders mprs_plus,mprs_plus+pin,mprs_plus+device,torch+pin --check-items 256 --budget 270}
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

fetch_wheels() { # for the device's Python and for this one: pip picks the one that fits at install
    local here
    here=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    for version in $(printf '%s\n' "$DEVICE_PYTHON" "$here" | sort -u); do
        # shellcheck disable=SC2086  # lists of words on purpose
        "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
            $PLATFORMS -d .wheels $WHEELS || return 1
    done
    ls .wheels
}

install() { # step install: the carried wheels that fit this Python, into $1
    if ! compgen -G ".wheels/*.whl" >/dev/null; then
        echo "no .wheels/: using what this Python has" | tee "$RESULTS/install.txt"
        return 0
    fi
    # shellcheck disable=SC2086  # lists of words on purpose
    step install 60 "$PYTHON" -m pip install --quiet --no-deps --no-index --no-compile --no-cache-dir --upgrade \
        --find-links .wheels --target "$1" $WHEELS
}

machine() {
    {
        date -u +%Y-%m-%dT%H:%M:%SZ
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
        nproc
        "$PYTHON" - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
for name in ("torch", "torchdata", "numpy", "psutil", "pytest", "pytest_timeout", "requests", "dill"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "present"), getattr(module, "__file__", ""))
    except Exception as exc:  # a missing one is reported; the steps that need it fail and say so
        print(name, "MISSING:", type(exc).__name__, exc)
import torch
print("cuda", torch.version.cuda, "available:", torch.cuda.is_available())
EOF
    } 2>&1 | tee "$RESULTS/machine-$MODE.txt"
}

run_tests() {
    # pytest.ini's addopts ask for pytest-xdist; these runs are small and need none of it.
    # shellcheck disable=SC2086  # GPU_TESTS is a list of paths
    step gpu-tests 210 "$PYTHON" -m pytest -p no:cacheprovider -o addopts=-ra -m cuda ${GPU_TESTS:-tests/test_gpu.py}
    # On this machine's Python, without dill: the lambda refusal; and large tensors, pinned for
    # real, through a 32 MiB /dev/shm (skipped, saying why, where a mount namespace is refused).
    step host-tests 150 "$PYTHON" -m pytest -p no:cacheprovider -o addopts=-ra tests/test_serialization.py tests/test_small_shm.py
}

run_figures() {
    # shellcheck disable=SC2086  # the arguments are words on purpose
    step gpu-feed 330 "$PYTHON" benchmarks/gpu_feed.py $GPU_FEED_ARGS --out "$RESULTS"
}

case "$MODE" in
wheels)
    fetch_wheels
    exit $?
    ;;
tests | figures | all)
    install "$ROOT/.deps"
    export PYTHONPATH="$ROOT:$ROOT/.deps${PYTHONPATH:+:$PYTHONPATH}"
    machine
    if [ "$MODE" != figures ]; then run_tests; fi
    if [ "$MODE" != tests ]; then run_figures; fi
    ;;
dry-run)
    # Would the wheels install on the device's Python? (pip resolves them for it, installs nothing.)
    # shellcheck disable=SC2086
    step resolve 60 "$PYTHON" -m pip install --dry-run --no-deps --no-index --only-binary=:all: --find-links .wheels \
        --python-version "$DEVICE_PYTHON" --implementation cp $PLATFORMS --target "$RESULTS/.resolve" $WHEELS
    install "$RESULTS/.deps-dry"
    export PYTHONPATH="$ROOT:$RESULTS/.deps-dry${PYTHONPATH:+:$PYTHONPATH}"
    machine
    run_tests
    step gpu-feed 330 "$PYTHON" benchmarks/gpu_feed.py --check-cpu --budget 120 --out "$RESULTS"
    ;;
*)
    echo "usage: bash benchmarks/gpu_device_check.sh [tests|figures|all|wheels|dry-run]" >&2
    exit 2
    ;;
esac
exit "$status"
