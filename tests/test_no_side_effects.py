"""`import fz3` and `fz3.initialize` with the default Options leave the user's process as they
found it (STYLE rule 15): no import finder or path hook, no environment variable, no signal
handler, no change to torch's global switches or to the warnings and logging setup, and no
call of glibc's mallopt (the heap is the whole process's: fz3.launch.run(malloc_thresholds=True)
asks for it in the ranks it spawns, through their environment),
no file in /dev/shm (Options.shared_memory asks for the rings). Each runs in a fresh interpreter.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

SNAPSHOT = r'''
import ctypes, faulthandler, json, logging, os, signal, sys, threading, warnings
calls = []
class _Watched(ctypes.CDLL):  # every lookup of mallopt through ctypes is a call about to be made
    def __getattr__(self, name):
        if name == "mallopt":
            calls.append(name)
        return super().__getattr__(name)
ctypes.CDLL = _Watched

def shm():
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("fz3")) if os.path.isdir("/dev/shm") else []

def snapshot():
    import torch
    return {"meta_path": [type(f).__qualname__ for f in sys.meta_path], "path_hooks": len(sys.path_hooks),
            "environ": dict(os.environ),
            "signals": {s.name: repr(signal.getsignal(s)) for s in signal.valid_signals()
                        if isinstance(s, signal.Signals) and s not in (signal.SIGKILL, signal.SIGSTOP)},
            "torch": [torch.get_num_threads(), str(torch.get_default_dtype()), torch.is_grad_enabled(),
                      torch.are_deterministic_algorithms_enabled(), torch.get_float32_matmul_precision()],
            "warnings": len(warnings.filters), "excepthooks": [repr(sys.excepthook), repr(threading.excepthook)],
            "logging": [logging.getLogger().level, len(logging.getLogger().handlers)],
            "faulthandler": faulthandler.is_enabled(), "recursion": sys.getrecursionlimit(),
            "mallopt": list(calls), "shm": shm()}
'''


def _run(code: str) -> dict:
    r = subprocess.run([sys.executable, "-c", SNAPSHOT + code], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "FZ3_DEVICE": "cpu"})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _differences(before: dict, after: dict) -> dict:
    out = {k: (before[k], after[k]) for k in before if before[k] != after[k] and k != "environ"}
    env = {k: (before["environ"].get(k), after["environ"].get(k))
           for k in set(before["environ"]) | set(after["environ"]) if before["environ"].get(k) != after["environ"].get(k)}
    return {**out, **({"environ": env} if env else {})}


def test_import_fz3_changes_nothing_outside_fz3():
    out = _run("import torch\n"
               "try:  # what fz3.hf works with (a Trainer's script imports them) changes the process itself\n"
               "    import accelerate.optimizer, transformers.integrations.deepspeed, transformers.trainer\n"
               "except ImportError:\n    pass\n"
               "before = snapshot()\n"
               "import fz3, fz3.deepspeed, fz3.hf, fz3.testing\n"
               "for name in fz3.__all__:\n    getattr(fz3, name)\n"
               "print(json.dumps([before, snapshot()]))")
    assert _differences(*out) == {}


def test_initialize_and_training_with_the_default_options_change_nothing_outside_fz3():
    """One thread rank and two; a forward, backward and step each."""
    out = _run("import torch\n"
               "torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))])  # torch's first optimizer imports dynamo\n"
               "before = snapshot()\n"
               "import fz3\nfrom fz3 import launch\n"
               "def train(rank=0, world=1):\n"
               "    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))\n"
               "    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters()), fz3.Config())\n"
               "    engine.backward(engine(torch.ones(2, 8)).square().mean())\n"
               "    engine.step()\n"
               "launch.run_threads(train, 1)\n"
               "launch.run_threads(train, 2)\n"
               "print(json.dumps([before, snapshot()]))")
    assert _differences(*out) == {}


def test_the_snapshot_sees_what_it_guards():
    """The checks above can fail: a mallopt call, a file in /dev/shm, a finder, an environment
    variable or a signal handler show."""
    out = _run("import torch\n"
               "torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))])\n"
               "before = snapshot()\n"
               "import fz3\nfrom fz3 import launch\n"
               "ctypes.CDLL(None).mallopt(-3, 1 << 25)\n"
               "open('/dev/shm/fz3-seen', 'w').close()\n"
               "class Finder:\n    def find_spec(self, *a):\n        return None\n"
               "sys.meta_path.append(Finder()); os.environ['FZ3_SEEN'] = '1'; signal.signal(signal.SIGUSR1, print)\n"
               "print(json.dumps([before, snapshot()]))")
    os.unlink("/dev/shm/fz3-seen")
    assert set(_differences(*out)) == {"mallopt", "shm", "meta_path", "environ", "signals"}, _differences(*out)
