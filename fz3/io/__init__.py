"""Library features that move a model's values in and out: sharded checkpoints (checkpoint,
checkpoint_load), weights from safetensors or a Hugging Face folder (weights), and the whole
model gathered (consolidate: full_state_dict, gathered_parameters). Built on the shell's public
engine; the lifecycle never imports them."""
