"""Hugging Face integration: `fz3.hf.Trainer`, a transformers.Trainer that trains through fz3.

    from fz3.hf import Trainer
    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                      fz3_config=ds_dict_or_json_path)

Importing this package imports transformers and accelerate (the `hf` extra); `import fz3` never
does (fz3/hf/trainer.py).
"""
from fz3.hf.trainer import Trainer

__all__ = ["Trainer"]
