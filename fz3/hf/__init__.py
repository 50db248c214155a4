"""Hugging Face integration: `fz3.hf.Trainer`, a transformers.Trainer that trains through fz3.

    from fz3.hf import Trainer, TrainingArguments
    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                      fz3_config=ds_dict_or_json_path)
    # or, a script that kept --deepspeed ds.json: HfArgumentParser(fz3.hf.TrainingArguments)
    trainer = Trainer(model=model, args=TrainingArguments(..., deepspeed="ds.json"), ...)
    class FzSFTTrainer(fz3.hf.Fz3TrainerMixin, trl.SFTTrainer): pass    # any Trainer subclass

fz3.hf.TrainingArguments is transformers' with `deepspeed=` taken as fz3's config, so that
DeepSpeed is never set up (fz3/hf/arguments.py).

Importing this package imports transformers and accelerate (the `hf` extra); `import fz3` never
does (fz3/hf/trainer.py). Their versions are checked first (fz3/hf/versions.py: written against
transformers 5.x, tested with 5.25.0 and accelerate 1.16.0).
"""
from fz3.hf import versions

versions.check()

from fz3.hf.arguments import TrainingArguments  # noqa: E402 - after the version check
from fz3.hf.trainer import Fz3TrainerMixin, Trainer  # noqa: E402

__all__ = ["Fz3TrainerMixin", "Trainer", "TrainingArguments"]
