"""fz3: ZeRO-3 as pure state transitions (fz3.core) executed by a thin PyTorch shell."""
from fz3.core.config import Config

__all__ = ["Config"]
