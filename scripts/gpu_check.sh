#!/usr/bin/env bash
# The GPU check in one command (docs/gpu.md): the GPU tests (every strategy on the default job, the streamed int8
# step against the de-quantized model, the bad inputs), then `recipe=bench_gpu` (Phi-4 under a 4 GB budget,
# generation, accelerate, the runner's overhead). Each part runs under its own time limit, so one that hangs still
# leaves the other's figures; about 8 minutes on one H100 or H200. Usage, from the checkout's root:
#   bash scripts/gpu_check.sh [folder]       # logs, bench_gpu's metrics.json and summary.txt go to the folder
set -uo pipefail
out=${1:-outputs/gpu_check}
python=${PYTHON:-python}
mkdir -p "$out"
if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "No CUDA GPU is visible to $python, and the GPU check needs one: see CUDA_VISIBLE_DEVICES and nvidia-smi." >&2
  exit 1
fi
"$python" -c "import torch; p = torch.cuda.get_device_properties(0); print(f'{p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}')" \
  | tee "$out/summary.txt"

failed=0
part() {  # name, seconds at most, command...
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || failed=$((failed + 1))
  echo "$name: exit $rc in $((SECONDS - start)) s$([ $rc -eq 124 ] && echo " (past its ${limit} s)")" | tee -a "$out/summary.txt"
  tail -n 3 "$out/$name.log" | sed 's/^/  /' | tee -a "$out/summary.txt"
}

part tests 200 "$python" -m pytest -m gpu -q -p no:cacheprovider
# the bench keeps to what is left of the check's 8 minutes itself (task.time_limit_s), so its metrics.json is written
left=$((480 - SECONDS))
part bench_gpu $((left + 30)) "$python" run.py recipe=bench_gpu task.time_limit_s=$left hydra.run.dir="$out/bench_gpu"
exit $((failed > 0))
