#!/usr/bin/env bash
# Runs the GPU tests and/or benchmarks on the GPU machine (the `device` tool), from the repo root with .gpu carried
# (see ../shared/gpu/prepare.sh):   bash tools/run_gpu_suite.sh [tests|bench|kernels|step|profile|qad|all] [args]
# tests: the GPU tests (extra args go to pytest); bench: the kernel and TE GroupedLinear benchmarks (kernels: the
# kernel benchmark alone, extra args go to tools/bench_expert_fake_quant.py); step: the whole
# Megatron step benchmark (extra args go to tools/bench_megatron_step.py); profile: its GPU time by kernel category
# (extra args go to tools/profile_megatron_step.py); qad: the QAD study (extra args go to
# tools/bench_qat_recovery.py --gpu --study, e.g. --budget 360 --json "$OUT/qad.json"); all: tests and bench.
# Installs this package (not editable: plugins/ maps to modelopt_moe.plugins) into a scratch dir and runs from
# outside the checkout so that the installed copy is the one imported. Logs go to $OUT when set.
set -o pipefail
source .gpu/setup.sh || exit 1
root=$PWD
scratch=$(mktemp -d)
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target "$scratch/pkg" . >/dev/null || exit 1
export PYTHONPATH="$scratch/pkg:${PYTHONPATH#"$root":}"
out=${OUT:-$scratch}
what=${1:-all}
shift || true
cd "$scratch" || exit 1
status=0
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -c "$root/pyproject.toml" --rootdir "$root" -m gpu -q -p no:cacheprovider -o addopts="" \
    "$root/tests/gpu" "$@" 2>&1 | tee "$out/gpu_tests.log" | grep -vE "Warning|warnings.warn|^\s*$" | tail -40
  status=${PIPESTATUS[0]}
fi
if [[ $what == bench || $what == all || $what == kernels ]]; then
  [[ $what == kernels ]] || set --   # extra args of the other modes are not this script's
  python3 "$root/tools/bench_expert_fake_quant.py" "$@" 2>&1 | tee "$out/bench_expert_fake_quant.log" | tail -35
  status=${PIPESTATUS[0]}
fi
if [[ $what == bench || $what == all ]]; then
  python3 "$root/tools/bench_te_grouped_step.py" 2>&1 | tee "$out/bench_te_grouped_step.log" | tail -15
fi
if [[ $what == step ]]; then
  python3 "$root/tools/bench_megatron_step.py" "$@" 2>&1 | tee "$out/bench_megatron_step.log" | tail -40
  status=${PIPESTATUS[0]}
fi
if [[ $what == qad ]]; then
  python3 "$root/tools/bench_qat_recovery.py" --gpu --study "$@" 2>&1 | tee "$out/qad_study.log" | grep -v -i warn
  status=${PIPESTATUS[0]}
fi
if [[ $what == profile ]]; then
  python3 "$root/tools/profile_megatron_step.py" "$@" 2>&1 | tee "$out/profile_megatron_step.log" | tail -90
  status=${PIPESTATUS[0]}
fi
exit $status
