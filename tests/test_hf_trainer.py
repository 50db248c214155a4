"""fz3.hf.Trainer (fz3/hf/trainer.py) on 2 ranks against transformers.Trainer on one process.

    python -m pytest tests/test_hf_trainer.py -rA

Needs the `hf` extra (transformers, accelerate); skipped without it. The model is a tiny
LlamaForCausalLM from a LlamaConfig (no download), the data fixed Markov sequences. One
fz3.launch.run of 2 CPU ranks (gloo on 127.0.0.1, every wait bounded) does every multi-rank
run, one after the other in the same ranks, and the tests read what it returned:

    run      what each rank runs                                           read by
    a        fz3.hf.Trainer, 4 optimizer steps: micro batch 2, gas 2,     test_losses_..., test_auto_...,
             SGD, linear lr with warmup, max_grad_norm 0.5 (every step    test_checkpoint_...,
             clips), logging_steps 1, save_steps 2; then save_model       test_save_...
    b        a fresh model and Trainer: train(resume_from_checkpoint=     test_resume_...
             a/checkpoint-2), to step 4
    j        a JSON "optimizer" and "scheduler" with "auto" params, as    test_json_...
             in transformers' DeepSpeed docs, and 16-bit weights on
             save: 2 steps, a checkpoint at step 2
    d        run a's config as fz3.hf.TrainingArguments(deepspeed=...),  test_deepspeed_argument_...
             no fz3_config: what a script that kept --deepspeed gets
    refused  train() of a config that contradicts TrainingArguments,    test_refused_...
             and of an epoch of 3 micro-batches with gas 2: both raise
             before any engine is built

The reference is transformers.Trainer in this process with micro batch 4, the same global batch
(accelerate gives rank r the r-th half of each). SGD, not AdamW: Adam is nearly invariant to
the grads' scale, so a wrong divisor (fz3 divides by world_size * gas, the Trainer has already
divided by gas) or a clip at the wrong norm would hardly move its losses; SGD's move with both,
and grad_norm is compared too. Tolerance rtol 1e-5 (atol 1e-7): the same maths summed in
another order (two half batches and a reduce); seen: <= 3e-7 relative, losses and norms.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments  # noqa: E402

import fz3.launch  # noqa: E402
from gpt import markov_batch  # noqa: E402

pytestmark = pytest.mark.timeout(300)

VOCAB, HIDDEN, SEQ = 64, 32, 12
WORLD, MICRO, GAS, STEPS = 2, 2, 2, 4
CLIP = 0.5  # below every step's grad norm (0.9-1.0): every step clips
TOL = dict(rel=1e-5, abs=1e-7)
DS_CONFIG = {  # every value HF's DeepSpeed integration fills is "auto"
    "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"}}
JSON_CONFIG = {  # as in transformers' DeepSpeed docs: DeepSpeed builds the optimizer and scheduler
    **DS_CONFIG, "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {**DS_CONFIG["zero_optimization"], "stage3_gather_16bit_weights_on_model_save": True,
                          # its offload sections as published: on CPU ranks "cpu" is where the data lives
                          "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}}}


def _model() -> LlamaForCausalLM:
    torch.manual_seed(1)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False,
        tie_word_embeddings=False, attn_implementation="eager"))


def _data(n: int) -> list[dict[str, torch.Tensor]]:
    x, _ = markov_batch(0, batch=n, seq=SEQ, vocab=VOCAB)
    return [{"input_ids": row, "labels": row} for row in x]


def _args(output_dir: str, micro: int, cls=TrainingArguments, **overrides) -> TrainingArguments:
    kw = dict(output_dir=output_dir, per_device_train_batch_size=micro, gradient_accumulation_steps=GAS,
              max_steps=STEPS, optim="sgd", learning_rate=0.5, lr_scheduler_type="linear", warmup_steps=1,
              max_grad_norm=CLIP, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
              seed=0, use_cpu=True)
    return cls(**{**kw, **overrides})


def _logs(trainer, after: int = 0) -> list[dict]:
    return [{k: h[k] for k in ("step", "loss", "grad_norm", "learning_rate")}
            for h in trainer.state.log_history if "loss" in h and h["step"] > after]


def _refusal(build) -> str:
    try:
        build().train()
    except Exception as e:  # noqa: BLE001 - the test reads which error, and says so
        return f"{type(e).__name__}: {e}"
    return "train() did not raise"


class StepsRun(TrainerCallback):
    """The optimizer steps this train() call ran (a resumed run does not run the first ones)."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.steps.append(state.global_step)


def _worker(rank: int, world: int, root: str) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # else accelerate sets torch's threads from the cores
    import fz3.hf
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # its bars' lock outlives a rank ending in os._exit
    a = fz3.hf.Trainer(model=_model(), args=_args(f"{root}/a", MICRO, save_strategy="steps", save_steps=2),
                       train_dataset=_data(WORLD * MICRO * GAS * STEPS), fz3_config=DS_CONFIG)
    a.train()
    a.save_model(f"{root}/final")
    full_a = a.engine.full_state_dict()
    steps_run = StepsRun()
    b = fz3.hf.Trainer(model=_model(), args=_args(f"{root}/b", MICRO, save_steps=2), callbacks=[steps_run],
                       train_dataset=_data(WORLD * MICRO * GAS * STEPS), fz3_config=DS_CONFIG)
    b.train(resume_from_checkpoint=f"{root}/a/checkpoint-2")
    full_b = b.engine.full_state_dict()
    j = fz3.hf.Trainer(model=_model(), args=_args(f"{root}/j", MICRO, max_steps=2, save_strategy="steps",
                                                  save_steps=2, weight_decay=0.01, adam_beta2=0.99),
                       train_dataset=_data(WORLD * MICRO * GAS * 2), fz3_config=JSON_CONFIG)
    j.train()
    c = fz3.hf.Trainer(model=_model(), args=_args(f"{root}/c", MICRO, torch_compile=True, torch_compile_backend="eager"),
                       train_dataset=_data(WORLD * MICRO * GAS * STEPS), fz3_config=DS_CONFIG)
    c.train()
    deepspeed_args = _deepspeed_argument(root)
    cfg = a.engine.config
    refused = {
        "mismatch": _refusal(lambda: fz3.hf.Trainer(
            model=_model(), args=_args(f"{root}/m", MICRO), train_dataset=_data(16),
            fz3_config={**DS_CONFIG, "gradient_accumulation_steps": 3})),
        "window": _refusal(lambda: fz3.hf.Trainer(
            model=_model(), args=_args(f"{root}/w", MICRO, max_steps=-1, num_train_epochs=1),
            train_dataset=_data(WORLD * MICRO * 3), fz3_config=DS_CONFIG))}
    if rank != 0:
        return {}
    return {"a": _logs(a), "b": _logs(b, after=2), "b_steps_run": steps_run.steps,
            "compiled": {"logs": _logs(c), "regions": c.engine.compiled_regions, "units": c.engine.stats()["compiled_units"]},
            "full_a": full_a, "full_b": full_b, "refused": refused,
            "config": {k: getattr(cfg, k) for k in ("gradient_accumulation_steps", "gradient_clipping",
                                                   "reduce_bucket_size", "prefetch_bucket_size",
                                                   "param_persistence_threshold")},
            "checkpoint": sorted(os.listdir(f"{root}/a/checkpoint-2")),
            "json": {"optimizer": {k: j.engine.optimizer.defaults[k] for k in ("lr", "betas", "eps", "weight_decay")},
                     "scheduler": type(j.engine.lr_scheduler).__name__, "lr": j.engine.get_lr(),
                     "checkpoint": sorted(os.listdir(f"{root}/j/checkpoint-2"))},
            "tag": sorted(os.listdir(f"{root}/a/checkpoint-2/global_step2")), "deepspeed_args": deepspeed_args}


def _deepspeed_argument(root: str) -> dict:
    """Run d: a's run with its config given as fz3.hf.TrainingArguments(deepspeed=...) and no
    fz3_config; what the "fz3" log said (rank 0), and transformers' ZeRO-3 flag after the
    arguments, after the Trainer and after training."""
    import fz3.hf
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    said = _Said()
    logging.getLogger("fz3").addHandler(said)
    try:
        args = _args(f"{root}/d", MICRO, cls=fz3.hf.TrainingArguments, deepspeed=DS_CONFIG)
        flags = [is_deepspeed_zero3_enabled()]
        d = fz3.hf.Trainer(model=_model(), args=args, train_dataset=_data(WORLD * MICRO * GAS * STEPS))
        flags.append(is_deepspeed_zero3_enabled())
        d.train()
        flags.append(is_deepspeed_zero3_enabled())
    finally:
        logging.getLogger("fz3").removeHandler(said)
    return {"logs": _logs(d), "said": said.lines, "flags": flags, "deepspeed_imported": "deepspeed" in sys.modules,
            "plugin": d.accelerator.state.deepspeed_plugin, "args": (args.deepspeed, args.fz3_config == DS_CONFIG)}


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("fz3.hf.Trainer: "):
            self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf_trainer"))


@pytest.fixture(scope="module")
def ranks(root):
    """Rank 0's result of the one 2-rank launch (module doc)."""
    with fz3.launch.spawn_environment({"FZ3_DEVICE": "cpu"}):  # the ranks it spawns pick the CPU
        return fz3.launch.run(_worker, world_size=WORLD, args=(root,), timeout=240)[0]


@pytest.fixture(scope="module")
def plain(root):
    """transformers.Trainer in this process on the whole global batch: per-step logs."""
    from transformers import Trainer
    trainer = Trainer(model=_model(), args=_args(f"{root}/plain", WORLD * MICRO),
                      train_dataset=_data(WORLD * MICRO * GAS * STEPS))
    trainer.train()
    return _logs(trainer)


def test_losses_match_plain_trainer(ranks, plain):
    """Per optimizer step: the logged loss (mean over the window and ranks), the grad norm
    before clipping and the learning rate of the Trainer's schedule (warmup, then linear)."""
    got = ranks["a"]
    assert [h["step"] for h in got] == [h["step"] for h in plain] == list(range(1, STEPS + 1))
    for mine, ref in zip(got, plain):
        assert mine["loss"] == pytest.approx(ref["loss"], **TOL), (mine, ref)
        assert mine["grad_norm"] == pytest.approx(ref["grad_norm"], **TOL), (mine, ref)
        assert mine["learning_rate"] == pytest.approx(ref["learning_rate"], rel=1e-12), (mine, ref)
        assert mine["grad_norm"] > CLIP  # the clip was in effect
    assert got[-1]["loss"] != pytest.approx(got[1]["loss"], rel=1e-3)  # training moved the weights


def test_torch_compile_compiles_the_decoder_layers_at_the_same_losses(ranks):
    """TrainingArguments(torch_compile=True) goes to engine.compile(), as Accelerate's prepare
    sends it to a DeepSpeed engine: each decoder layer one compiled fetch unit."""
    assert ranks["compiled"]["regions"] == ["model.layers.0", "model.layers.1"]
    assert ranks["compiled"]["units"] == 2
    for got, want in zip(ranks["compiled"]["logs"], ranks["a"]):
        assert got["step"] == want["step"] and got["loss"] == pytest.approx(want["loss"], rel=1e-6)


def test_auto_values_filled_from_training_arguments(ranks):
    """ "auto" filled as transformers fills it for DeepSpeed: gas and gradient_clipping from
    TrainingArguments, the bucket sizes and persistence threshold from hidden_size."""
    assert ranks["config"] == {"gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
                               "reduce_bucket_size": HIDDEN * HIDDEN,
                               "prefetch_bucket_size": int(0.9 * HIDDEN * HIDDEN),
                               "param_persistence_threshold": 10 * HIDDEN}


def test_json_optimizer_and_scheduler_built_from_auto(ranks):
    """A JSON "optimizer" / "scheduler" is built by fz3.deepspeed with its "auto" params filled
    from TrainingArguments (lr, betas, eps, weight_decay; warmup_max_lr, warmup_num_steps), and
    the engine steps the scheduler: no scheduler.pt beside the fz3 checkpoint. One param group,
    as transformers' DummyOptim path gives DeepSpeed (no weight-decay exclusions). With
    stage3_gather_16bit_weights_on_model_save the checkpoint folder holds the weights too."""
    got = ranks["json"]
    assert got["optimizer"] == {"lr": 0.5, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.01}, got
    assert got["scheduler"] == "WarmupLR" and got["lr"] == [0.5], got  # warmed up after 1 step; one group
    files = set(got["checkpoint"])
    assert {"global_step2", "latest", "model.safetensors", "trainer_state.json"} <= files, files
    assert "scheduler.pt" not in files, files


def test_refused_before_training(ranks):
    """A DeepSpeed value that contradicts TrainingArguments is transformers' mismatch error; an
    epoch whose last accumulation window would be short is refused before the first step."""
    mismatch, window = ranks["refused"]["mismatch"], ranks["refused"]["window"]
    assert mismatch.startswith("ValueError") and "ds gradient_accumulation_steps=3 vs hf gradient_" \
        "accumulation_steps=2" in mismatch, mismatch
    assert window.startswith("ValueError"), window
    assert "not a multiple of gradient_accumulation_steps=2" in window, window


def test_checkpoint_is_fz3_sharded_in_trainer_folder(ranks):
    """checkpoint-2 holds fz3's sharded checkpoint under DeepSpeed's tag, its `latest`, and the
    Trainer's own files (state, per-rank RNG, its scheduler); no consolidated weights, as under
    DeepSpeed without stage3_gather_16bit_weights_on_model_save."""
    files = set(ranks["checkpoint"])
    assert {"global_step2", "latest", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth",
            "scheduler.pt", "config.json"} <= files, files
    assert not files & {"model.safetensors", "pytorch_model.bin", "optimizer.pt"}, files
    assert {"fz3_meta.json", "rank_00000.pt", "rank_00001.pt"} <= set(ranks["tag"]), ranks["tag"]


def test_save_model_loads_with_from_pretrained(ranks, root):
    """save_model writes what from_pretrained loads: the engine's consolidated weights, bit for
    bit (fp32 run), every key."""
    full = ranks["full_a"]
    loaded = LlamaForCausalLM.from_pretrained(f"{root}/final").state_dict()
    assert sorted(loaded) == sorted(full)
    for k, v in full.items():
        assert torch.equal(loaded[k], v), k


def test_resume_is_bit_for_bit(ranks):
    """train(resume_from_checkpoint=checkpoint-2) runs steps 3 and 4 only, logs exactly what the
    uninterrupted run logged for them, and ends at the same weights, bit for bit."""
    assert ranks["b_steps_run"] == [3, 4]
    assert ranks["b"] == ranks["a"][2:], (ranks["b"], ranks["a"][2:])
    for k, v in ranks["full_a"].items():
        assert torch.equal(ranks["full_b"][k], v), k


def test_deepspeed_argument_is_trained_by_fz3_as_fz3_config(ranks):
    """A script that kept --deepspeed: fz3.hf.TrainingArguments(deepspeed=DS_CONFIG) and no
    fz3_config trains as run a (fz3_config=DS_CONFIG) did, bit for bit; rank 0 says so once in the
    "fz3" log; deepspeed is never imported and transformers' ZeRO-3 flag (from_pretrained's
    zero.Init) is never on; Accelerate has no DeepSpeed plugin."""
    got = ranks["deepspeed_args"]
    assert got["logs"] == ranks["a"], (got["logs"], ranks["a"])
    assert got["said"] == ["fz3.hf.Trainer: TrainingArguments(deepspeed=<a dict: train_micro_batch_size_per_gpu, "
                           "train_batch_size, gradient_accumulation_steps, gradient_clipping, zero_optimization>) "
                           "is trained by fz3 (ZeRO-3), as fz3_config= would be: DeepSpeed is not imported, and no "
                           "deepspeed.zero.Init or DeepSpeed engine touches the model"], got["said"]
    assert got["flags"] == [False, False, False] and got["plugin"] is None and not got["deepspeed_imported"], got
    assert got["args"] == (None, True)  # deepspeed= moved to fz3_config before transformers saw it


# ---- where the config comes from (in this process, no training) ----------------------------------

def _no_deepspeed() -> None:
    if importlib.util.find_spec("deepspeed") is not None:
        pytest.skip("deepspeed is installed: these tests show fz3.hf without it")


def test_hf_argument_parser_takes_deepspeed_flag_without_deepspeed(tmp_path):
    """HfArgumentParser(fz3.hf.TrainingArguments) parses --deepspeed ds.json with deepspeed not
    installed (transformers' own TrainingArguments cannot: it checks deepspeed's version); the
    config lands in fz3_config and nothing of DeepSpeed is set up."""
    _no_deepspeed()
    import fz3.hf
    from transformers import HfArgumentParser
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DS_CONFIG))
    flags = ["--output_dir", str(tmp_path), "--deepspeed", str(path), "--use_cpu", "--report_to", "none"]
    with pytest.raises(Exception, match="deepspeed"):  # the reason fz3.hf.TrainingArguments exists
        HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(flags)
    (args,) = HfArgumentParser(fz3.hf.TrainingArguments).parse_args_into_dataclasses(flags)
    assert (args.deepspeed, args.fz3_config, args.deepspeed_plugin) == (None, str(path), None)
    assert not is_deepspeed_zero3_enabled() and "deepspeed" not in sys.modules
    trainer = fz3.hf.Trainer(model=_model(), args=args, train_dataset=_data(8))
    assert trainer.fz3_config.config["gradient_accumulation_steps"] == 1 and not trainer.is_deepspeed_enabled


def test_a_config_given_twice_must_be_one(tmp_path):
    """deepspeed= and fz3_config= (of the arguments, or of the Trainer) that differ: a ValueError
    naming both; the same config twice (a path and the dict it holds) is one."""
    import fz3.hf
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DS_CONFIG))
    other = {**DS_CONFIG, "gradient_clipping": 1.0}
    with pytest.raises(ValueError, match=r"fz3.hf.TrainingArguments: a DeepSpeed config came twice, as "
                                         r"TrainingArguments\(deepspeed='.*ds.json'\) and as TrainingArguments"
                                         r"\(fz3_config=<a dict: .*>\), and they differ: pass one"):
        _args(str(tmp_path), MICRO, cls=fz3.hf.TrainingArguments, deepspeed=str(path), fz3_config=other)
    args = _args(str(tmp_path), MICRO, cls=fz3.hf.TrainingArguments, deepspeed=str(path))
    with pytest.raises(ValueError, match=r"as TrainingArguments\(deepspeed='.*ds.json'\) and as "
                                         r"fz3.hf.Trainer\(fz3_config=<a dict: .*>\), and they differ"):
        fz3.hf.Trainer(model=_model(), args=args, train_dataset=_data(8), fz3_config=other)
    same = fz3.hf.Trainer(model=_model(), args=args, train_dataset=_data(8), fz3_config=DS_CONFIG)
    assert same.fz3_config.config["gradient_clipping"] == CLIP


def test_plain_arguments_set_up_for_deepspeed_are_turned_off(tmp_path, caplog):
    """transformers.TrainingArguments(deepspeed=...) where deepspeed is installed: what its
    __post_init__ sets up (an HfDeepSpeedConfig behind transformers' global ZeRO-3 flag,
    Accelerate's DeepSpeed plugin) is made here by hand, since deepspeed is not installed. The
    Trainer takes the config, turns the flag and the plugin off, and says so once; a model
    zero.Init already partitioned (its params carry ds_id) is refused."""
    import fz3.hf
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.deepspeed import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import (is_deepspeed_zero3_enabled, set_hf_deepspeed_config,
                                                     unset_hf_deepspeed_config)
    args = _args(str(tmp_path), MICRO)
    args.deepspeed, args.hf_deepspeed_config = DS_CONFIG, HfDeepSpeedConfig(DS_CONFIG)
    set_hf_deepspeed_config(args.hf_deepspeed_config)  # transformers' HfDeepSpeedConfig.__init__ does this
    args.deepspeed_plugin = DeepSpeedPlugin(hf_ds_config=args.hf_deepspeed_config)
    try:
        assert is_deepspeed_zero3_enabled()
        partitioned = _model()
        next(partitioned.parameters()).ds_id = 0
        with pytest.raises(ValueError, match="partitioned by DeepSpeed's zero.Init"):
            fz3.hf.Trainer(model=partitioned, args=args, train_dataset=_data(8))
        with caplog.at_level(logging.WARNING, logger="fz3"):
            trainer = fz3.hf.Trainer(model=_model(), args=args, train_dataset=_data(8))
    finally:
        flag = is_deepspeed_zero3_enabled()
        unset_hf_deepspeed_config()  # this process's later tests see no DeepSpeed, whatever happened
    assert not flag
    assert not trainer.is_deepspeed_enabled
    assert (args.deepspeed, args.deepspeed_plugin, args.hf_deepspeed_config) == (None, None, None)
    assert trainer.fz3_config.config["gradient_accumulation_steps"] == GAS
    said = [r.getMessage() for r in caplog.records if r.name == "fz3"]
    assert len(said) == 1 and said[0].startswith("fz3.hf.Trainer: TrainingArguments(deepspeed=<a dict: ") \
        and "is trained by fz3 (ZeRO-3), as fz3_config= would be; what transformers set up for DeepSpeed" in said[0]
