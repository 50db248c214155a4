"""Say in pytest's header what this run covers (CI logs are read by people)."""
import os
import platform


def pytest_report_header(config):
    import torch
    profile = os.environ.get("FZ3_HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev")
    return [f"fz3: torch {torch.__version__}, python {platform.python_version()}, "
            f"{os.cpu_count()} cpus; hypothesis profile '{profile}'",
            "fz3: tests/ = unit tests + multi-rank gloo parity (127.0.0.1, 1-3 ranks, timeouts); "
            "property_tests/ = Hypothesis state machines, properties, planted-bug checks"]
