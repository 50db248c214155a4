#!/usr/bin/env bash
# Record real DeepSpeed 0.19.8 running examples/deepspeed_script.py on 2 CPU ranks (gloo) into
# tests/data/deepspeed_script_0.19.8.json, the rows fz3's CI compares its own run against.
#
#     bash bench/deepspeed_records/deepspeed_script.sh          # needs bench/.env (bash bench/setup_env.sh)
#
# The first run JIT-compiles DeepSpeed's shm comm op (~75 s, cached in ~/.cache/torch_extensions);
# later runs take ~15 s. fz3 runs the same script with its first import line changed to
# `import fz3.deepspeed as deepspeed`, under .venv/bin/torchrun.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-tests/data/deepspeed_script_0.19.8.json}
CKPT=$(mktemp -d /tmp/deepspeed_script_ckpt.XXXXXX)
trap 'rm -rf "$CKPT"' EXIT
DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 bench/.env/bin/torchrun --nproc_per_node 2 \
  examples/deepspeed_script.py --deepspeed_config examples/deepspeed_config.json \
  --save_dir "$CKPT" --out "$OUT"
