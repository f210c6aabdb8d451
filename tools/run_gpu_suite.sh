#!/usr/bin/env bash
# The GPU tests and benchmarks, on a machine with a CUDA GPU and the package's dependencies installed as the README
# says ("Tests": torch with CUDA, Megatron-Core, Triton, Transformer Engine, the export and dev extras). From the
# repository root:
#   bash tools/run_gpu_suite.sh [tests|bench|kernels|grouped|step|profile|qad|teacher|all] [args]
# tests: the GPU tests (marker `gpu`, in tests/gpu and tests/tools; extra args go to pytest); bench: the kernel and
# TE GroupedLinear benchmarks (kernels: the kernel benchmark alone, extra args go to
# tools/bench_expert_fake_quant.py); grouped: the TE GroupedLinear benchmark alone (extra args go to
# tools/bench_te_grouped_step.py); step: the whole Megatron step benchmark (extra args go to
# tools/bench_megatron_step.py); profile: its GPU time by kernel category (extra args go to
# tools/profile_megatron_step.py); qad: the QAD study (extra args go to tools/bench_qat_recovery.py --gpu --study,
# e.g. --budget 360 --json "$OUT/qad.json"); teacher: the QAD teacher's memory per GPU (extra args go to
# tools/teacher_memory.py --device cuda); all: tests and bench.
# Installs this package (a plain copy, no dependencies) into a temporary directory and runs from outside the checkout,
# so that the copy a user's `pip install` gives is the one imported. Logs go to $OUT when set; $PYTHON picks the
# interpreter (default python3).
set -o pipefail
PYTHON=${PYTHON:-python3}
"$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'run_gpu_suite.sh: no CUDA GPU')" || exit 1
root=$PWD
if [[ ! -f $root/pyproject.toml || ! -d $root/tools ]]; then
  echo "run_gpu_suite.sh: run it from the repository root" >&2
  exit 1
fi
scratch=$(mktemp -d)
"$PYTHON" -m pip install -q --no-deps --no-build-isolation --no-compile --target "$scratch/pkg" . >/dev/null || exit 1
export PYTHONPATH="$scratch/pkg${PYTHONPATH:+:$PYTHONPATH}"
out=${OUT:-$scratch}
what=${1:-all}
shift || true
cd "$scratch" || exit 1
status=0
if [[ $what == tests || $what == all ]]; then
  "$PYTHON" -m pytest -c "$root/pyproject.toml" --rootdir "$root" -m gpu -q -p no:cacheprovider -o addopts="" \
    "$root/tests/gpu" "$root/tests/tools" "$@" 2>&1 | tee "$out/gpu_tests.log" | grep -vE "Warning|warnings.warn|^\s*$" | tail -40
  status=${PIPESTATUS[0]}
fi
if [[ $what == bench || $what == all || $what == kernels ]]; then
  [[ $what == kernels ]] || set --   # extra args of the other modes are not this script's
  "$PYTHON" "$root/tools/bench_expert_fake_quant.py" "$@" 2>&1 | tee "$out/bench_expert_fake_quant.log" | tail -35
  status=${PIPESTATUS[0]}
fi
if [[ $what == bench || $what == all || $what == grouped ]]; then
  [[ $what == grouped ]] || set --
  "$PYTHON" "$root/tools/bench_te_grouped_step.py" "$@" 2>&1 | tee -a "$out/bench_te_grouped_step.log" | tail -30
  status=${PIPESTATUS[0]}
fi
if [[ $what == step ]]; then
  "$PYTHON" "$root/tools/bench_megatron_step.py" "$@" 2>&1 | tee "$out/bench_megatron_step.log" | tail -40
  status=${PIPESTATUS[0]}
fi
if [[ $what == qad ]]; then
  "$PYTHON" "$root/tools/bench_qat_recovery.py" --gpu --study "$@" 2>&1 | tee "$out/qad_study.log" | grep -v -i warn
  status=${PIPESTATUS[0]}
fi
if [[ $what == teacher ]]; then
  "$PYTHON" "$root/tools/teacher_memory.py" --device cuda "$@" 2>&1 | tee "$out/teacher_memory.log" | grep -v -i warn
  status=${PIPESTATUS[0]}
fi
if [[ $what == profile ]]; then
  "$PYTHON" "$root/tools/profile_megatron_step.py" "$@" 2>&1 | tee "$out/profile_megatron_step.log" | tail -90
  status=${PIPESTATUS[0]}
fi
exit $status
