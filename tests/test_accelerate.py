"""fz3.accelerate.Accelerator (issue #50, point 1): an Accelerate script with one import changed
trains through fz3, on 2 gloo ranks against the same script under plain Accelerate (DDP).

    the script   prepare(model, optimizer, dataloader, scheduler), accumulate() over 2
                 micro-batches, backward, clip_grad_norm_ at the boundary, optimizer and
                 scheduler steps, zero_grad, then gather_for_metrics, save_state,
                 get_state_dict, unwrap_model
    parity       every micro-batch's loss and every boundary's grad norm equal plain
                 Accelerate's (bit for bit here: 2 ranks, one addition); the state dict too
    state        save_state writes the engine's sharded checkpoint beside Accelerate's files, and
                 load_state in a fresh run brings the weights back
    launch       the DeepSpeed config of `accelerate launch` (ACCELERATE_USE_DEEPSPEED and
                 ACCELERATE_DEEPSPEED_CONFIG_FILE) goes to fz3, DeepSpeed never imported, the
                 environment left as it was
    plugin       a DeepSpeedPlugin given as deepspeed_plugin=, made from a DeepSpeed dict
                 (hf_ds_config) or from its own fields (zero_stage=3, ...): its config goes to fz3,
                 with ACCELERATE_USE_DEEPSPEED still set by the launch run before it (as under
                 `accelerate launch`), and DeepSpeed is never set up
    accumulation a DeepSpeed config's gradient_accumulation_steps other than the Accelerator's
                 wins, with a WARNING, as Accelerate rules under DeepSpeed (accelerate's
                 accelerator.py `_prepare_deepspeed`: "Using DeepSpeed's value")
    torchrun     the script launched by torchrun on 2 CPU ranks: the Accelerator joins the group
                 from the environment, Accelerate sees 2 processes, the losses are plain's
    errors       clip_grad_norm_ at another max_norm than the config's gradient_clipping
    imports      `import fz3` never imports accelerate
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("accelerate")

import fz3.launch  # noqa: E402

pytestmark = pytest.mark.timeout(300)

DS = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "gradient_clipping": 0.5,
      "train_micro_batch_size_per_gpu": "auto"}


def _script(rank: int, world: int, kind: str, root: str) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if kind == "plain":
        from accelerate import Accelerator
        acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    elif kind == "fz3":
        from fz3.accelerate import Accelerator
        acc = Accelerator(cpu=True, gradient_accumulation_steps=2, fz3_config=DS)
    elif kind == "plugin":  # Accelerate's own DeepSpeed plugin, from a DeepSpeed dict
        from accelerate.utils import DeepSpeedPlugin
        from fz3.accelerate import Accelerator
        acc = Accelerator(cpu=True, gradient_accumulation_steps=2, deepspeed_plugin=DeepSpeedPlugin(
            hf_ds_config={**DS, "gradient_accumulation_steps": "auto"}))
    elif kind == "plugin_fields":  # ... and from its fields: the config Accelerate writes for them
        from accelerate.utils import DeepSpeedPlugin
        os.environ.pop("ACCELERATE_DEEPSPEED_CONFIG_FILE")  # else the plugin reads the launch run's file
        from fz3.accelerate import Accelerator
        acc = Accelerator(cpu=True, gradient_accumulation_steps=2, deepspeed_plugin=DeepSpeedPlugin(
            zero_stage=3, gradient_accumulation_steps=2, gradient_clipping=0.5))
    else:  # what `accelerate launch` with a DeepSpeed config file sets
        with open(f"{root}/ds.json", "w") as f:
            json.dump(DS, f)
        os.environ.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_CONFIG_FILE=f"{root}/ds.json")
        from fz3.accelerate import Accelerator
        acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g1),
                                                                      torch.randn(32, 1, generator=g2)), batch_size=4)
    model, opt, data, sched = acc.prepare(model, opt, data, sched)
    losses, norms = [], []
    for x, y in data:
        with acc.accumulate(model):
            loss = ((model(x) - y) ** 2).mean()
            acc.backward(loss)
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), 0.5)))
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(loss.item())
    gathered = acc.gather_for_metrics(torch.tensor([float(rank)]))  # every rank's, in rank order
    out = {"losses": losses, "norms": norms, "unwrapped": type(acc.unwrap_model(model)).__name__,
           "gathered": gathered.tolist(),
           "env": os.environ.get("ACCELERATE_USE_DEEPSPEED"), "deepspeed": "deepspeed" in sys.modules}
    sd = acc.get_state_dict(model)
    out["state"] = None if sd is None else {k: v.float().clone() for k, v in sd.items()}
    if kind == "fz3":
        acc.save_state(f"{root}/state")
        out["saved"] = sorted(os.listdir(f"{root}/state"))
        try:
            acc.clip_grad_norm_(model.parameters(), 1.0)
        except ValueError as e:
            out["clip_error"] = str(e)
        torch.manual_seed(5)  # other weights: load_state must bring the saved ones back
        fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        acc2 = Accelerator(cpu=True, gradient_accumulation_steps=2, fz3_config=DS)
        opt2 = torch.optim.SGD(fresh.parameters(), lr=0.1)
        fresh, opt2, _ = acc2.prepare(fresh, opt2, torch.optim.lr_scheduler.StepLR(opt2, 1, gamma=0.5))
        acc2.load_state(f"{root}/state")
        out["reloaded"] = {k: v.float() for k, v in fresh.full_state_dict().items()}
        out["full"] = {k: v.float() for k, v in model.full_state_dict().items()}
    return out


KINDS = ("plain", "fz3", "launch", "plugin", "plugin_fields")


def _scripts(rank: int, world: int, root: str) -> dict:
    """The runs one after the other in the same ranks (one launch: process starts are slow)."""
    out = {}
    for kind in KINDS:
        os.makedirs(f"{root}/{kind}", exist_ok=True)
        out[kind] = _script(rank, world, kind, f"{root}/{kind}")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    with fz3.launch.spawn_environment({"FZ3_DEVICE": "cpu"}):
        per_rank = fz3.launch.run(_scripts, world_size=2, args=(str(tmp_path_factory.mktemp("accelerate")),),
                                  timeout=180)
    return {kind: [r[kind] for r in per_rank] for kind in KINDS}


@pytest.mark.parametrize("kind", ["fz3", "launch", "plugin", "plugin_fields"])
def test_an_accelerate_script_trains_as_under_plain_accelerate(runs, kind):
    for got, want in zip(runs[kind], runs["plain"]):
        assert got["losses"] == want["losses"] and got["norms"] == want["norms"], (got, want)
        assert got["unwrapped"] == "Sequential" and not got["deepspeed"] and got["gathered"] == [0.0, 1.0]
    assert runs[kind][1]["state"] is None  # rank 0's, as under DeepSpeed
    for k, v in runs["plain"][0]["state"].items():
        assert torch.equal(runs[kind][0]["state"][k], v), k
    assert runs["launch"][0]["env"] == "true"  # given back after the Accelerator was made


def test_save_state_and_load_state_carry_the_engine(runs):
    o = runs["fz3"][0]
    assert "fz3_engine_0" in o["saved"] and any(n.startswith("random_states") for n in o["saved"]), o["saved"]
    assert all(torch.equal(o["reloaded"][k], v) for k, v in o["full"].items())
    assert "gradient_clipping=0.5" in o["clip_error"] and "max_norm=1.0" in o["clip_error"]


def test_import_fz3_never_imports_accelerate():
    code = "import sys, fz3; print('accelerate' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_mixed_precision_the_config_does_not_give_is_said(caplog):
    from accelerate.state import AcceleratorState
    from fz3.accelerate import Accelerator
    try:
        with caplog.at_level("WARNING", logger="fz3"):
            acc = Accelerator(cpu=True, mixed_precision="bf16", fz3_config=DS)
    finally:  # Accelerate's state is a process-wide singleton: the tests after this one start afresh
        AcceleratorState._reset_state(reset_partial_state=True)
    assert acc.fz3_config.compute_dtype == "fp32"
    said = [r.getMessage() for r in caplog.records if "mixed_precision='bf16'" in r.getMessage()]
    assert said and "computes in fp32" in said[0] and '"bf16": {"enabled": true}' in said[0], caplog.text


def test_the_deepspeed_configs_accumulation_wins_with_a_warning(caplog):
    """A DeepSpeedPlugin made from a dict without gradient_accumulation_steps writes 1 into it
    (accelerate's DeepSpeedPlugin.__post_init__); Accelerate then uses that, not the Accelerator's
    2, and says so. fz3 does the same, and one plugin is all it takes."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin
    from fz3.accelerate import Accelerator
    try:
        with caplog.at_level("WARNING", logger="fz3"):
            acc = Accelerator(cpu=True, gradient_accumulation_steps=2,
                              deepspeed_plugin=DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 3}}))
        assert acc.fz3_config.gradient_accumulation_steps == 1 and acc.gradient_accumulation_steps == 1
        assert acc.state.distributed_type.name != "DEEPSPEED"  # Accelerate never set DeepSpeed up
        said = [r.getMessage() for r in caplog.records if "mismatch" in r.getMessage()]
        assert said and "the Accelerator has 2, the DeepSpeed config has 1" in said[0], caplog.text
        with pytest.raises(ValueError, match="deepspeed_plugin is a dict of 2 plugins .'a', 'b'.*one DeepSpeedPlugin"):
            Accelerator(cpu=True, deepspeed_plugin={"a": None, "b": None})
    finally:  # Accelerate's state is a process-wide singleton: the tests after this one start afresh
        AcceleratorState._reset_state(reset_partial_state=True)


def test_under_torchrun_the_accelerator_joins_the_group(runs, tmp_path):
    import signal
    from fz3.launch import free_port
    from tests.support import accelerate_torchrun as script
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FZ3_DEVICE": "cpu"}
    env.pop("ACCELERATE_USE_DEEPSPEED", None)
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                              "--master_addr", "127.0.0.1", "--master_port", str(free_port()), script.__file__,
                              str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        log = agent.communicate(timeout=240)[0]
    except subprocess.TimeoutExpired:
        os.killpg(agent.pid, signal.SIGKILL)
        pytest.fail("torchrun did not finish within 240 s")
    assert agent.returncode == 0, log[-4000:]
    for rank in range(2):
        got = json.load(open(tmp_path / f"rank{rank}.json"))
        want = runs["plain"][rank]
        assert got["num_processes"] == 2 and got["gathered"] == [0.0, 1.0]
        assert got["losses"] == want["losses"] and got["norms"] == want["norms"], (got, want)
