#!/usr/bin/env bash
# The GPU check in one command (docs/gpu.md): `task=plan` first, alone on the GPU, so the hardware profile (the CUDA
# context above all) is measured by a process that shares the GPU with no other; then `recipe=bench_gpu` (Phi-4
# under a 4 GB budget, generation, accelerate, the runner's overhead: the headline figures); then the GPU tests with
# what is left. Each part runs under its own time limit, so one that hangs still leaves the others' figures.
# Usage, from the checkout's root:
#   bash scripts/gpu_check.sh [folder]       # logs, bench_gpu's metrics.json, tests.xml and summary.txt go there
#   GPU_CHECK_S=900 bash scripts/gpu_check.sh   # the whole check's seconds (default 480)
#   GPU_CHECK_BENCH_S=400 ...                   # bench_gpu's share of them (default 330)
# The split comes from a count of what each part starts (not a measurement): the GPU tests run 17 run.py processes
# (7 strategies of 20 steps, the sharded strategies' resumes, ZeRO-3 offload building its CPU Adam on first use),
# some 300 s, more than fits beside bench_gpu in 8 minutes. bench_gpu starts one process that builds Phi-4's store
# (22 s on an H200), steps, generates and runs accelerate (its 0.21 and 1.64 tokens/s are some 80 s of generation
# besides the de-quantized copy), and two child runs of at least 60 s each. So the headline goes first with 330 s
# and the tests get the rest (some 90 s of 480 after task=plan: the in-process tests and a few runs). For all of
# them give GPU_CHECK_S=780, or run `python -m pytest -m gpu` by itself. The tests log each test's name and
# outcome as it ends (-v), and their stop at the limit (SIGTERM) is a KeyboardInterrupt to pytest, after which it
# writes tests.xml (--junitxml) and its summary: a test run cut short still names what passed and failed (the
# tests it did not finish are those of pytest's "collected N items" that tests.xml lacks).
# bench_vision's images: .gpu_data/cifar10-jpeg.tar.gz inside the checkout where it is there (a device copy holds
# the checkout alone; GPU_CHECK_VISION names another file), else task.vision_source's default: see docs/gpu.md.
set -uo pipefail
out=${1:-outputs/gpu_check}
python=${PYTHON:-python}
total=${GPU_CHECK_S:-480}
bench_share=${GPU_CHECK_BENCH_S:-330}
vision=${GPU_CHECK_VISION:-.gpu_data/cifar10-jpeg.tar.gz}
mkdir -p "$out"
if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "No CUDA GPU is visible to $python, and the GPU check needs one: see CUDA_VISIBLE_DEVICES and nvidia-smi." >&2
  exit 1
fi
"$python" -c "import torch; p = torch.cuda.get_device_properties(0); print(f'{p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}')" \
  | tee "$out/summary.txt"

failed=0
part() {  # name, seconds at most, command...: SIGTERM at the limit (a run records itself), SIGKILL 20 s later
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  timeout --kill-after=20 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || failed=$((failed + 1))
  echo "$name: exit $rc in $((SECONDS - start)) s$([ $rc -eq 124 ] && echo " (past its ${limit} s)")" | tee -a "$out/summary.txt"
  tail -n 3 "$out/$name.log" | sed 's/^/  /' | tee -a "$out/summary.txt"
}

part plan 90 "$python" run.py task=plan hydra.run.dir="$out/plan"
# the bench keeps to task.time_limit_s itself (each phase after the Phi-4 steps starts only within it), so its
# metrics.json is written; the script's stop 30 s later is for a bench that hangs
bench_s=$((total - SECONDS - 60 < bench_share ? total - SECONDS - 60 : bench_share))
bench_s=$((bench_s < 60 ? 60 : bench_s))
source_args=()
if [ -e "$vision" ]; then
  source_args=("task.vision_source=$(cd "$(dirname "$vision")" && pwd)/$(basename "$vision")")
fi
part bench_gpu $((bench_s + 30)) "$python" run.py recipe=bench_gpu task.time_limit_s=$bench_s \
  ${source_args[@]+"${source_args[@]}"} hydra.run.dir="$out/bench_gpu"
left=$((total - SECONDS))
left=$((left < 60 ? 60 : left))
# pytest ends on a KeyboardInterrupt with its report and summary, but is killed by a SIGTERM without them
pytest_on_term='import signal, sys, pytest; signal.signal(signal.SIGTERM, signal.default_int_handler); sys.exit(pytest.main())'
part tests "$left" "$python" -c "$pytest_on_term" -m gpu -v -rA -p no:cacheprovider --junitxml="$out/tests.xml"
exit $((failed > 0))
