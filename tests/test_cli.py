"""python -m fz3: the plan printed for a model given as MODULE:FUNCTION, the check of a model on
thread ranks against one process (exit 0 pass, 1 a failure found), the verification run with
what each invariant covered, and usage errors as one line naming the value, exit status 2, no
traceback (fz3/__main__.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = "examples/05_plan.py:small_gpt"
pytestmark = pytest.mark.timeout(300)


def _run(*args: str) -> subprocess.CompletedProcess:
    """The CLI in a fresh process; the tests' own targets import the examples' GPT (examples/gpt.py)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "examples"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "fz3", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=240, env=env)


def test_plan_prints_the_table_for_64_ranks(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_bucket_size": 200000}}))
    got = _run("plan", TARGET, "--world-size", "64", "--config", str(cfg))
    assert got.returncode == 0, got.stderr
    assert "on 64 ranks" in got.stdout and "reduce_bucket_size=200000" in got.stdout
    assert "step 1" in got.stdout and "step 2" in got.stdout and "all-gathers" in got.stdout


@pytest.mark.parametrize("target, guessed", [
    ("examples/05_plan.py:tiny_llama", False),  # Hugging Face, sdpa, a padded attention_mask
    ("tests/test_plan.py:routed", True),  # torch.arange(T) without a device; a router's mask: guessed
])
def test_plan_takes_models_that_make_tensors_or_read_their_data(target, guessed):
    if "llama" in target:
        pytest.importorskip("transformers")
    got = _run("plan", target, "--world-size", "64")
    assert got.returncode == 0, got.stderr
    assert "on 64 ranks" in got.stdout and "step 2" in got.stdout
    assert ("guessed: " in got.stdout) == guessed and ("tests/test_plan.py:" in got.stdout) == guessed, got.stdout


@pytest.mark.parametrize("args, message", [
    (("plan", "no_such_module_fz3:f", "--world-size", "2"), "cannot import 'no_such_module_fz3'"),
    (("plan", "examples/05_plan.py:nope", "--world-size", "2"), "has no function 'nope'"),
    (("plan", "examples/05_plan.py", "--world-size", "2"), "is not MODULE:FUNCTION"),
    (("plan", "examples/gpt.py:markov_batch", "--world-size", "2"), "markov_batch() raised TypeError"),
    (("plan", "fz3.config.config:Config", "--world-size", "2"), "must return (model, example_inputs)"),
    (("plan", TARGET, "--world-size", "0"), "--world-size must be >= 1, got 0"),
    (("plan", TARGET, "--world-size", "two"), "invalid int value: 'two'"),
    (("plan", TARGET, "--world-size", "2", "--config", "/nonexistent/ds.json"), "cannot read it"),
    (("plan", TARGET, "--world-size", "2", "--optimizer", "lion"), "optimizer must be one of adamw, adam, sgd"),
    (("frobnicate",), "invalid choice: 'frobnicate'"),
    (("consolidate", "/nonexistent/ckpt", "out.safetensors"), "no /nonexistent/ckpt/latest file"),
    (("consolidate", "/nonexistent/ckpt", "out.safetensors", "--tag", "t1"),
     "checkpoint folder /nonexistent/ckpt/t1 does not exist"),
    (("verify", "--examples", "0"), "examples must be >= 1, got 0"),
    (("check", "no_such_module_fz3:f"), "cannot import 'no_such_module_fz3'"),
    (("check", "tests/test_check.py:nope"), "has no function 'nope'"),
    (("check", "fz3.config.config:Config"), "fz3.config.config:Config() must return (model, example_batches, "
                                            "loss_fn) or (model, example_inputs)"),
    (("check", "tests/test_check.py:raises_in_forward"), "does not run in one process on the CPU"),
    (("check", "tests/test_check.py:huge"), "too big to check in one process here"),
    (("check", "tests/test_check.py:clean", "--world-sizes", "0"), "world_sizes must be a non-empty list of ints"),
    (("check", "tests/test_check.py:clean", "--world-sizes", "two"), "--world-sizes 'two': give comma-separated"),
    (("check", "tests/test_check.py:clean", "--optimizer", "lion"), "optimizer must be one of sgd, adamw, adam"),
    (("verify", "--machines", "params,nope"), "machines ['params', 'nope']: choose from"),
])
def test_usage_errors_are_one_line_and_exit_2(args, message, capsys, monkeypatch):
    """In this process, through fz3.__main__.main (what `python -m fz3` runs: the two runs below
    show the real command's exit status and stderr agree)."""
    from fz3.__main__ import main
    monkeypatch.chdir(ROOT)
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    assert message in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (("frobnicate",), "invalid choice: 'frobnicate'"),  # argparse's
    (("plan", TARGET, "--world-size", "0"), "--world-size must be >= 1, got 0"),  # fz3's
])
def test_the_command_exits_2_with_one_line(args, message):
    got = _run(*args)
    assert got.returncode == 2, (got.returncode, got.stdout, got.stderr)
    assert message in got.stderr and "Traceback" not in got.stderr, got.stderr
    assert len(got.stderr.strip().splitlines()) <= 3, got.stderr  # argparse adds its usage line


def test_a_config_that_is_not_valid_is_named(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_bucket_sise": 5}}))
    got = _run("plan", TARGET, "--world-size", "2", "--config", str(bad))
    assert got.returncode == 2 and "reduce_bucket_sise" in got.stderr and "Traceback" not in got.stderr
    bad.write_text("{not json")
    got = _run("plan", TARGET, "--world-size", "2", "--config", str(bad))
    assert got.returncode == 2 and "is not JSON" in got.stderr


# transformers' DeepSpeed docs, "ZeRO-3 example", as published: every value the Trainer fills is
# "auto", and the optimizer and params offloaded to "cpu" (where CPU ranks keep them anyway).
HF_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True},
                          "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
                          "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}
DS_EXAMPLE = os.path.join(ROOT, "examples", "deepspeed_config.json")  # a JSON optimizer and scheduler


def _main(capsys, *args: str) -> tuple[int, str, str]:
    from fz3.__main__ import main
    code = main(list(args))
    got = capsys.readouterr()
    return code, got.out, got.err


def test_plan_reads_hf_zero3_json_as_fz3_hf_trainer_does(tmp_path, capsys, monkeypatch):
    """HF's ZeRO-3 JSON: its "auto" values filled as fz3.hf.Trainer fills them (TrainingArguments'
    defaults; the bucket sizes from the Llama's hidden_size, 64), the JSON AdamW built and counted,
    WarmupLR checked. One reader: fz3/deepspeed/settings.py [Note: one reader]."""
    pytest.importorskip("transformers")
    monkeypatch.chdir(ROOT)
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(HF_ZERO3))
    code, out, err = _main(capsys, "plan", "examples/05_plan.py:tiny_llama", "--world-size", "64",
                           "--config", str(cfg))
    assert code == 0, err
    assert f'--config {cfg}: "auto" filled as fz3.hf.Trainer fills it from TrainingArguments\' defaults on 64 ' \
           "ranks: fp16.enabled=False" in out, out
    for filled in ("optimizer.params.lr=5e-05", "zero_optimization.reduce_bucket_size=4096",
                   "train_batch_size=512", "train_micro_batch_size_per_gpu=8", "gradient_accumulation_steps=1"):
        assert filled in out, (filled, out)
    assert "optimizer 'AdamW' built as fz3.deepspeed builds it (AdamW: lr 5e-05, betas (0.9, 0.999), eps 1e-08, " \
           'weight_decay 0.0): the plan counts its state ("optimizer state"); scheduler WarmupLR' in out, out
    assert "on 64 ranks" in out and "prefetch_bucket_size=3686, param_persistence_threshold=640, " \
           "reduce_bucket_size=4096" in out and "step 2" in out, out


def test_plan_reads_the_deepspeed_example_json_and_counts_its_optimizer(tmp_path, capsys, monkeypatch):
    """examples/deepspeed_config.json (fz3.deepspeed.initialize's: AdamW, WarmupDecayLR, batch
    sizes for 2 ranks) plans on 2 ranks; the JSON optimizer is the one whose state is counted:
    AdamW keeps 2 fp32 states per element (twice the shards), a JSON SGD without momentum none."""
    monkeypatch.chdir(ROOT)
    code, out, err = _main(capsys, "plan", TARGET, "--world-size", "2", "--config", DS_EXAMPLE)
    assert code == 0, err
    assert "optimizer 'AdamW' built as fz3.deepspeed builds it (AdamW: lr 0.01, betas (0.9, 0.999), eps 1e-08, " \
           'weight_decay 0.01): the plan counts its state ("optimizer state"); scheduler WarmupDecayLR' in out, out
    assert "on 2 ranks" in out and "gradient_accumulation_steps=2" in out, out
    rows = {line[:40].strip(): line[40:].split()[:2] for line in out.splitlines()}
    assert rows["optimizer state"] == ["16.18", "MiB"] and rows["param shards (fp32 masters)"] == ["8.09", "MiB"]
    sgd = tmp_path / "sgd.json"
    sgd.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 3},
                               "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}))
    code, out, err = _main(capsys, "plan", TARGET, "--world-size", "2", "--config", str(sgd))
    assert code == 0, err
    rows = {line[:40].strip(): line[40:].split()[:2] for line in out.splitlines()}
    assert rows["optimizer state"] == ["0", "B"], out  # --optimizer's default, adamw, would keep 16 MiB


@pytest.mark.parametrize("edit, extra, message", [
    (None, ("--world-size", "64"), "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * "
                                   "world_size 16 != 4 * 2 * 64"),  # DeepSpeed's check, as initialize
    (None, ("--world-size", "2", "--optimizer", "sgd"), "an optimizer came both as --optimizer sgd and as the "
                                                        "config's \"optimizer\" section"),
    ({"optimizer": {"type": "Lamb", "params": {"lr": 0.1}}}, ("--world-size", "2"), "DeepSpeed optimizer 'Lamb': "
                                                                                      "fz3 builds only"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, ("--world-size", "2"), "total_num_steps"),
    ({"zero_optimization": {"stage": 3, "reduce_bucket_sise": 5}}, ("--world-size", "2"), "reduce_bucket_sise"),
    ({"dataloader_drop_last": "auto"}, ("--world-size", "2"), "'dataloader_drop_last' is \"auto\""),
])
def test_a_json_fz3_deepspeed_refuses_is_refused_with_its_message(edit, extra, message, tmp_path, capsys,
                                                                  monkeypatch):
    """examples/deepspeed_config.json edited: what fz3.deepspeed.initialize refuses (or, for a top-level
    "auto" fz3.hf.Trainer does not fill either, refuses after filling) is one line, exit status 2."""
    if "dataloader_drop_last" in (edit or {}):
        pytest.importorskip("transformers")  # a top-level "auto" is filled by fz3.hf's code first
    monkeypatch.chdir(ROOT)
    with open(DS_EXAMPLE) as f:
        cfg = {**json.load(f), **(edit or {})}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    code, out, err = _main(capsys, "plan", TARGET, "--config", str(path), *extra)
    assert code == 2 and message in err and "Traceback" not in err, (code, err)
    assert len(err.strip().splitlines()) == 1 and out == "", (out, err)


def test_check_reads_the_deepspeed_example_json(capsys, monkeypatch):
    """check --config takes the JSON optimizer and scheduler too (read, built, named) and steps its
    own --optimizer; the batch sizes (for 2 ranks) are not checked against its world sizes."""
    monkeypatch.chdir(ROOT)
    code, out, err = _main(capsys, "check", "tests/test_check.py:clean", "--config", DS_EXAMPLE,
                           "--world-sizes", "1,2", "--examples", "2", "--steps", "1")
    assert code == 0, out + err
    assert "optimizer 'AdamW' built as fz3.deepspeed builds it" in out and "the check steps --optimizer sgd " \
           "instead" in out and "scheduler WarmupDecayLR" in out, out
    assert "OK: 2 examples passed" in out, out


@pytest.mark.parametrize("target, code, says", [
    ("tests/test_check.py:clean", 0, "OK: 3 examples passed"),
    ("tests/test_check.py:written", 1, "FAILED: 3 of 3 examples"),
])
def test_check_exits_0_when_every_example_passes_and_1_on_a_failure(target, code, says, capsys, monkeypatch):
    from fz3.__main__ import main
    monkeypatch.chdir(ROOT)
    got = main(["check", target, "--examples", "3"])
    out = capsys.readouterr().out
    assert got == code, out
    assert says in out and "fz3 check: " in out
    if code:
        assert "likely cause: param 'gain' changed during a forward and backward" in out
        assert "smallest failing example" in out and "    fz3.Config()" in out


def test_the_check_command_runs_as_a_command(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_bucket_size": 9}}))
    got = _run("check", "tests/test_check.py:clean", "--world-sizes", "2", "--examples", "2", "--steps", "1",
               "--config", str(cfg), "--seed", "3")
    assert got.returncode == 0, got.stdout + got.stderr
    assert "your config: fz3.Config(reduce_bucket_size=9, gradient_clipping=1.0)" in got.stdout  # from_deepspeed
    assert "OK: 2 examples passed" in got.stdout


def test_verify_runs_every_machine_and_says_what_each_invariant_covered():
    got = _run("verify", "--examples", "15", "--steps", "10")
    assert got.returncode == 0, got.stderr
    rows = {line[:15].strip(): line[15:].split() for line in got.stdout.splitlines() if line[:1] not in ("", " ")}
    for inv in ("I1", "I2", "I3", "I4", "I5", "I6", "purity", "naive model", "reduced once", "misuse refused",
                "loss scale"):
        assert int(rows[inv][0].replace(",", "")) > 0, (inv, got.stdout)  # checks ran
    assert rows["I7"][0] == "-" and "tests/test_parity.py" in got.stdout  # said where it is proven
    for machine in ("params", "grads", "layout", "scaler", "verdict", "streams"):
        assert int(rows[machine][1].replace(",", "")) >= 15, got.stdout  # examples run


def test_verify_fails_with_the_counterexample_on_a_planted_bug():
    """A layout whose rank 1 shard is off by one: verify exits 1 and shows what Hypothesis found."""
    plant = ("import fz3.data.layout as L; shard_of = L.shard_of; "
             "L.shard_of = lambda f, r, w: shard_of(f, r, w) + (r == 1); "
             "from fz3.__main__ import main; raise SystemExit(main(['verify', '--examples', '30', "
             "'--machines', 'layout']))")
    got = subprocess.run([sys.executable, "-c", plant], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert got.returncode == 1, (got.returncode, got.stdout, got.stderr)
    assert "FAILED in layout: AssertionError" in got.stdout
    assert "round_trip(" in got.stderr and "w=2," in got.stderr, got.stderr  # the shrunk case: rank 1 exists
