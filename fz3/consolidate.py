"""zero_to_fp32: a sharded fz3 checkpoint -> one fp32 safetensors file, in one process.

    python -m fz3.consolidate CKPT_DIR OUT.safetensors [--tag TAG]   # usage errors (a missing or
                                          # unreadable checkpoint, an unwritable OUT) exit 2
    fz3.consolidate.consolidate(ckpt_dir, out_path, tag=None) -> {key: tensor}

    CKPT_DIR/<tag>/fz3_meta.json --> per param: its shards from rank_00000.pt ... (mmap'd),
    concatenated in rank order, padding dropped, reshaped --> {state_dict key: fp32 tensor}
    (+ the buffers rank 0 saved) --> safetensors file

No process group and no model: the metadata names every model.state_dict() key, so the file
loads with `safetensors.torch.load_model(model, path)` (strict). Memory: about one full fp32
copy of the model (the rank files are memory-mapped). Tied weights (one param under several
keys) are stored once, under their first key, as safetensors.torch.save_model and Hugging
Face do; the safetensors metadata "fz3_tied" maps each kept key to the keys it stands for.
Without tied weights, `load_file` + `model.load_state_dict(strict=True)` works too.
DeepSpeed: deepspeed/utils/zero_to_fp32.py (get_fp32_state_dict_from_zero_checkpoint,
convert_zero_checkpoint_to_fp32_state_dict).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from fz3.data import layout
from fz3.io.checkpoint import CheckpointError
from fz3.io.checkpoint_load import load_rank, read_meta, tag_folder


def fp32_state_dict(ckpt_dir: str, tag: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """({key: full fp32 tensor}, tied): every model.state_dict() key a checkpoint recorded,
    a tied param under its first key only; tied maps that key to the keys it stands for.
    DeepSpeed: get_fp32_state_dict_from_zero_checkpoint."""
    folder = tag_folder(ckpt_dir, tag)
    meta = read_meta(folder)
    files = [load_rank(folder, r, meta) for r in range(meta["world_size"])]
    out: dict[str, torch.Tensor] = {}
    first: dict[int, str] = {}
    tied: dict[str, list[str]] = {}
    for key, kind, p in meta["state_dict"]:
        if kind == "buffer":
            out[key] = files[0]["buffers"][key].clone()
        elif p in first:
            tied.setdefault(first[p], []).append(key)
        elif files[0]["masters"][p] is not None:  # None: a frozen param the save left out
            first[p] = key
            rec = meta["params"][p]
            out[key] = layout.unshard([f["masters"][p] for f in files], rec["shape"]).clone()
    return out, tied


def consolidate(ckpt_dir: str, out_path: str, tag: str | None = None) -> dict[str, torch.Tensor]:
    """Write the checkpoint's fp32 state dict to `out_path` (safetensors); returns it.
    DeepSpeed: convert_zero_checkpoint_to_fp32_state_dict."""
    from safetensors.torch import save_file
    state, tied = fp32_state_dict(ckpt_dir, tag)
    state = {k: v.contiguous() for k, v in state.items()}
    save_file(state, out_path, metadata={"format": "pt", "fz3_tied": json.dumps(tied)})
    return state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fz3.consolidate", description=__doc__.split("\n")[0])
    parser.add_argument("ckpt_dir", help="the save_dir given to engine.save_checkpoint")
    parser.add_argument("out", help="the .safetensors file to write")
    parser.add_argument("--tag", default=None, help="the tag to convert (default: the one `latest` names)")
    args = parser.parse_args(argv)
    try:
        state = consolidate(args.ckpt_dir, args.out, args.tag)
    except CheckpointError as e:  # a missing, unreadable or foreign checkpoint: a usage error
        print(f"fz3.consolidate: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # OUT cannot be written
        print(f"fz3.consolidate: cannot write {args.out!r} ({e.strerror or e})", file=sys.stderr)
        return 2
    numel = sum(t.numel() for t in state.values())
    print(f"wrote {args.out}: {len(state)} tensors, {numel} elements (fp32)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
