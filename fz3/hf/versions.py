"""The transformers and accelerate fz3.hf was written against, checked before either is imported.

fz3.hf.Trainer answers the Trainer's calls where transformers wires DeepSpeed (fz3/hf/trainer.py:
`_prepare_for_training`, `training_step`, `_save_optimizer_and_scheduler`, ...), private methods
that change between major versions. It was written against transformers 5.24 and is tested with
the versions in TESTED (the `hf` extra installs them). A major version below SUPPORTED's is an
ImportError naming it; one above, which fz3 has never run, is a warning once per process.
"""
from __future__ import annotations

import re
import warnings
from importlib import metadata

TESTED = {"transformers": "5.25.0", "accelerate": "1.16.0"}  # tests/test_hf*.py ran with these
SUPPORTED = {"transformers": (5, 5), "accelerate": (1, 1)}  # (lowest major, highest major) known to work


def major(version: str) -> int:
    m = re.match(r"\d+", version)
    if m is None:
        raise ImportError(f"fz3.hf: cannot read the version {version!r}")
    return int(m.group(0))


def check(installed=metadata.version) -> None:
    """Raise ImportError for a package older than fz3.hf supports; warn for one newer than it knows."""
    for name, (low, high) in SUPPORTED.items():
        try:
            version = installed(name)
        except metadata.PackageNotFoundError:
            raise ImportError(f"fz3.hf needs {name} (the `hf` extra: pip install -e '.[hf]' from fz3's "
                              f"clone; tested with {name} {TESTED[name]})") from None
        if major(version) < low:
            raise ImportError(f"fz3.hf was written against {name} {low}.x (tested with {TESTED[name]}); this "
                              f"environment has {name} {version}. Install {name}>={low},<{high + 1} "
                              "(pip install -e '.[hf]' from fz3's clone)")
        if major(version) > high:
            warnings.warn(f"fz3.hf was written against {name} {high}.x (tested with {TESTED[name]}); this "
                          f"environment has {name} {version}, which fz3 has never run. If the Trainer "
                          f"fails inside fz3/hf, install {name}<{high + 1}", stacklevel=3)
