"""fz3.load_weights: safetensors files and Hugging Face folders straight into the shards.

    python -m pytest tests/test_load_weights.py -rA

Files are written once (`_files`) from models built with one seed; every rank builds the same
models with another seed, initializes fz3, loads, and reports back. One fz3.launch.run per world
size (2, 3) runs every case below in the same ranks.

    toy           a small model: 0-d, 1-d, 2-d and 3-d params whose rank ranges cut rows,
                  buffers (float and int64, persistent; a non-persistent one), from one
                  .safetensors file; param_persistence_threshold=0
    toy_persist   the same with some params persistent, gathered by an eval pass before loading
                  (their full values go stale when the shards are rewritten)
    toy_tied      head.weight is emb.weight, the file holding it once, as head.weight
    toy_bf16      compute_dtype bf16: the compute shards the gathers read are refreshed too
    llama         LlamaForCausalLM, save_pretrained(max_shard_size="20KB"): several shard files
                  and model.safetensors.index.json
    gpt2          GPT2LMHeadModel, save_pretrained: one model.safetensors, lm_head tied and
                  stored once (as transformers.wte.weight)
    errors        missing, unexpected and mis-shaped keys all listed, with file and shapes;
                  a folder with no weights; a file only some ranks can read (every rank
                  raises); nothing loaded by any of them; a call inside a forward refused

Per load: engine.full_state_dict() equals the file exactly; each rank read exactly its flat range
of every param (safetensors.safe_open wrapped to count elements), buffers whole; for toy,
toy_persist and llama, STEPS training steps after loading match single-process training from the
same weights (fp32, SGD + momentum, rtol 1e-5 / atol 1e-6 as tests/test_hf.py).
"""
from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
import traceback

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from fz3.config.config import Config
from tests.support.parity_data import GLOBAL_BATCH, rank_slice

pytestmark = pytest.mark.timeout(240)

STEPS, VOCAB, SEQ = 2, 11, 5
FP32 = dict(rtol=1e-5, atol=1e-6)
EXACT = dict(rtol=0, atol=0)


# ---- models and files -----------------------------------------------------------------------------

class Toy(nn.Module):
    """Params of every rank (0-d to 3-d) whose shards cut rows at W = 2 and 3, persistent float
    and int64 buffers, and a non-persistent one (not in state_dict: not in the file either)."""

    def __init__(self, seed: int, tied: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, 6)  # (11, 6)
        self.lin = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, VOCAB, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.w3 = nn.Parameter(torch.randn(3, 5, 4))
        self.scale = nn.Parameter(torch.tensor(1.0 + seed / 10))
        self.register_buffer("shift", torch.randn(6))
        self.register_buffer("seen", torch.tensor(seed))  # int64
        self.register_buffer("scratch", torch.ones(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.lin(self.emb(x))) + self.shift)  # (B, T, 6)
        return self.head(h) * self.scale + self.w3.mean()  # (B, T, V)


def _llama(seed: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      use_cache=False, tie_word_embeddings=False, attn_implementation="eager")
    return LlamaForCausalLM(cfg)


def _gpt2(seed: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=64, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
                     eos_token_id=0, use_cache=False, attn_implementation="eager")
    return GPT2LMHeadModel(cfg)  # tie_word_embeddings=True by default


def _batch(i: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(50 + i))


def _loss(model, x: torch.Tensor, hf: bool) -> torch.Tensor:
    if hf:
        return model(input_ids=x, labels=x).loss
    return F.cross_entropy(model(x).flatten(0, 1), x.roll(1, dims=1).flatten())


@functools.lru_cache(maxsize=None)
def _files() -> dict[str, str]:
    """name -> path of what the ranks load: each written from a model built with seed 1."""
    root = tempfile.mkdtemp(prefix="fz3_load_weights_")
    atexit.register(shutil.rmtree, root, True)
    out = {"toy": os.path.join(root, "toy.safetensors"), "tied": os.path.join(root, "tied.safetensors"),
           "bad": os.path.join(root, "bad.safetensors"), "empty": os.path.join(root, "empty"),
           "toy2": os.path.join(root, "toy2.safetensors")}
    sd = Toy(1).state_dict()
    save_file(sd, out["toy"])
    save_file(Toy(2).state_dict(), out["toy2"])
    tied = Toy(1, tied=True).state_dict()
    del tied["emb.weight"]  # stored once, under its second name (HF's gpt2 file: its first)
    save_file(tied, out["tied"])
    bad = {k: v for k, v in sd.items() if k not in ("lin.bias", "seen")}  # two missing
    bad["lin.weight"] = torch.zeros(6, 5)  # mis-shaped
    bad["extra.weight"] = torch.zeros(2, 2)  # unexpected
    save_file(bad, out["bad"])
    os.mkdir(out["empty"])
    if _has_transformers():
        out["llama"], out["gpt2"] = os.path.join(root, "llama"), os.path.join(root, "gpt2")
        _llama(1).save_pretrained(out["llama"], max_shard_size="20KB")
        _gpt2(1).save_pretrained(out["gpt2"])
    return out


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
        return True
    except ImportError:
        return False


def _file_state(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a file or folder, whole (the test's side only)."""
    from safetensors.torch import load_file
    files = [path] if os.path.isfile(path) else [os.path.join(path, f) for f in sorted(os.listdir(path))
                                                  if f.endswith(".safetensors")]
    return {k: v for f in files for k, v in load_file(f).items()}


# ---- counting reads --------------------------------------------------------------------------------

class _CountingSlice:
    def __init__(self, inner, name: str, reads: dict) -> None:
        self.inner, self.name, self.reads = inner, name, reads

    def __getitem__(self, index):
        t = self.inner[index]
        self.reads[self.name] = self.reads.get(self.name, 0) + t.numel()
        return t

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


class _CountingOpen:
    """safetensors.safe_open, counting the elements each tensor name has read."""
    reads: dict[str, int] = {}
    real = None

    def __init__(self, *args, **kwargs) -> None:
        self.inner = _CountingOpen.real(*args, **kwargs)

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def get_slice(self, name: str):
        return _CountingSlice(self.inner.get_slice(name), name, _CountingOpen.reads)

    def get_tensor(self, name: str):
        t = self.inner.get_tensor(name)
        _CountingOpen.reads[name] = _CountingOpen.reads.get(name, 0) + t.numel()
        return t

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


def _load_counting(engine, path: str) -> dict[str, int]:
    import safetensors
    import fz3
    _CountingOpen.real, _CountingOpen.reads = safetensors.safe_open, {}
    safetensors.safe_open = _CountingOpen
    try:
        fz3.load_weights(engine, path)
    finally:
        safetensors.safe_open = _CountingOpen.real
    return dict(_CountingOpen.reads)


# ---- the rank side ---------------------------------------------------------------------------------

def _train(engine, model, rank: int, world_size: int, hf: bool) -> list[float]:
    losses = []
    for i in range(STEPS):
        x, = rank_slice((_batch(i, model.config.vocab_size if hf else VOCAB),), rank, world_size)
        loss = _loss(engine, x, hf)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _case(name: str, rank: int, world_size: int, files: dict[str, str]) -> dict:
    import fz3
    hf = name in ("llama", "gpt2")
    model = {"llama": lambda: _llama(7), "gpt2": lambda: _gpt2(8),
             "toy_tied": lambda: Toy(9, tied=True)}.get(name, lambda: Toy(9))()
    threshold = 40 if name == "toy_persist" else 0  # 40: lin.weight (36) and the small ones
    cfg = Config(param_persistence_threshold=threshold, compute_dtype="bf16" if name == "toy_bf16" else "fp32")
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), cfg,
                            options=fz3.Options(debug_checks=True))
    out: dict = {}
    if name == "toy_persist":  # gathers the persistent params, which stay gathered
        with torch.no_grad():
            engine(_batch(99, VOCAB)[:1])
        out["persistent_before"] = engine.param_status(model.lin.weight)
    if name == "errors":
        fz3.load_weights(engine, files["toy"])
        before = engine.full_state_dict()
        # bad keys; a folder without weights; a file only rank 0 can read (the others: none)
        for path in (files["bad"], files["empty"], files["toy2"] if rank == 0 else files["toy2"] + ".gone"):
            try:
                fz3.load_weights(engine, path)
                out.setdefault("raised", []).append(None)
            except Exception as e:  # noqa: BLE001 - reported to the test
                out.setdefault("raised", []).append((type(e).__name__, str(e)))
        after = engine.full_state_dict()
        out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
        seen = []  # load_weights inside a forward pass: refused

        def hook(*_):
            try:
                fz3.load_weights(engine, files["toy"])
            except RuntimeError as e:
                seen.append(str(e))
        handle = model.lin.register_forward_pre_hook(hook)
        with torch.no_grad():
            engine(_batch(0, VOCAB))
        handle.remove()
        out["in_forward"] = seen
        return out
    path = files["tied" if name == "toy_tied" else name if hf else "toy"]
    out["reads"] = _load_counting(engine, path)
    out["state"] = engine.full_state_dict()
    out["shapes"] = {k: tuple(engine.store.shapes[engine.param_ids[id(t)]])
                     for k, t in model.state_dict(keep_vars=True).items() if id(t) in engine.param_ids}
    if name == "toy_bf16":  # what a forward computes with: the bf16 full params, the bf16 buffers
        with fz3.gathered_parameters(model):
            out["compute"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if name in ("toy", "toy_persist", "llama"):
        out["losses"] = _train(engine, model, rank, world_size, hf)
        out["trained"] = engine.full_state_dict()
    return out


CASES = ("toy", "toy_persist", "toy_tied", "toy_bf16", "errors", "llama", "gpt2")


def _worker(rank: int, world_size: int, names: tuple, files: dict[str, str]) -> dict:
    out = {}
    for name in names:
        try:
            out[name] = _case(name, rank, world_size, files)
        except Exception:  # noqa: BLE001 - one case's failure is its test's, not the launch's
            out[name] = {"error": traceback.format_exc()}
    return out


@functools.lru_cache(maxsize=None)
def _launch(world_size: int):
    from fz3.launch import run
    names = CASES if _has_transformers() else CASES[:-2]
    try:
        return run(_worker, world_size=world_size, args=(names, _files()), timeout=200), None
    except Exception as e:  # noqa: BLE001 - one failed launch fails its tests, once
        return None, e


def _results(name: str, world_size: int) -> list[dict]:
    per_rank, err = _launch(world_size)
    if err is not None:
        raise AssertionError(f"the {world_size}-rank launch failed") from err
    for rank, res in enumerate(per_rank):
        assert "error" not in res[name], f"{name} / W={world_size}: rank {rank} raised\n{res[name]['error']}"
    return [res[name] for res in per_rank]


# ---- the reference ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _reference(name: str, world_size: int) -> tuple[list[list[float]], dict]:
    """Single-process training from the file's weights: (per step, each rank's loss), state."""
    hf = name == "llama"
    model = _llama(1) if hf else Toy(1)  # what the file was written from
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for i in range(STEPS):
        per_rank = []
        for r in range(world_size):
            x, = rank_slice((_batch(i, model.config.vocab_size if hf else VOCAB),), r, world_size)
            loss = _loss(model, x, hf)
            (loss / world_size).backward()
            per_rank.append(loss.item())
        opt.step()
        opt.zero_grad()
        losses.append(per_rank)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- the checks ------------------------------------------------------------------------------------

def _expected_reads(res: dict, rank: int, world_size: int) -> dict[str, int]:
    """Per name read: a param's flat range [r*s, min((r+1)*s, n)), s = ceil(n / W); a buffer whole."""
    out = {}
    for name, n in ((k, v.numel()) for k, v in res["state"].items()):
        if name in res["shapes"]:
            s = -(-n // world_size)
            n = max(0, min((rank + 1) * s, n) - min(rank * s, n))
        if n:
            out[name] = n
    return out


def check_load(name: str, world_size: int, path_key: str) -> list[dict]:
    per_rank = _results(name, world_size)
    file_state = _file_state(_files()[path_key])
    where = f"{name} / W={world_size}"
    for rank, res in enumerate(per_rank):
        state = res["state"]
        for key, want in file_state.items():
            torch.testing.assert_close(state[key], want.to(state[key].dtype), **EXACT,
                                       msg=lambda m: f"{where}: rank {rank} {key}\n{m}")
        want = _expected_reads(res, rank, world_size)
        got = res["reads"]
        # a tied param is read under the one name its file holds
        assert {k: v for k, v in want.items() if k in file_state} == got, (where, rank, got, want)
        param_total = sum(v.numel() for k, v in file_state.items() if k in res["shapes"])
        param_read = sum(v for k, v in got.items() if k in res["shapes"])
        assert param_read <= -(-param_total // world_size) + len(res["shapes"]), (where, rank, param_read)
    return per_rank


def check_training(name: str, world_size: int) -> None:
    per_rank = _results(name, world_size)
    ref_losses, ref_state = _reference(name, world_size)
    got = torch.tensor([r["losses"] for r in per_rank], dtype=torch.float64).T  # (step, rank)
    torch.testing.assert_close(got, torch.tensor(ref_losses, dtype=torch.float64), **FP32,
                               msg=lambda m: f"{name} / W={world_size}: losses after loading\n{m}")
    for key, want in ref_state.items():
        torch.testing.assert_close(per_rank[0]["trained"][key], want, **FP32,
                                   msg=lambda m: f"{name} / W={world_size}: {key} after {STEPS} steps\n{m}")


WORLDS = pytest.mark.parametrize("world_size", [2, 3])


@WORLDS
def test_file_loads_exactly_each_rank_reading_its_slices(world_size):
    per_rank = check_load("toy", world_size, "toy")
    assert "scratch" not in per_rank[0]["state"]  # non-persistent: neither saved nor loaded
    assert per_rank[0]["state"]["seen"].dtype == torch.int64 and per_rank[0]["state"]["seen"].item() == 1
    # the 0-d param: rank 0 reads its one element, the others nothing
    assert [r["reads"].get("scale", 0) for r in per_rank] == [1] + [0] * (world_size - 1)


@WORLDS
def test_training_after_loading_matches_one_process(world_size):
    check_training("toy", world_size)


@WORLDS
def test_stale_persistent_params_are_regathered(world_size):
    per_rank = check_load("toy_persist", world_size, "toy")
    assert per_rank[0]["persistent_before"] == "AVAILABLE"  # the eval pass left it gathered
    check_training("toy_persist", world_size)


@WORLDS
def test_tied_param_stored_once(world_size):
    file_state = _file_state(_files()["tied"])
    assert "head.weight" in file_state and "emb.weight" not in file_state, sorted(file_state)
    per_rank = check_load("toy_tied", world_size, "tied")
    state = per_rank[0]["state"]
    torch.testing.assert_close(state["emb.weight"], state["head.weight"], **EXACT)


@WORLDS
def test_bf16_compute_shards_refreshed(world_size):
    per_rank = check_load("toy_bf16", world_size, "toy")
    want = Toy(1).state_dict()
    for rank, res in enumerate(per_rank):
        for key, t in want.items():
            exp = t.to(torch.bfloat16) if t.is_floating_point() else t
            torch.testing.assert_close(res["compute"][key], exp, **EXACT,
                                       msg=lambda m: f"bf16 / W={world_size}: rank {rank} {key}\n{m}")


@WORLDS
def test_errors_list_every_problem_and_load_nothing(world_size):
    per_rank = _results("errors", world_size)
    for rank, res in enumerate(per_rank):
        assert res["unchanged"], f"rank {rank}: a failed load_weights changed the engine's weights"
        (kind, msg), (kind2, msg2), (kind3, msg3) = res["raised"]
        assert kind == "ValueError", (kind, msg)
        for needle in ("2 missing", "lin.bias  [6]", "seen  []",
                       "1 unexpected", "extra.weight  [2, 2] in bad.safetensors",
                       "1 mis-shaped", "lin.weight  [6, 5] in bad.safetensors, model has [6, 6]"):
            assert needle in msg, f"{needle!r} not in the message:\n{msg}"
        assert kind2 == "FileNotFoundError" and "model.safetensors" in msg2, (kind2, msg2)
        if rank == 0:  # read its slices, but another rank could not: nothing written
            assert kind3 == "RuntimeError" and f"rank(s) {list(range(1, world_size))}" in msg3, (kind3, msg3)
        else:
            assert kind3 == "FileNotFoundError" and ".gone" in msg3, (kind3, msg3)
        assert len(res["in_forward"]) == 1 and "inside a forward" in res["in_forward"][0], res["in_forward"]


def test_not_an_engine():
    import fz3
    with pytest.raises(TypeError, match="expected the engine fz3.initialize returned, got Linear"):
        fz3.load_weights(nn.Linear(2, 2), "model.safetensors")


@WORLDS
def test_hf_sharded_folder(world_size):
    pytest.importorskip("transformers")
    files = sorted(os.listdir(_files()["llama"]))
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) >= 3, files
    check_load("llama", world_size, "llama")
    check_training("llama", world_size)


@WORLDS
def test_hf_tied_single_file_folder(world_size):
    pytest.importorskip("transformers")
    assert "lm_head.weight" not in _file_state(_files()["gpt2"])  # HF stores the tied param once
    state = check_load("gpt2", world_size, "gpt2")[0]["state"]
    torch.testing.assert_close(state["lm_head.weight"], state["transformer.wte.weight"], **EXACT)
    want = _gpt2(1).state_dict()
    assert list(state) == list(want)
    for key, t in want.items():
        torch.testing.assert_close(state[key], t, **EXACT)
