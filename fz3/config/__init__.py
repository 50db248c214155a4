"""fz3's configuration, pure and importable alone (no torch, nothing else of fz3's): DeepSpeed's
stage-3 knobs (`Config`, config.py; a DeepSpeed JSON dict translated by deepspeed_keys.py) and
fz3's own switches (`Options`, options.py). Every layer below the user reads it; it reads none.
"""
from fz3.config.config import Config
from fz3.config.options import Options

__all__ = ["Config", "Options"]
