"""Moved to fz3/config/config.py (the configuration is its own layer, below the core); this
path stays for imports written before the move."""
from fz3.config.config import *  # noqa: F401,F403
