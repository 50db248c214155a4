#!/usr/bin/env bash
# Create bench/.env: the peers' environment for bench/compare.py (never a dependency of fz3).
#
#     bash bench/setup_env.sh          # idempotent: does nothing if bench/.env is complete
#
# torch is pinned (an unpinned one pulls a CUDA build); DeepSpeed is an sdist, built without
# ops (DS_BUILD_OPS=0: ZeRO-3 on CPU needs none of them). fz3 itself goes in editable.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV=bench/.env
TORCH=2.13.0
DEEPSPEED=0.19.8
if [ -x "$ENV/bin/python" ] && "$ENV/bin/python" - <<PY 2>/dev/null
import importlib.metadata as m, sys
ok = m.version("torch").startswith("$TORCH") and m.version("deepspeed") == "$DEEPSPEED"
import fz3, deepspeed, transformers  # noqa: F401
sys.exit(0 if ok else 1)
PY
then
  echo "bench/.env ready (torch $TORCH, deepspeed $DEEPSPEED, transformers)"
  exit 0
fi
python3 -m venv "$ENV"
"$ENV/bin/pip" install -q "torch==$TORCH"
# deepspeed's setup.py imports torch, hence no build isolation; the rest are its runtime deps.
DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "$ENV/bin/pip" install -q --no-build-isolation "deepspeed==$DEEPSPEED"
"$ENV/bin/pip" install -q -e '.[hf]'  # transformers: bench/links.py's 7 B Llama on the meta device
"$ENV/bin/python" -c "import torch, deepspeed, fz3; print('bench/.env:', torch.__version__, deepspeed.__version__)"
