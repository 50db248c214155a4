"""fz3 on 1, 2 and 3 gloo ranks against single-process training (issue #4, invariant I7).

Run: python -m pytest tests/test_parity.py -rA     (-rA shows each model's deviation summary)

One launch per world size runs every model under every named config (tests/support/parity.py);
the first test that needs a world size pays for its launch, the rest read the cached results.
Per (model, config), 5 optimizer steps with gradient accumulation 2 (10 micro-steps), each checks:

    every rank's loss at every micro-step       == reference (same rank slice, same weights)
    every param (and buffer) after the last step == reference (full_state_dict on rank 0)
    I1 at every event: live numel that no active module, hold, persistence or external
       registration pins <= max_live_parameters;  stats()["peak_live_numel"] <= that + pinned
    after every step(): every non-persistent param NOT_AVAILABLE (externals too at a boundary)
    Options(debug_checks=True) (all configs but ds_defaults): the core's invariants after every event

Tolerances.
  fp32: rtol 1e-5 (the issue's bound) and atol 1e-6. Why an atol: fz3 sums grads over ranks in
    another order than one process does, so a grad differs by a few fp32 ulps of its largest
    term; a param that ends near zero (a bias that started at 0) carries that absolute error,
    ~1e-7, which no relative bound on a tiny value can absorb. Seen over W = 1, 2, 3: losses
    <= 4e-7 rel; params <= 1e-6 abs (<= 1.2e-7 but for moe at W=3), the 1.2e-7 being 2.3e-5 of
    a 5e-3 param. At W=1 most fp32 runs are bit-exact (all <= 3e-8).
  bf16 (compute in bf16, fp32 master shards, SGD momentum 0.9, lr 0.05): losses rtol 2e-2,
    atol 2e-3; params rtol 2e-2, atol 6e-3. bf16 keeps 8 significant bits: each rounding is up to
    2^-9 ~ 2e-3 relative and a forward of ~20 rounded ops plus bf16 grads reduced in bf16 land
    at ~1e-2 relative on a loss; a squared-error loss near 0 keeps the absolute error of its
    residuals, hence the atol. The momentum-SGD step sums lr * grad over 5 steps (an effective
    lr of ~0.65 per unit grad), so ~1 % grad error moves a param by ~1e-3. Seen: losses <= 1.5e-2
    abs (a loss of 3.4) and 1.5e-3 abs on a loss of 0.05; params <= 2.7e-3 abs. Grads scaled by
    W instead of W * gas moved params by 0.4 and losses by 0.4 to 1.8 (checked by mutation).
"""
from __future__ import annotations

import functools

import pytest
import torch

from tests.support import parity
from tests.support.parity_models import MODELS

pytestmark = pytest.mark.timeout(600)  # the first test per world size launches its ranks

FP32 = dict(rtol=1e-5, atol=1e-6)
BF16_LOSS = dict(rtol=2e-2, atol=2e-3)
BF16_PARAM = dict(rtol=2e-2, atol=6e-3)
GLOO = parity.device().type == "cpu"  # the ranks' backend: gloo on the CPU (FZ3_DEVICE, else picked)
STATS_KEYS = {"all_gather", "all_gather_on_demand", "all_gather_prefetch", "all_gather_via_all_reduce",
              "all_gather_via_native", "all_gather_via_p2p", "gathered_bytes", "reduce",
              "reduce_all_reduce", "reduce_p2p", "reduce_reduce_scatter", "reduced_bytes",
              "live_numel", "peak_live_numel", "reduce_buffer_bytes", "trace",
              "trace_invalidations", "micro_step", "optimizer_steps", "param_shards",
              "grad_partitions"}


@functools.lru_cache(maxsize=None)
def _launch(world_size: int):
    try:
        return parity.run_world(world_size, tuple(MODELS), timeout=300), None
    except Exception as e:  # noqa: BLE001 - one failed launch fails its tests, once
        return None, e


def world(world_size: int) -> dict:
    res, err = _launch(world_size)
    if err is not None:
        raise AssertionError(f"the {world_size}-rank launch failed") from err
    return res


reference = parity.cached_reference


DYNAMIC_ORDER = ("branch",)  # models whose module order changes between passes


def check_model(model: str, world_size: int) -> None:
    res = world(world_size)
    summary = []
    for cname in parity.configs_for(model):
        key = (model, cname)
        where = f"{model} / {cname} / W={world_size}"
        errors = res["rank_errors"][key]
        assert not errors, f"{where}: a rank raised\n" + errors[0]
        cfg, opts = parity.config_named(cname), parity.options_named(cname)
        r = res[key]
        ref = reference(model, world_size, parity.optimizer_for(cname), cfg.gradient_clipping)
        loss_tol, param_tol = (FP32, FP32) if cfg.compute_dtype == "fp32" else (BF16_LOSS, BF16_PARAM)
        loss_dev, param_abs, param_rel = parity.assert_trains_as(res, key, ref, loss_tol, param_tol, where)

        assert r.budget_max <= cfg.max_live_parameters, (
            f"{where}: {r.budget_max} live elements were neither pinned nor within "
            f"max_live_parameters={cfg.max_live_parameters} (I1)")
        peak = r.stats["peak_live_numel"]
        assert peak == r.observed_peak, f"{where}: a peak inside one transition went unseen"
        assert peak <= cfg.max_live_parameters + r.pinned_max, (where, peak, r.peak_detail)
        assert not res["rank_not_available"][key], (where, res["rank_not_available"][key][:5])
        assert r.stats["optimizer_steps"] == parity.STEPS and r.stats["micro_step"] == 0, where
        if cfg.prefetch_bucket_size == 0:
            assert r.stats["all_gather_prefetch"] == 0, where
        if cname == "base":
            assert r.train_prefetch > 0, f"{where}: prefetch never ran in a training pass"
        if model not in DYNAMIC_ORDER:  # the same module order every pass: the trace completes
            assert r.train_trace == "COMPLETE", f"{where}: training trace {r.train_trace}"
        # the collective each reduce and gather ran: the one its config names on gloo, the
        # backend's own (native) on nccl / hccl, where the gloo switches mean nothing
        gather_by, scatter_by = ((opts.gloo_all_gather, opts.gloo_reduce_scatter) if GLOO
                                 else ("native", "native"))
        rs_by = {"p2p": "reduce_p2p", "native": "reduce_reduce_scatter", "all_reduce": "reduce_all_reduce"}
        want = rs_by[scatter_by] if cfg.reduce_scatter else "reduce_all_reduce"
        used = {k: r.stats[k] for k in rs_by.values() if r.stats[k]}
        assert used == ({want: r.stats["reduce"]} if r.stats["reduce"] else {}), (where, used)
        used = {k: r.stats[k] for k in r.stats if k.startswith("all_gather_via_") and r.stats[k]}
        # a p2p reduce-scatter sends straight from the grads: no IPG bucket buffer is allocated
        if cfg.reduce_scatter and scatter_by == "p2p":
            assert r.stats["reduce_buffer_bytes"] == 0, (where, r.stats["reduce_buffer_bytes"])
        n = r.stats["all_gather"]
        assert used == ({f"all_gather_via_{gather_by}": n} if n else {}), (where, used)
        if cfg.max_live_parameters < 10**6:
            chain = cfg.max_live_parameters + max(r.chains)
            assert peak <= chain or model in CHAIN_EXCEPTIONS, (
                f"{where}: peak {peak} > max_live + deepest chain {chain}: {r.peak_detail}")
            bound = cfg.max_live_parameters + max(r.units)
            assert peak <= bound or model in PEAK_EXCEPTIONS + CHAIN_EXCEPTIONS, (
                f"{where}: peak {peak} > max_live + largest unit {bound}: {r.peak_detail}")
        summary.append(f"  {cname:15s} loss abs {loss_dev[0]:.1e} rel {loss_dev[1]:.1e} | params abs "
                       f"{param_abs:.1e} rel {param_rel:.1e} | peak {peak}, unpinned max "
                       f"{r.budget_max}" + _bounds(cfg, r, peak))
    print(f"\n{model} W={world_size}\n" + "\n".join(summary))


# The peak bound (max_live + the largest unit) holds for every model but `external`:
# there the root's unit (48: the external params it uses, pinned to the step's end) stays
# gathered while nn.MultiheadAttention's (144) is fetched on demand, because the root's forward
# is still running around the call, as any parent's is (DeepSpeed and FSDP2 alike keep a running
# parent unsharded). Every model is held to max_live + the deepest chain of nested units, and
# the excess is printed. (`albert`, a block applied K times, was the other exception until
# post-backward released per call: 283 -> 139 against a bound of 154, W=2.)
PEAK_EXCEPTIONS = ("external",)
# Activation checkpointing recomputes a region's forward inside backward: the recomputed modules
# are fetched while the calls whose backward asked for them are still open, so two chains of
# units are live at once (seen: 162 against a chain bound of 144, tiny config, W=2: `other`'s
# region recomputed while `shared` and its norm were open). I1 (the budget check above) holds.
CHAIN_EXCEPTIONS = ("checkpoint",)


def _bounds(cfg, r, peak: int) -> str:
    """With a small live budget: the peak against max_live + the largest unit and against
    max_live + the deepest chain of units (both asserted above; the first not for PEAK_EXCEPTIONS)."""
    if cfg.max_live_parameters >= 10**6:
        return ""
    unit, chain = cfg.max_live_parameters + max(r.units), cfg.max_live_parameters + max(r.chains)
    verdict = lambda b: "ok" if peak <= b else "EXCEEDED"  # noqa: E731
    return (f" | max_live+largest unit {unit} {verdict(unit)}, +deepest chain {chain} "
            f"{verdict(chain)}" + (f" | {r.peak_detail}" if peak > unit else ""))


WORLDS = pytest.mark.parametrize("world_size", [1, 2, 3])


@WORLDS
def test_gpt_tied_embeddings(world_size):
    check_model("gpt", world_size)


@WORLDS
def test_albert_block_applied_k_times(world_size):
    check_model("albert", world_size)


@WORLDS
def test_external_params(world_size):
    check_model("external", world_size)


@WORLDS
def test_branch_changes_between_steps(world_size):
    check_model("branch", world_size)
    for cname in parity.configs_for("branch"):
        stats = world(world_size)[("branch", cname)].stats
        assert stats["trace_invalidations"] >= 2, (cname, stats)  # the trace left its plan


@WORLDS
def test_frozen_params(world_size):
    check_model("frozen", world_size)


@WORLDS
def test_structured_outputs(world_size):
    check_model("structured", world_size)


@WORLDS
def test_odd_numels(world_size):
    check_model("odd", world_size)


@WORLDS
def test_containers_dataclass_and_pytree_outputs(world_size):
    check_model("containers", world_size)


@WORLDS
def test_activation_checkpointing(world_size):
    check_model("checkpoint", world_size)


@WORLDS
def test_moe_leaf_module(world_size):
    check_model("moe", world_size)
    if world_size > 1:  # the data made the ranks run different experts
        used = world(world_size)["rank_experts"][("moe", "base")]
        assert any(len({ranks[i] for ranks in used}) > 1 for i in range(len(used[0]))), used
        assert any(len(step) < 3 for ranks in used for step in ranks), used


# ---- the public API, checked in the same launches ---------------------------------------------

def _edit(net):
    with torch.no_grad():
        net.blocks[0].qkv.weight.fill_(0.25)
        net.blocks[0].proj.bias.add_(1.0)


@pytest.mark.parametrize("world_size", [2, 3])
def test_api(world_size):
    """Config.from_deepspeed accepted by initialize; full_state_dict keys; stats keys;
    gathered_parameters with modifier_rank=0 (rank 0's edit reaches every rank and the next
    step trains from it) and with None (every rank's edits discarded)."""
    res = world(world_size)
    assert not res["rank_errors"][("gpt", "ds_defaults")]
    net = MODELS["gpt"].build()
    _edit(net)
    edited = net.state_dict()
    assert not torch.equal(edited["blocks.0.qkv.weight"], MODELS["gpt"].build().blocks[0].qkv.weight)
    ref = parity.reference("gpt", world_size, "adamw", edit=_edit, steps=1, evals=False)
    ref_losses, ref_state = ref.losses, ref.state
    for rank, probe in enumerate(res["rank_probes"]):
        assert "error" not in probe, probe.get("error")
        assert probe["full_keys"] == probe["state_dict_keys"]  # order too; tied: both names
        assert {"wte.weight", "lm_head.weight"} <= set(probe["full_keys"])
        assert STATS_KEYS <= set(probe["stats"]), STATS_KEYS - set(probe["stats"])
        assert probe["inside_shape"] == (30, 10) and probe["inside_status"] == "AVAILABLE"
        assert probe["status_after"] == "NOT_AVAILABLE"
        for name, value in edited.items():
            torch.testing.assert_close(probe["after_modify"][name], value, rtol=0, atol=0,
                                       msg=f"rank {rank}: {name} after modifier_rank=0")
        for name in ("wte.weight", "lm_head.weight", "ln_f.bias"):
            torch.testing.assert_close(probe["after_discard"][name], edited[name], rtol=0, atol=0,
                                       msg=f"rank {rank}: {name} after modifier_rank=None")
        torch.testing.assert_close(torch.tensor(probe["losses_after_edit"]),
                                   torch.tensor([losses[rank] for losses in ref_losses]), **FP32)
        for name, value in ref_state.items():
            torch.testing.assert_close(probe["state_after_edit_step"][name], value, **FP32)


@WORLDS
def test_communication_data_type_fp32_with_bf16_compute(world_size):
    """communication_data_type="fp32" under bf16 compute: the same reduces as the bf16 config,
    each moving fp32, twice the bytes (its parity with single-process training: check_model,
    run by test_gpt_tied_embeddings, with prescale_gradients and gradient_predivide_factor)."""
    res = world(world_size)
    bf16, fp32 = (res[("gpt", c)].stats for c in ("bf16", "bf16_comm_fp32"))
    assert fp32["reduce"] == bf16["reduce"] > 0
    assert fp32["reduced_bytes"] == 2 * bf16["reduced_bytes"], (fp32["reduced_bytes"], bf16["reduced_bytes"])
