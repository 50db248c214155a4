#!/usr/bin/env bash
# The CUDA/NCCL check, prepared for the day a GPU is lent (issue #27 point 6, #48 point 5): one
# command that writes what it saw to files; 281 s on one H200 on 2026-12-04 with three systems
# (bench/RESULTS.md), about 8 minutes expected with the five eager ones now (not yet timed).
# Then, in a second call, `bench/gpu.sh --compiled` for the compiled rows.
#
#   bench/gpu.sh [--out DIR] [--cpu] [--quick] [--compiled]
#
#   1. installs what the machine lacks: the wheels carried in .whl/ (optree, safetensors, ...;
#      see /work/.library/device/README.md) into /tmp/site, and puts this checkout on PYTHONPATH
#   2. DIR/env.txt: the GPU, driver, torch, CUDA and NCCL versions, fz3's device and backend pick
#   3. DIR/parity.txt (+ parity.xml): the parity suite (tests/test_parity.py) at world 1 on the
#      device, fz3 against single-process training (one GPU cannot host two NCCL ranks)
#   4. DIR/steps.md (+ steps.json): bench/gpu_steps.py, fz3 (default, every param sharded, the
#      optimizer and params offloaded to the host) against DDP and FSDP2 on the device (the deep
#      narrow and the small GPTs): step time, peak device memory, the ops a steady step launches
#      and its host syncs; a torch.profiler trace of one step of fz3 (every param sharded, foreach
#      and fused AdamW) and FSDP2 (DIR/trace-*.json) and the share of its communication hidden
#      behind compute
#
#   --out DIR   where the files go (default: $OUT if set, else bench/out/gpu)
#   --cpu       the CPU half (FZ3_DEVICE=cpu, gloo): what CI runs (tests/test_gpu_script.py)
#   --quick     one parity case and a 2-step table (the CPU half's size)
#   --compiled  no parity; DIR/compiled/steps.md: fz3, DDP and FSDP2 eager and with their blocks
#               compiled (inductor), one round each
# Exit status: 0 when the parity cases passed and the table was written; 2 on a usage error.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; }
out="${OUT:-bench/out/gpu}"; device=cuda; quick=0; compiled=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) [ $# -ge 2 ] || { echo "bench/gpu.sh: --out needs a folder" >&2; exit 2; }; out="$2"; shift 2 ;;
    --cpu) device=cpu; shift ;;
    --quick) quick=1; shift ;;
    --compiled) compiled=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "bench/gpu.sh: unknown argument '$1' (allowed: --out DIR, --cpu, --quick, --compiled, --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$out" || { echo "bench/gpu.sh: cannot create --out folder '$out'" >&2; exit 2; }
export PYTHONUNBUFFERED=1 FZ3_DEVICE="$device"

# 1. what the machine lacks (the wheels are the device's: --cpu runs in this checkout's own env)
if [ "$device" = cuda ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "bench/gpu.sh: installing the carried wheels failed" >&2; exit 1; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# 2. the machine
{
  date -u +%FT%TZ; echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "nccl", torch.cuda.nccl.version())
import importlib.util
missing = [m for m in ("optree", "safetensors", "numpy", "pytest", "hypothesis") if importlib.util.find_spec(m) is None]
if missing:
    raise SystemExit(f"missing on this machine: {missing}; carry their wheels in .whl/ (/work/.library/device/README.md)")
from fz3.shell.pick import pick_device
d = pick_device()
print("fz3 picks", d.torch_device, "backend", d.backend)
PY
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
if grep -q "^missing on this machine" "$out/env.txt"; then echo "bench/gpu.sh: stopped, see $out/env.txt" >&2; exit 1; fi

# 3. parity at world 1 on the device (not with --compiled: the first call ran it)
if [ "$compiled" = 1 ]; then
  parity=0
else
  mapfile -t cases < <(python3 -m pytest --collect-only -q -p no:cacheprovider tests/test_parity.py 2>/dev/null | grep '\[1\]$')
  if [ "${#cases[@]}" -gt 0 ] && [ "$quick" = 1 ]; then cases=("${cases[0]}"); fi
  if [ "${#cases[@]}" = 0 ]; then
    echo "bench/gpu.sh: no world-1 parity case collected" > "$out/parity.txt"; parity=1
  else
    python3 -m pytest -q -p no:cacheprovider "${cases[@]}" --junitxml="$out/parity.xml" > "$out/parity.txt" 2>&1
    parity=$?
  fi
  tail -n 3 "$out/parity.txt"
fi

# 4. the step table
if [ "$quick" = 1 ]; then sizes=(--models deep --rounds 1 --warmup 1 --steps 2); else sizes=(--rounds 2 --warmup 5 --steps 20); fi
if [ "$compiled" = 1 ]; then
  out="$out/compiled"; mkdir -p "$out"
  sizes+=(--systems fz3,ddp,fsdp2,fz3-compiled,ddp-compiled,fsdp2-compiled --rounds 1)
else
  sizes+=(--systems eager --trace)
fi
python3 bench/gpu_steps.py --device "$device" "${sizes[@]}" --out "$out" > "$out/steps.log" 2>&1
steps=$?
tail -n 8 "$out/steps.log"

echo "bench/gpu.sh: parity exit $parity, steps exit $steps; files in $out"
[ "$parity" = 0 ] && [ "$steps" = 0 ]
