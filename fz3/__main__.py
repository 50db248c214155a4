"""fz3's command line.

    python -m fz3 plan MODULE:FUNCTION --world-size N [--config ds.json] [--steps K]
                       [--optimizer adamw|adam|sgd] [--backend gloo|nccl|hccl] [--device-memory 80GB]
        FUNCTION() returns (model, example_inputs); MODULE is an importable module or a .py file.
        Prints fz3.plan's table: per step and per rank, gathers, bytes moved, buckets, peak live
        params and resident bytes, without a process group (any world size on one machine).
        --config is read as fz3.deepspeed.initialize reads it, and a config whose "auto" values
        only Hugging Face's Trainer fills is filled as fz3.hf.Trainer fills it (from
        TrainingArguments' defaults; needs transformers): one reader, [Note: one reader] in
        fz3/deepspeed/settings.py. Its "optimizer" is the one whose state the plan counts
        (--optimizer then refused), its "scheduler" is checked; a line above the table says so.
    python -m fz3 timeline RUN.json RUN.png
        fz3.timeline's trace-event file drawn with matplotlib: per rank, bars for compute,
        communication and the core, and the live bytes over time.
    python -m fz3 consolidate CKPT_DIR OUT.safetensors [--tag TAG]
        A sharded checkpoint -> one fp32 safetensors file (DeepSpeed's zero_to_fp32).
    python -m fz3 check MODULE:FUNCTION [--world-sizes 1,2,3] [--examples N] [--steps K]
                        [--config ds.json] [--seed S] [--optimizer sgd|adamw|adam] [--rtol R]
                        [--atol A] [--bf16] [--no-broadcast-buffers]
        FUNCTION() returns (model, example_batches, loss_fn) or (model, example_inputs). The model
        trains under configs drawn around the given one on thread ranks and in one process, and
        fz3.check's report is printed: per example pass, or the first step and param where they
        differ, with the smallest failing config as fz3.Config(...) (docs/check.md). Exit status
        0: every example passed; 1: a failure was found, or something could not be decided.
        --config is read as for plan, its batch sizes left unchecked (several world sizes); the
        check steps --optimizer, not the config's "optimizer" (SGD shows a wrong grad scale,
        which Adam hides).
    python -m fz3 verify [--examples N] [--steps K]
                         [--machines params,grads,layout,calls,scaler,offload,verdict,streams]
                         [--profile hunt|dev|ci|nightly|mutation] [--seed S]
                         [--patch MODULE:FUNCTION=MODULE:FUNCTION ...]
        The Hypothesis machines against their naive models, N examples each (up to K rules per
        example), then what each invariant covered: checks and situations. --profile runs under
        a Hypothesis profile of fz3/testing/profiles.py (hunt: find and shrink within a minute);
        --patch replaces a function of fz3 by yours wherever fz3 binds it, for the run
        (fz3/testing/patch.py; several allowed). Exit status 1 when a property fails: FAILED and
        the shrunk case as a pytest function to paste come first (fz3/testing/verify.py,
        docs/verify.md).

Usage errors (an unknown command, a MODULE:FUNCTION that does not import or returns the wrong
thing, an invalid config, a world size < 1, for check a model that does not run on the CPU or is
too big to check here) print one line naming the value and what is allowed and exit with status
2, without a traceback.
"""
from __future__ import annotations

import argparse
import errno
import importlib
import importlib.util
import os
import re
import sys


class UsageError(Exception):
    """A bad argument: printed as one line, exit status 2."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fz3", description="fz3: ZeRO-3 as pure state transitions")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{plan,check,timeline,consolidate,verify}")
    p = sub.add_parser("plan", help="what a run will do, per step and per rank, before it runs")
    p.add_argument("target", metavar="MODULE:FUNCTION", help="FUNCTION() -> (model, example_inputs)")
    p.add_argument("--world-size", type=int, required=True, help="ranks to plan for (>= 1)")
    p.add_argument("--config", default=None, help="a DeepSpeed JSON config (default: DeepSpeed's defaults)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps to plan (default 2: the first "
                   "records the trace, the next prefetch along it)")
    p.add_argument("--optimizer", default=None, help="adamw | adam | sgd (default: the config's \"optimizer\", "
                   "else adamw)")
    p.add_argument("--backend", default=None, help="gloo | nccl | hccl (default: this machine's)")
    p.add_argument("--device-memory", default=None, metavar="BYTES", help="the memory a rank has, e.g. 80GB "
                   "(GB = 10**9, GiB = 2**30): says whether the plan fits, and if not chooses the share of the "
                   "optimizer to offload to NVMe that makes it fit")
    k = sub.add_parser("check", help="does this model train the same on N thread ranks as in one process?")
    k.add_argument("target", metavar="MODULE:FUNCTION",
                   help="FUNCTION() -> (model, example_batches, loss_fn) or (model, example_inputs)")
    k.add_argument("--world-sizes", default="1,2,3", help="comma-separated (default 1,2,3)")
    k.add_argument("--examples", type=int, default=12, help="examples to run (default 12: your config on each "
                   "world size, then drawn configs)")
    k.add_argument("--steps", type=int, default=2, help="optimizer steps per example (default 2)")
    k.add_argument("--config", default=None, help="a DeepSpeed JSON config to draw around (default: DeepSpeed's "
                   "defaults)")
    k.add_argument("--seed", type=int, default=0, help="the same seed draws the same examples (default 0)")
    k.add_argument("--optimizer", default="sgd", help="sgd (momentum 0.9, lr 1e-2) | adamw | adam (default sgd)")
    k.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance, fp32 (default 1e-5)")
    k.add_argument("--atol", type=float, default=1e-6, help="absolute tolerance, fp32 (default 1e-6)")
    k.add_argument("--bf16", action="store_true", help="also draw bf16 compute (looser tolerance)")
    k.add_argument("--no-broadcast-buffers", action="store_true",
                   help="run with fz3.Options(broadcast_buffers=False), as your training will")
    t = sub.add_parser("timeline", help="draw fz3.timeline's JSON file as a PNG (matplotlib)")
    t.add_argument("json", help="the file fz3.timeline wrote")
    t.add_argument("png", help="the picture to write")
    c = sub.add_parser("consolidate", help="a sharded checkpoint -> one fp32 safetensors file")
    c.add_argument("rest", nargs=argparse.REMAINDER)
    v = sub.add_parser("verify", help="run the Hypothesis machines; print what each invariant covered")
    v.add_argument("--examples", type=int, default=None, help="Hypothesis examples per machine (default 100, "
                   "or the profile's)")
    v.add_argument("--steps", type=int, default=None, help="most rules per state-machine example (default 20, "
                   "or the profile's)")
    v.add_argument("--machines", default="params,grads,layout,calls,scaler,offload,verdict,streams",
                   help="comma-separated, of params, grads, layout, calls, scaler, offload, verdict, streams "
                        "(default: all)")
    v.add_argument("--profile", default=None, help="a Hypothesis profile of fz3/testing/profiles.py: hunt (find "
                   "and shrink a bug within a minute), dev, ci, nightly, mutation")
    v.add_argument("--seed", type=int, default=None, help="the same seed draws the same examples (default: random)")
    v.add_argument("--patch", action="append", default=[], metavar="MODULE:FUNCTION=MODULE:FUNCTION",
                   help="run on your replacement of a function of fz3, bound wherever fz3 binds it, e.g. "
                   "fz3.core.param.release:release_into=mypkg.bugs:my_release_into (or bugs.py:my_release_into); "
                   "may be given several times")
    args = parser.parse_args(argv)
    try:
        if args.command == "consolidate":
            from fz3.consolidate import main as consolidate
            return consolidate(args.rest)
        if args.command == "timeline":
            return _timeline(args)
        if args.command == "verify":
            return _verify(args)
        if args.command == "check":
            return _check(args)
        return _plan(args)
    except UsageError as e:
        print(f"python -m fz3 {args.command}: {e}", file=sys.stderr)
        return 2


def _plan(args) -> int:
    import fz3
    if args.world_size < 1:
        raise UsageError(f"--world-size must be >= 1, got {args.world_size}")
    if args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    ds = _read_config(args.config)
    model, inputs = _call(args.target)
    config, optimizer, notes = _config(args.config, ds, world_size=args.world_size, steps=args.steps,
                                       model=lambda: model, use="the plan counts its state (\"optimizer state\")")
    if optimizer is not None and args.optimizer is not None:
        raise UsageError(f"an optimizer came both as --optimizer {args.optimizer} and as the config's "
                         "\"optimizer\" section; pass one (fz3.deepspeed.initialize refuses the pair too)")
    try:
        plan = fz3.plan(model, config, world_size=args.world_size, example_inputs=inputs,
                        optimizer=optimizer or args.optimizer or "adamw", steps=args.steps, backend=args.backend,
                        device_memory=_bytes(args.device_memory))
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None
    for note in notes:
        print(note)
    print(plan.table())
    return 0


UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _bytes(text: str | None) -> int | None:
    """--device-memory: a number of bytes, with a unit or none ("80GB", "79.6GiB", "8e10")."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9.]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
    try:
        value = float(m.group(1)) * UNITS[m.group(2).upper()]
    except (AttributeError, ValueError, KeyError):
        raise UsageError(f"--device-memory {text!r}: give bytes, as 80GB, 79.5GiB or 8e10 (units: B, KB, MB, GB, "
                         "TB, KiB, MiB, GiB, TiB)") from None
    if value <= 0:
        raise UsageError(f"--device-memory {text!r}: must be more than 0 bytes")
    return int(value)


def _verify(args) -> int:
    import traceback
    try:
        from fz3.testing.verify import verify
    except ImportError as e:
        raise UsageError(f"needs Hypothesis ({e}): pip install -e '.[test]' in your clone of fz3") from None
    if args.patch and os.getcwd() not in sys.path:  # a replacement's module, found as `python -m` finds one
        sys.path.insert(0, os.getcwd())
    try:
        report = verify(args.examples, args.steps, tuple(m for m in args.machines.split(",") if m),
                        profile=args.profile, patches=args.patch, seed=args.seed)
    except ValueError as e:  # fz3.testing.patch.PatchError among them
        raise UsageError(str(e)) from None
    if report.head():  # the patches, FAILED and the shrunk case first
        print(report.head() + "\n", flush=True)
    if report.failure is not None:  # Hypothesis' own account: the steps, the machine's notes
        print("".join(traceback.format_exception(report.failure[1])), file=sys.stderr, flush=True)
    print(report.table())
    return 1 if report.failure is not None else 0


def _check(args) -> int:
    import fz3
    from fz3.checking.build import CheckInputError
    try:
        worlds = tuple(int(w) for w in args.world_sizes.split(",") if w.strip())
    except ValueError:
        raise UsageError(f"--world-sizes {args.world_sizes!r}: give comma-separated ints, e.g. 1,2,3") from None
    ds = _read_config(args.config)
    build = _function(args.target)
    config, _, notes = _config(args.config, ds, world_size=None, steps=args.steps,
                               model=lambda: _built_model(build, args.target),
                               use=f"the check steps --optimizer {args.optimizer} instead"
                                   + (" (SGD shows a wrong grad scale, which Adam hides)" if args.optimizer == "sgd" else ""))
    for note in notes:
        print(note)
    try:
        report = fz3.check(build, world_sizes=worlds, examples=args.examples, steps=args.steps, config=config,
                           seed=args.seed, options=fz3.Options(broadcast_buffers=not args.no_broadcast_buffers),
                           optimizer=args.optimizer, rtol=args.rtol, atol=args.atol, bf16=args.bf16)
    except CheckInputError as e:
        one_line = " ".join(str(e).split())  # a torch error the model raised may span lines
        raise UsageError(one_line.replace("build()", f"{args.target}()")) from None
    print(report.summary())
    return 0 if report.ok else 1


def _timeline(args) -> int:
    from fz3.observe.timeline_draw import DrawError, draw
    try:
        got = draw(args.json, args.png)
    except DrawError as e:
        raise UsageError(str(e)) from None
    print(f"wrote {args.png}: {got['ranks']} ranks, {got['spans']} spans, {got['counters']} live-bytes samples")
    return 0


def _read_config(path: str | None) -> dict | None:
    """--config's file as fz3.deepspeed reads a config file (read_config: strict JSON, a
    duplicate key refused)."""
    from fz3.deepspeed.settings import read_config
    if path is None:
        return None
    if not os.path.exists(path):  # read_config would try it as base64 JSON
        raise UsageError(f"--config {path!r}: cannot read it ({os.strerror(errno.ENOENT)})")
    try:
        ds = read_config(path)
    except OSError as e:
        raise UsageError(f"--config {path!r}: cannot read it ({e.strerror})") from None
    except ValueError as e:
        raise UsageError(f"--config {path!r} is not JSON: {e.__cause__ or e}") from None
    if not isinstance(ds, dict):
        raise UsageError(f"--config {path!r} holds a {type(ds).__name__}; a DeepSpeed config is a JSON object")
    return ds


def _config(path: str | None, ds: dict | None, *, world_size: int | None, steps: int, model, use: str):
    """--config read as fz3.deepspeed.initialize reads it ([Note: one reader] in
    fz3/deepspeed/settings.py), "auto" values only Hugging Face's Trainer fills filled first as
    fz3.hf.Trainer fills them (`model()` gives the model, for the hidden-size ones). world_size
    None: batch sizes unchecked (check). `use`: what the caller does with a JSON optimizer.
    -> (fz3.Config, the JSON optimizer as a factory of params or None, lines to print: what was
    filled, the JSON optimizer and scheduler)."""
    import fz3
    from fz3.deepspeed.settings import read_settings, unresolved_autos
    if ds is None:
        return fz3.Config(), None, []
    notes = []
    try:
        autos = unresolved_autos(ds)
        if autos:
            ds, note = _fill_auto(path, ds, autos, world_size, steps, model())
            notes.append(note)
        settings = read_settings(ds, world_size=world_size, batch_sizes_required=False)
        optimizer, said = _json_optimizer(settings, use)
    except (TypeError, ValueError, KeyError) as e:
        one_line = " ".join(str(e).split())  # transformers' mismatch list spans lines
        raise UsageError(f"--config {path!r} is not a valid DeepSpeed config: {one_line}") from None
    if said is not None:
        notes.append(f"--config {path}: {said}")
    return settings.config, optimizer, notes


def _fill_auto(path: str, ds: dict, autos: list[str], world_size: int | None, steps: int, model):
    """`ds` filled as fz3.hf.Trainer fills it (fz3/hf/arguments.py fill_auto) -> (dict, line)."""
    try:
        from fz3.hf.arguments import fill_auto
    except ImportError as e:
        raise UsageError(f"--config {path!r} has \"auto\" values that Hugging Face's Trainer fills from "
                         f"TrainingArguments ({', '.join(autos)}); fz3 fills them as fz3.hf.Trainer does, "
                         f"which needs transformers and accelerate ({e}): pip install -e '.[hf]' in your clone of fz3, or set "
                         "the values") from None
    ds, filled = fill_auto(ds, model=model, world_size=world_size or 1, steps=steps)
    ranks = f" on {world_size} ranks" if world_size else ""
    return ds, (f"--config {path}: \"auto\" filled as fz3.hf.Trainer fills it from TrainingArguments' "
                f"defaults{ranks}: " + ", ".join(f"{k}={v!r}" for k, v in filled.items()))


def _json_optimizer(settings, use: str):
    """The JSON "optimizer" as a factory of params, built as fz3.deepspeed builds it, or None;
    and a line naming it (and `use`) and the JSON "scheduler", or None. Both are built here on a probe
    param, so a section fz3.deepspeed.initialize would refuse is refused now."""
    import torch
    from fz3.deepspeed.optimizers import build_optimizer
    from fz3.deepspeed.schedulers import build_scheduler
    probe = [torch.nn.Parameter(torch.zeros(1))]
    section, said = settings.optimizer, []
    optimizer = torch.optim.SGD(probe, lr=1e-3) if section is None else build_optimizer(section, probe)
    if section is not None:
        hyper = ", ".join(f"{k} {v!r}" for k, v in optimizer.defaults.items()
                          if k in ("lr", "betas", "eps", "weight_decay"))
        said.append(f"optimizer {section.get('type')!r} built as fz3.deepspeed builds it "
                    f"({type(optimizer).__name__}: {hyper}): {use}")
    if settings.scheduler is not None:
        said.append(f"scheduler {type(build_scheduler(settings.scheduler, optimizer)).__name__}")
    make = None if section is None else (lambda params: build_optimizer(section, params))
    return make, "; ".join(said) or None


def _built_model(build, target: str):
    """The model of the check's build() (its first return value), for "auto" filling."""
    try:
        return build()[0]
    except Exception as e:
        raise UsageError(f"{target}() raised {type(e).__name__}: {e}") from None


def _call(target: str):
    """Import MODULE (a dotted name or a .py file) and call FUNCTION() -> (model, example_inputs)."""
    from torch import nn
    fn = _function(target)
    try:
        got = fn()
    except Exception as e:
        raise UsageError(f"{target}() raised {type(e).__name__}: {e}") from None
    if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], nn.Module)):
        raise UsageError(f"{target}() must return (model, example_inputs), an nn.Module and its inputs; "
                         f"got {type(got).__name__}")
    return got


def _function(target: str):
    """FUNCTION of MODULE:FUNCTION, MODULE a dotted name or a .py file; not called."""
    module_name, sep, fn_name = target.rpartition(":")
    if not sep or not module_name or not fn_name:
        raise UsageError(f"{target!r} is not MODULE:FUNCTION (e.g. mypkg.models:small_gpt or models.py:small_gpt)")
    try:
        if module_name.endswith(".py"):
            spec = importlib.util.spec_from_file_location(os.path.basename(module_name)[:-3], module_name)
            if spec is None or not os.path.exists(module_name):
                raise UsageError(f"{module_name!r}: no such file")
            module = importlib.util.module_from_spec(spec)
            sys.path.insert(0, os.path.dirname(os.path.abspath(module_name)))  # its siblings, as `python FILE`
            spec.loader.exec_module(module)
        else:
            sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except UsageError:
        raise
    except Exception as e:  # the user's module failed to import: say which and why, no traceback
        raise UsageError(f"cannot import {module_name!r}: {type(e).__name__}: {e}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise UsageError(f"{module_name!r} has no function {fn_name!r}")
    return fn


if __name__ == "__main__":
    sys.exit(main())
