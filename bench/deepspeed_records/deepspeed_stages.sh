#!/usr/bin/env bash
# Record real DeepSpeed 0.19.8 running examples/deepspeed_stages.py on 2 CPU ranks (gloo) into
# tests/data/deepspeed_stages_0.19.8.json: every training case (ZeRO stages 0-3; fp32, bf16,
# fp16 with dynamic and static loss scaling), two backwards before one step, bad configs and
# fp16 "auto". fz3's CI runs the same script with its import line changed and compares.
#
#     bash bench/deepspeed_records/deepspeed_stages.sh [OUT]     # needs bench/.env (bash bench/setup_env.sh); ~1 min
#
# The script runs under a small wrapper that changes two things in DeepSpeed, neither of which
# touches training numerics; the script itself stays a plain DeepSpeed script:
#   - build_shm_op -> `lambda: None` (DeepSpeed's own "op unavailable" path): skips a ~75 s JIT
#     build of a shared-memory all-reduce that only inference uses (bench/deepspeed_records/deepspeed_facts.py);
#   - CPU_Accelerator.is_fp16_supported -> True: DeepSpeed asks mkldnn whether the CPU has fast
#     fp16 (AVX512-FP16/AMX) and refuses fp16 at initialize without it ("Type fp16 is not
#     supported on your device.", runtime/engine.py _do_sanity_check), though torch computes
#     fp16 on any CPU. A first, unpatched run of one fp16 case records that refusal in
#     "harness" (on a CPU with AVX512-FP16 it would not refuse).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-tests/data/deepspeed_stages_0.19.8.json}
TMP=$(mktemp -d /tmp/deepspeed_stages.XXXXXX)
trap 'rm -rf "$TMP"' EXIT
cat > "$TMP/run.py" <<'PY'
import importlib, os, runpy, sys
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
if os.environ.get("PATCH_FP16") == "1":
    from deepspeed.accelerator import get_accelerator
    type(get_accelerator()).is_fp16_supported = lambda self: True
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
PY
run() {
  DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 bench/.env/bin/torchrun --nproc_per_node 2 "$TMP/run.py" \
    examples/deepspeed_stages.py "$@"
}
PATCH_FP16=0 run --case fp16_static_stage2 --out "$TMP/unpatched.json"
PATCH_FP16=1 run --case all --two-backwards --errors --out "$TMP/record.json"
DS_ACCELERATOR=cpu bench/.env/bin/python - "$TMP/record.json" "$TMP/unpatched.json" "$OUT" <<'PY'
import json, sys, torch
record, unpatched = (json.load(open(p)) for p in sys.argv[1:3])
record["harness"] = {
    "command": "bash bench/deepspeed_records/deepspeed_stages.sh",
    "torch_version": torch.__version__,
    "patches": ["deepspeed.comm.torch.build_shm_op = lambda: None",
                "type(get_accelerator()).is_fp16_supported = lambda self: True"],
    "mkldnn_fp16_supported_here": bool(torch.ops.mkldnn._is_mkldnn_fp16_supported()),
    "fp16_without_the_patch": unpatched["cases"]["fp16_static_stage2"].get("error"),
}
with open(sys.argv[3], "w") as f:
    json.dump(record, f, indent=1)
print(f"wrote {sys.argv[3]}")
PY
