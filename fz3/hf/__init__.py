"""Hugging Face integration: `fz3.hf.Trainer`, a transformers.Trainer that trains through fz3.

    from fz3.hf import Trainer, TrainingArguments
    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                      fz3_config=ds_dict_or_json_path)
    # or, a script that kept --deepspeed ds.json: HfArgumentParser(fz3.hf.TrainingArguments)
    trainer = Trainer(model=model, args=TrainingArguments(..., deepspeed="ds.json"), ...)

fz3.hf.TrainingArguments is transformers' with `deepspeed=` taken as fz3's config, so that
DeepSpeed is never set up (fz3/hf/arguments.py).

Importing this package imports transformers and accelerate (the `hf` extra); `import fz3` never
does (fz3/hf/trainer.py).
"""
from fz3.hf.arguments import TrainingArguments
from fz3.hf.trainer import Trainer

__all__ = ["Trainer", "TrainingArguments"]
