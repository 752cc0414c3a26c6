#!/usr/bin/env bash
# Verifies megatron-eopt on a GPU machine without network access (Python 3.12, a preinstalled
# CUDA torch, nvcc, pytest, cmake, ninja): builds the extension for sm_90 against that torch,
# runs the whole test suite (GPU-marked tests included), the full CUDA benchmark and the training
# example, and leaves everything in OUT_DIR.
#
#   scripts/gpu_verify.sh OUT_DIR [build] [tests] [bench] [example]     (no step named: all four)
#
# Steps for a short GPU run, named explicitly (each also in "bench" or "tests" where noted):
#   gputests    the doctor and the GPU-marked tests only, one pytest per target of GPU_VERIFY_TESTS
#               (test files or folders, in the order given; default tests/python) so that each
#               target's failures come with their tracebacks; GPU_VERIFY_TESTS_TIMEOUT: seconds for
#               all of them (default none); GPU_VERIFY_PYTEST_ARGS: more pytest arguments (e.g. -n 8)
#   table       benchmarks/run.py alone (part of bench; GPU_VERIFY_BENCH_ARGS)
#   memory      benchmarks/step_memory.py alone (part of bench; GPU_VERIFY_MEMORY_ARGS)
#   symmetric   benchmarks/run.py on the Newton-Schulz and large step workloads with the opt-in
#               symmetric products (GPU_VERIFY_SYMMETRIC, default 4:1024), into RESULTS.md's own section
#   algorithms  benchmarks/ns_algorithms.py (algorithm and symmetric-product crossovers) and
#               benchmarks/op_overhead.py --profile (host time per call)
#   syrk        benchmarks/run.py on the Newton-Schulz workloads alone, whose peer rows include
#               Emerging-Optimizers' newton_schulz(use_syrk=True) (its Triton SYRK kernel, in 0.3.0
#               from the extra wheels: CUDA, "medium", 2-D matrices) (GPU_VERIFY_SYRK_WORKLOADS,
#               default ns_1024x1024 ns_4096x4096 ns_8192x8192 ns_4096x11008; a partial section)
#   inplace     benchmarks/step_memory.py with the in-place Newton-Schulz switched on for CUDA next
#               to the default (rows "ours" and "ours-inplace"; GPU_VERIFY_INPLACE_SETS)
#
# OUT_DIR receives, by the steps run: summary.txt (environment, the doctor self-test, one line per
# step), build.log, pytest.log, bench*.log (one per benchmark step), bench_cuda.json, RESULTS.md
# (benchmarks/RESULTS.md with this GPU's sections added), train_gpt.log, train_gpt_loss.png.
#
# Extra wheels (emerging-optimizers, absl-py, megatron-core, typing_extensions, expecttest,
# gram-newton-schulz (a benchmark peer); see
# scripts/fetch_gpu_wheels.sh) are installed from .whl/ at the repository root when it exists,
# into /tmp/site (put on PYTHONPATH), never into the machine's site-packages.
#
# The build is the developer build (build/gpu-verify, library copied into megatron_eopt/), so the
# steps can be split over several commands on the same machine, e.g. "build tests", then
# "bench example". Every step runs even when an earlier one failed.
#
# Environment: PYTHON (default python3), MEGATRON_EOPT_CUDA_ARCHS (default 90),
# MEGATRON_EOPT_GIT_COMMIT (the commit to record when the checkout has no .git),
# GPU_VERIFY_BENCH_ARGS (extra run.py arguments, e.g. "--workload ns_4096x4096").
#
# Exit status: 0 all passed; 1 the build or a test failed; 3 build and tests passed but the
# benchmark or the example reported an error.
set -uo pipefail

OUT=${1:?usage: scripts/gpu_verify.sh OUT_DIR [build] [tests] [bench] [example]}
shift
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(build tests bench example)
for s in "${STEPS[@]}"; do
  case $s in
    build | tests | bench | example | gputests | table | memory | symmetric | algorithms | syrk | inplace) ;;
    *) echo "gpu_verify.sh: unknown step '$s' (build, tests, bench, example, gputests, table, memory, symmetric," \
         "algorithms, syrk, inplace)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
ROOT=$PWD

PY=$(command -v "${PYTHON:-python3}")
ARCHS=${MEGATRON_EOPT_CUDA_ARCHS:-90}
BUILD_DIR=build/gpu-verify
SUMMARY=$OUT/summary.txt
export PYTHONUNBUFFERED=1
: >"$SUMMARY"

say() { echo "$*" | tee -a "$SUMMARY"; }
want() { local s; for s in "${STEPS[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

failed_core=0   # build or tests
failed_extra=0  # benchmark or example

# ------------------------------------------------------------------ environment
say "== megatron-eopt GPU verification, $(date -u '+%Y-%m-%d %H:%M UTC'), steps: ${STEPS[*]}"
if [ -z "${MEGATRON_EOPT_GIT_COMMIT:-}" ] && git -C "$ROOT" rev-parse HEAD >/dev/null 2>&1; then
  export MEGATRON_EOPT_GIT_COMMIT=$(git -C "$ROOT" rev-parse --short=12 HEAD)
fi
say "commit: ${MEGATRON_EOPT_GIT_COMMIT:-unknown (no .git; set MEGATRON_EOPT_GIT_COMMIT)}"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || echo "nvidia-smi failed"
  (nvcc --version 2>/dev/null || /usr/local/cuda/bin/nvcc --version 2>&1) | tail -1
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| device', torch.cuda.get_device_name() if torch.cuda.is_available() else 'NONE')" 2>&1
} | tee -a "$SUMMARY"

SITE=/tmp/site
if [ -d "$ROOT/.whl" ] && ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
  # One at a time, so that a wheel this Python cannot take does not keep the others out.
  for wheel in "$ROOT"/.whl/*.whl; do
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$wheel" >>"$SUMMARY" 2>&1; then
      say "wheel: installed $(basename "$wheel") into $SITE"
    else
      say "wheel: FAILED to install $(basename "$wheel") (see above); tests needing it will fail or skip"
    fi
  done
else
  say "wheels: no .whl/ folder; emerging-optimizers / megatron-core must already be importable"
fi
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"

# ------------------------------------------------------------------ build
build() {
  export CUDACXX=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
  # The machine's default compiler (CXX, else g++) may lack a shared libstdc++, which
  # CMakeLists.txt refuses: take the system's compiler then.
  local cxx=${CXX:-g++}
  if [[ "$("$cxx" -print-file-name=libstdc++.so 2>/dev/null)" != /* ]] && [ -x /usr/bin/g++ ]; then
    say "compiler: $cxx has no shared libstdc++; building with /usr/bin/g++"
    export CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
  fi
  local log=$OUT/build.log tests=ON
  local common=(-S . -B "$BUILD_DIR" -G Ninja -DMEGATRON_EOPT_BUILD_EXTENSION=ON -DMEGATRON_EOPT_CUDA=ON
                "-DMEGATRON_EOPT_CUDA_ARCHS=$ARCHS" "-DPython_EXECUTABLE=$PY")
  {
    echo "== configure (GoogleTest suite on)"
    if ! cmake "${common[@]}" -DMEGATRON_EOPT_BUILD_TESTS=ON; then
      echo "== configure again without the GoogleTest suite (GoogleTest not installed here?)"
      rm -rf "$BUILD_DIR"
      tests=OFF
      cmake "${common[@]}" -DMEGATRON_EOPT_BUILD_TESTS=OFF || return 1
    fi
    echo "== build"
    cmake --build "$BUILD_DIR" -j "$(nproc)" || return 1
  } >>"$log" 2>&1 || { say "build: FAILED (see build.log)"; return 1; }
  if ! "$PY" -c "import megatron_eopt as me, sys; sys.exit(0 if me.cuda_kernels_built() else 1)" >>"$log" 2>&1; then
    say "build: FAILED: the library imports without its CUDA kernels (see build.log)"
    return 1
  fi
  say "build: ok (sm_$ARCHS, $(ls megatron_eopt/_C*.so))"
  if [ "$tests" = ON ]; then
    if ctest --test-dir "$BUILD_DIR" --output-on-failure >>"$log" 2>&1; then
      say "ctest: ok ($(grep -E 'tests passed|tests failed' "$log" | tail -1))"
    else
      say "ctest: FAILED (see build.log)"
      return 1
    fi
  else
    say "ctest: not run (GoogleTest is not installed on this machine; CI runs it)"
  fi
}

if want build; then
  build || failed_core=1
elif ! "$PY" -c "import megatron_eopt as me, sys; sys.exit(0 if me.cuda_kernels_built() else 1)" >/dev/null 2>&1; then
  # None in megatron_eopt/, or ones built elsewhere that do not load here.
  say "build: no loadable CUDA library in megatron_eopt/, building first"
  build || failed_core=1
else
  say "build: using the libraries in megatron_eopt/ ($("$PY" -c "import megatron_eopt._library as l; print(l.build_info())" 2>&1))"
fi

# ------------------------------------------------------------------ tests
if want tests || want gputests; then
  # The self-test users run first on a new GPU: build facts and every op against the CPU path.
  "$PY" -m megatron_eopt.doctor 2>&1 | tee -a "$SUMMARY"
  if [ "${PIPESTATUS[0]}" -eq 0 ]; then say "doctor: ok"; else say "doctor: FAILED (see above)"; failed_core=1; fi
  if want tests; then
    "$PY" -m pytest tests/python -v -rfEs -p no:cacheprovider >"$OUT/pytest.log" 2>&1
    rc=$?
    result=$(tail -1 "$OUT/pytest.log")
  else
    # One pytest per target, in the order given, so that each file's failures are printed with
    # their tracebacks even when a later one runs out of the time limit.
    deadline=$((SECONDS + ${GPU_VERIFY_TESTS_TIMEOUT:-86400}))
    rc=0
    result=""
    : >"$OUT/pytest.log"
    for target in ${GPU_VERIFY_TESTS:-tests/python}; do
      left=$((deadline - SECONDS))
      if [ $left -le 0 ]; then
        echo "== $target: not run (time limit)" >>"$OUT/pytest.log"
        result="$result $target: not run;"
        rc=124
        continue
      fi
      echo "== $target" >>"$OUT/pytest.log"
      # shellcheck disable=SC2086
      timeout "$left" "$PY" -m pytest "$target" -m gpu -v -rfEs -p no:cacheprovider ${GPU_VERIFY_PYTEST_ARGS:-} \
        >>"$OUT/pytest.log" 2>&1
      r=$?
      result="$result $(basename "$target"): $(tail -1 "$OUT/pytest.log" | tr -d '=');"
      if [ $r -ne 0 ] && [ $r -ne 5 ]; then rc=$r; fi  # 5: no GPU-marked test in the target
    done
  fi
  # "SKIPPED [N] file:line: needs a CUDA device": must be none on a GPU machine.
  no_gpu=$(awk '/^SKIPPED \[[0-9]+\].*needs a CUDA device/ {gsub(/[^0-9]/, "", $2); s += $2} END {print s + 0}' "$OUT/pytest.log")
  say "tests: $(grep -c -E '(cuda|gpu).* PASSED' "$OUT/pytest.log") passed with cuda/gpu in their id; ${no_gpu:-0} skipped for want of a CUDA device"
  if [ $rc -eq 0 ]; then
    say "tests: ok: $result"
  else
    say "tests: FAILED (pytest exit $rc): $result (see pytest.log)"
    grep -E '^(FAILED|ERROR) ' "$OUT/pytest.log" | head -40 | tee -a "$SUMMARY"
    failed_core=1
  fi
fi

# ------------------------------------------------------------------ benchmark
# bench_step WHAT LOG COMMAND...: runs COMMAND into OUT/LOG and says whether it succeeded.
bench_step() {
  local what=$1 log=$2
  shift 2
  if "$@" >"$OUT/$log" 2>&1; then say "$what: ok ($log)"; else say "$what: FAILED (see $log)"; failed_extra=1; fi
}
if want bench || want table || want memory || want symmetric || want algorithms || want syrk || want inplace; then
  [ -f benchmarks/RESULTS.md ] && cp benchmarks/RESULTS.md "$OUT/RESULTS.md"
fi
if want bench || want table; then
  # shellcheck disable=SC2086
  "$PY" benchmarks/run.py --device cuda --out "$OUT/bench_cuda.json" --results-md "$OUT/RESULTS.md" \
    ${GPU_VERIFY_BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then
    say "bench: ok (table in bench.log, section in RESULTS.md, samples in bench_cuda.json)"
  else
    say "bench: exit $rc: some measurements failed (see 'Not covered' in bench.log)"
    failed_extra=1
  fi
fi
if want symmetric; then
  bench_step "bench: symmetric products" bench_symmetric.log "$PY" benchmarks/run.py --device cuda \
    --results-md "$OUT/RESULTS.md" --symmetric-products "${GPU_VERIFY_SYMMETRIC:-4:1024}" --workload ns_1024x1024 \
    ns_4096x4096 ns_8192x8192 ns_4096x11008 ns_batch_4x4096x4096 ns_batch_128x768x2048 step_llama_1b_layer \
    step_llama_8b_4layers
fi
if want syrk; then
  # shellcheck disable=SC2086
  bench_step "bench: Newton-Schulz with Emerging-Optimizers' use_syrk" bench_syrk.log "$PY" benchmarks/run.py \
    --device cuda --results-md "$OUT/RESULTS.md" \
    --workload ${GPU_VERIFY_SYRK_WORKLOADS:-ns_1024x1024 ns_4096x4096 ns_8192x8192 ns_4096x11008}
fi
if want inplace; then
  # shellcheck disable=SC2086
  bench_step "bench: in-place Newton-Schulz step memory" bench_inplace.log "$PY" benchmarks/step_memory.py \
    --device cuda --results-md "$OUT/RESULTS.md" --impls ours ours-inplace eo --workspace-mib \
    --sets ${GPU_VERIFY_INPLACE_SETS:-llama_1b_4l qwen3_moe_8e llama_8b_4l}
fi
if want algorithms; then
  bench_step algorithms algorithms.log "$PY" benchmarks/ns_algorithms.py --device cuda --results-md "$OUT/RESULTS.md"
  bench_step overhead overhead.log "$PY" benchmarks/op_overhead.py --device cuda --profile
fi
if want bench; then
  # State bytes and speed per state_dtype (fp32 / bf16 / int8 / fp8) on GPT-2 and Llama parameter sets.
  bench_step "bench: state dtypes" bench_state_dtypes.log "$PY" benchmarks/state_dtypes.py --device cuda \
    --results-md "$OUT/RESULTS.md"
fi
if want bench || want memory; then
  # A step's peak memory next to its time, one fresh process per implementation (workspace budgets too).
  # shellcheck disable=SC2086
  bench_step "bench: step memory" bench_step_memory.log "$PY" benchmarks/step_memory.py --device cuda \
    --out "$OUT/bench_step_memory.json" --results-md "$OUT/RESULTS.md" ${GPU_VERIFY_MEMORY_ARGS:-}
fi

# ------------------------------------------------------------------ training example
if want example; then
  if "$PY" examples/train_gpt.py --device cuda --out "$OUT/train_gpt_loss.png" >"$OUT/train_gpt.log" 2>&1; then
    say "example: ok: $(grep -A2 '^final losses' "$OUT/train_gpt.log" | tail -2 | tr -s ' ' | tr '\n' ';')"
  else
    say "example: FAILED (see train_gpt.log)"
    failed_extra=1
  fi
fi

if [ $failed_core -ne 0 ]; then
  say "== RESULT: FAILED (build or tests)"
  exit 1
elif [ $failed_extra -ne 0 ]; then
  say "== RESULT: build and tests ok; benchmark or example reported errors"
  exit 3
fi
say "== RESULT: ok"
exit 0
