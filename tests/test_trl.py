"""TRL through fz3 with one change (issue #50, point 2): `class X(fz3.hf.Fz3TrainerMixin,
trl.SFTTrainer)` and the same with DPOTrainer, on 2 gloo ranks against plain TRL on one process
with the same global batch (micro batch 2 x 2 ranks against 4, 2 micro-steps a window, SGD,
clipping at 0.5).

    SFT   per step: the logged loss and the grad norm before clipping equal plain TRL's
    DPO   the same, with the reference model given as a module: the mixin shards it as an engine
          without an optimizer (Fz3TrainerMixin._shard_frozen_models), so no rank holds it whole
    bf16  TRL's configs ask for bf16 by default; a fz3 config without a bf16 section trains in
          fp32 (as DeepSpeed would), and the "fz3" log says so

Tested against trl 1.16.0 and peft 0.22.0 (the `test` extra pins them). The tokenizer is a
word-level one made in memory (no download), the model a tiny LlamaForCausalLM, the data Markov
sequences (SFT) and random token strings (DPO). Tolerance rel 1e-5: the same maths summed in
another order (tests/test_hf_trainer.py; seen here <= 3e-7).
"""
from __future__ import annotations

import logging
import os
import sys

import pytest
import torch

trl = pytest.importorskip("trl")

import fz3.launch  # noqa: E402

pytestmark = pytest.mark.timeout(300)

VOCAB, MICRO, WORLD = 64, 2, 2
TOL = dict(rel=1e-5, abs=1e-7)
DS = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
      "gradient_clipping": "auto", "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="t1", eos_token="t2", unk_token="t0")


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(1)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        tie_word_embeddings=False, attn_implementation="eager"))


def _common(micro: int, out: str) -> dict:
    return dict(output_dir=out, per_device_train_batch_size=micro, gradient_accumulation_steps=2, max_steps=3,
                optim="sgd", learning_rate=0.5, max_grad_norm=0.5, logging_steps=1, save_strategy="no",
                report_to="none", disable_tqdm=True, seed=0, use_cpu=True, bf16=False)


def _sft(micro: int, out: str, fz3_config=None, **overrides):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer
    from gpt import markov_batch
    x, _ = markov_batch(0, batch=32, seq=12, vocab=VOCAB)
    kw = dict(model=_model(), args=SFTConfig(**{**_common(micro, out), "max_length": 16, **overrides}),
              train_dataset=Dataset.from_dict({"input_ids": [row.tolist() for row in x]}),
              processing_class=_tokenizer())
    if fz3_config is None:
        return SFTTrainer(**kw)
    import fz3.hf

    class FzSFTTrainer(fz3.hf.Fz3TrainerMixin, SFTTrainer):
        pass
    return FzSFTTrainer(**kw, fz3_config=fz3_config)


def _dpo(micro: int, out: str, fz3_config=None):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer
    g = torch.Generator().manual_seed(0)

    def text(n: int) -> str:
        return "".join(f" t{i}" for i in torch.randint(3, VOCAB, (n,), generator=g).tolist())
    data = {"prompt": [text(6) for _ in range(32)], "chosen": [text(5) for _ in range(32)],
            "rejected": [text(5) for _ in range(32)]}
    kw = dict(model=_model(), ref_model=_model(), args=DPOConfig(**_common(micro, out)),
              train_dataset=Dataset.from_dict(data), processing_class=_tokenizer())
    if fz3_config is None:
        return DPOTrainer(**kw)
    import fz3.hf

    class FzDPOTrainer(fz3.hf.Fz3TrainerMixin, DPOTrainer):
        pass
    return FzDPOTrainer(**kw, fz3_config=fz3_config)


def _logs(trainer) -> list[tuple]:
    return [(h["step"], h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _worker(rank: int, world: int, root: str) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from fz3.shell import registry
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    sft = _sft(MICRO, f"{root}/sft", DS)
    sft.train()
    dpo = _dpo(MICRO, f"{root}/dpo", DS)
    dpo.train()
    said = _Said()
    logging.getLogger("fz3").addHandler(said)
    try:
        _sft(MICRO, f"{root}/bf16", DS, bf16=True)
    finally:
        logging.getLogger("fz3").removeHandler(said)
    return {"sft": _logs(sft), "dpo": _logs(dpo),
            "ref_sharded": registry.managed(dpo.ref_model.parameters()) is not None,
            "frozen": list(dpo.frozen_engines), "said": said.lines}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("trl"))
    with fz3.launch.spawn_environment({"FZ3_DEVICE": "cpu"}):
        return fz3.launch.run(_worker, world_size=WORLD, args=(root,), timeout=240)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("trl_plain"))
    out = {}
    for name, build in (("sft", _sft), ("dpo", _dpo)):
        t = build(WORLD * MICRO, f"{root}/{name}")
        t.train()
        out[name] = _logs(t)
    return out


@pytest.mark.parametrize("name", ["sft", "dpo"])
def test_trl_trainers_through_fz3_match_plain_trl(ranks, plain, name):
    got, want = ranks[0][name], plain[name]
    assert [s for s, _, _ in got] == [s for s, _, _ in want] == [1, 2, 3]
    for (_, loss, norm), (_, loss0, norm0) in zip(got, want):
        assert loss == pytest.approx(loss0, **TOL) and norm == pytest.approx(norm0, **TOL), (name, got, want)
    assert max(n for _, _, n in got) > 0.5  # the clip was in effect
    assert got[-1][1] != pytest.approx(got[0][1], rel=1e-4)  # training moved the weights


def test_the_reference_model_is_sharded_and_bf16_asked_is_said(ranks):
    for r in ranks:
        assert r["ref_sharded"] and r["frozen"] == ["ref_model"]
    said = [s for s in ranks[0]["said"] if "asks for bf16" in s]
    assert said and "trains in fp32" in said[0] and '"bf16": {"enabled": "auto"}' in said[0], ranks[0]["said"]
