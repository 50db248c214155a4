"""Say in pytest's header what this run covers (CI logs are read by people), and put examples/
on the path: the tests train the examples' GPT (examples/gpt.py, `from gpt import GPT`), and the
ranks they spawn inherit the path."""
import os
import platform
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "examples"))


def pytest_report_header(config):
    import torch
    profile = (config.getoption("hypothesis_profile", None) or os.environ.get("HYPOTHESIS_PROFILE")
               or os.environ.get("FZ3_HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))
    return [f"fz3: torch {torch.__version__}, python {platform.python_version()}, "
            f"{os.cpu_count()} cpus; hypothesis profile '{profile}'",
            "fz3: tests/ = unit tests + multi-rank gloo parity (127.0.0.1, 1-3 ranks, timeouts); "
            "property_tests/ = Hypothesis state machines, properties, planted-bug checks"]
