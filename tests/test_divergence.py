"""Ranks that run different modules raise fz3.DivergenceError, every one of them, before the
mismatched collective's data moves, instead of hanging (fz3/interpreters/agreement.py).

A branch that one rank takes and the others do not, in forward (an extra module) and in backward
(a detached output: no backward through two modules), on 2 and 3 ranks, at the first step (the
trace is recording: on-demand gathers) and at the third (prefetch along a recorded trace). Every
rank must end with the error, naming each rank's position, in well under the test's timeout;
and every later call on its engine must raise one clear DivergenceError saying what to do.

Faults named for what they are (issue #23): a peer that raises or exits is named as gone, with
the collective each survivor was at, within seconds; a peer that stalls, after the process
group's own timeout; a data-dependent expert choice names the leaf module that fixes it.
"""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from fz3 import launch

pytestmark = pytest.mark.timeout(300)


class Branchy(nn.Module):
    def __init__(self, where: str, odd: int, at_step: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.extra, self.c = (nn.Linear(16, 16) for _ in range(4))
        self.where, self.odd, self.at_step, self.steps = where, odd, at_step, 0

    def forward(self, x):
        import torch.distributed as dist
        from fz3.interpreters import threads
        rank = threads.current().rank if threads.current() is not None else dist.get_rank()
        branch = rank == self.odd and self.steps >= self.at_step
        self.steps += 1
        x = self.b(self.a(x).relu())
        if branch and self.where == "forward":
            x = self.extra(x)
        if branch and self.where == "backward":
            x = x.detach()  # no backward through a and b on this rank
        return self.c(x)


NATIVE = {"gloo_all_gather": "native", "gloo_reduce_scatter": "native"}  # the carriers of NCCL and HCCL


def _train(rank: int, world: int, where: str, at_step: int, native: bool = False) -> dict:
    import fz3
    model = Branchy(where, world - 1, at_step)
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            fz3.Config(param_persistence_threshold=0, reduce_bucket_size=300),
                            options=fz3.Options(**NATIVE) if native else fz3.Options())
    x = torch.ones(2, 16)
    t0 = time.monotonic()
    try:
        for step in range(at_step + 2):
            t0 = time.monotonic()
            engine.backward(engine(x).square().mean())
            engine.step()
    except fz3.DivergenceError as e:
        import tempfile
        seconds = time.monotonic() - t0
        return {"error": str(e), "step": step, "seconds": seconds, "after": _every_call(engine, tempfile.mkdtemp())}
    return {"error": None, "step": step}


@pytest.mark.parametrize("world, where, at_step", [  # each value of each twice, each pair once
    (2, "forward", 0), (2, "backward", 2), (3, "forward", 2), (3, "backward", 0)])
def test_every_rank_raises_instead_of_hanging(world, where, at_step):
    t0 = time.monotonic()
    outs = launch.run(_train, world_size=world, args=(where, at_step), timeout=200)
    assert time.monotonic() - t0 < 120
    for rank, out in enumerate(outs):
        assert out["error"] is not None, f"rank {rank} trained on: {out}"
        assert out["step"] == at_step and out["seconds"] < 30, out
        msg = out["error"]
        assert "ranks diverged" in msg and "before any data of this collective was received" in msg, msg
        for r in range(world):
            assert f"rank {r}: step {at_step + 1}, collective" in msg, msg
        assert "module '" in msg, msg
        assert "These are modules under one parent" not in msg, msg  # siblings under the root: no leaf hint
        _assert_refused_after(out, "ranks diverged")  # a user trying the next batch


@pytest.mark.parametrize("where, at_step", [("forward", 0), ("backward", 2)])
def test_on_the_native_carriers_every_rank_raises_before_using_the_data(where, at_step):
    """[Note: native collectives checked ahead] The backend's own collectives have no tags: run
    asynchronously their data is posted beside their descriptors, which the wait compares before
    the result is used. A rank off the others' path still raises on every rank, in the step it
    diverged, naming each rank's collective."""
    outs = launch.run_threads(_train, 2, args=(where, at_step, True))  # gloo's own aborts instead (AHEAD)
    for rank, out in enumerate(outs):
        assert out["error"] is not None and out["step"] == at_step and out["seconds"] < 30, out
        msg = out["error"]
        assert "ranks diverged" in msg and "before any data of this collective was used" in msg, msg
        assert all(f"rank {r}: step {at_step + 1}, collective" in msg for r in range(2)), msg
        _assert_refused_after(out, "ranks diverged")


def test_a_native_collective_is_posted_without_waiting_for_its_peers(monkeypatch):
    """Posted ahead, a collective's descriptors are not waited for at issue (the host runs on):
    the peers' never arrive here, and nothing blocks until the wait, which names the stall."""
    from fz3 import DivergenceError
    from fz3.interpreters import agreement
    monkeypatch.setenv("FZ3_DIVERGENCE_TIMEOUT", "0.2")

    class Pending:
        def wait(self, timeout=None):
            time.sleep(timeout.total_seconds() if timeout else 0)
            raise RuntimeError("Timed out waiting 200ms for recv operation to complete")

    class Comm(_Comm):
        def isend(self, t, dst, tag):
            return Pending()
        irecv = isend

    ag = agreement.Agreement(Comm(), agreement.describe_with(["w"], ["lin"]))
    t0 = time.monotonic()
    posted = ag.ahead(agreement.GATHER, (0,), 4)
    work = ag.issue(posted, lambda: _Done())
    assert time.monotonic() - t0 < 0.1 and ag.unresolved == [posted]  # nothing waited yet
    with pytest.raises(DivergenceError, match="did not reach a collective"):
        work.wait()
    with pytest.raises(DivergenceError):  # out of step for good
        ag.ahead(agreement.GATHER, (0,), 4)


class _Done:
    def wait(self):
        return True


def test_the_message_names_what_each_rank_was_about_to_gather():
    """Rank 1 runs `extra` after b; rank 0 goes on to c."""
    for out in launch.run(_train, world_size=2, args=("forward", 0), timeout=200):
        msg = out["error"]
        assert "rank 0: step 1, collective 3: all-gather of 2 params ('c.weight' .. 'c.bias', 272 elements) " \
               "of module 'c'" in msg, msg
        assert "rank 1: step 1, collective 3: all-gather of 2 params ('extra.weight' .. 'extra.bias', 272 " \
               "elements) of module 'extra'" in msg, msg


def _same(rank: int, world: int) -> dict:
    import fz3
    model = Branchy("forward", -1, 0)  # no rank branches
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            fz3.Config(param_persistence_threshold=0, reduce_bucket_size=300))
    for _ in range(3):
        engine.backward(engine(torch.ones(2, 16)).square().mean())
        engine.step()
    return {"agreement": engine.interp.agreement is not None, "step": engine.interp.agreement.step}


def test_ranks_that_agree_train_on_with_the_check_on():
    for out in launch.run(_same, world_size=3, timeout=200):
        assert out == {"agreement": True, "step": 3}


def _exchange(rank: int, world: int, mine: int) -> dict:
    """Rank r posts the descriptor of a gather of param `mine * r` (the ranks differ when `mine`
    is 1 and agree when it is 0) and sends its data to the peer under the descriptor's tag."""
    from fz3 import DivergenceError
    from fz3.interpreters import agreement, threads
    from fz3.interpreters.transport import TorchTransport
    comm = threads.current() or TorchTransport()
    ag = agreement.Agreement.for_transport(comm, lambda v: str(v))
    posted = ag.post(agreement.GATHER, (mine * rank,), 4)
    got = torch.full((4,), -1.0)
    peer = 1 - rank
    recv = comm.irecv(got, peer, posted.tag)
    send = comm.isend(torch.full((4,), float(rank)), peer, posted.tag)
    work = ag.guard(posted, recv)
    try:
        work.wait()
    except DivergenceError as e:
        if threads.current() is None:
            time.sleep(1.0)  # the peer's data had every chance to arrive
        return {"error": str(e), "received": recv.is_completed(), "got": got.tolist(), "norm": None}
    send.wait()
    norm = ag.all_reduce_sum(torch.tensor([0.1 + rank], dtype=torch.float64))
    return {"error": None, "received": True, "got": got.tolist(), "norm": norm.item()}


RUNNERS = {"processes": lambda fn, args: launch.run(fn, world_size=2, args=args, timeout=120),
           "threads": lambda fn, args: launch.run_threads(fn, 2, args)}


@pytest.mark.parametrize("runner", sorted(RUNNERS))
def test_data_posted_under_a_mismatched_descriptor_is_never_received(runner):
    """[Note: descriptors beside the data] the data travels under a tag made from the descriptor:
    ranks at different collectives post different tags, so nothing of the other's arrives."""
    for rank, out in enumerate(RUNNERS[runner](_exchange, (1,))):
        assert out["error"] is not None and "ranks diverged" in out["error"], out
        assert not out["received"] and out["got"] == [-1.0] * 4, out


@pytest.mark.parametrize("runner", sorted(RUNNERS))
def test_agreeing_ranks_exchange_their_data_and_sum_the_norm_in_rank_order(runner):
    for rank, out in enumerate(RUNNERS[runner](_exchange, (0,))):
        assert out["error"] is None and out["got"] == [float(1 - rank)] * 4, out
        assert out["norm"] == 0.1 + 1.1  # the same bits on every rank: rank 0's value plus rank 1's


# ---- faults named for what they are (issue #23) ------------------------------------------------

STALL_S = 8.0
GROUP_TIMEOUT_S = 5.0  # also init_process_group's: the ranks must start within it of each other


def _leave(rank: int, world: int, how: str, out_dir: str) -> None:
    """Two steps; at the second, the last rank leaves before its forward: it raises, calls
    os._exit, or sleeps past the group's timeout. The others write down what they got, when, and
    what the engine says after. (Files: a rank that leaves fails launch.run, results and all.)"""
    import json
    import os

    import fz3
    model = Branchy("forward", -1, 0)
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            fz3.Config(param_persistence_threshold=0, reduce_bucket_size=300))
    x = torch.ones(2, 16)
    engine.backward(engine(x).square().mean())
    engine.step()
    if rank == world - 1:
        if how == "raises":
            raise ValueError("the peer's own error")
        if how == "exits":
            os._exit(3)
        time.sleep(STALL_S)  # stalls: alive, issuing no collective
    t0 = time.monotonic()
    try:
        engine.backward(engine(x).square().mean())
        out = {"error": None}
    except fz3.DivergenceError as e:
        out = {"error": str(e), "seconds": time.monotonic() - t0,
               "timeout": engine.interp.agreement.timeout.total_seconds()}
    out["after"] = _every_call(engine, out_dir)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    if world > 2:
        time.sleep(2.0)  # up a while: a survivor that exited at once could be named by the others instead


def _every_call(engine, out_dir: str) -> dict:
    """What each public call raises on an engine past a DivergenceError: (type, message)."""
    import fz3
    calls = {"forward": lambda: engine(torch.ones(2, 16)),
             "module forward": lambda: engine.module(torch.ones(2, 16)),
             "backward": lambda: engine.backward(torch.ones((), requires_grad=True)),
             "step": engine.step,
             "full_state_dict": engine.full_state_dict,
             "save_checkpoint": lambda: engine.save_checkpoint(out_dir),
             "load_checkpoint": lambda: engine.load_checkpoint(out_dir),
             "gathered_parameters": lambda: fz3.gathered_parameters(engine.module.a).__enter__()}
    got = {}
    for name, call in calls.items():
        try:
            call()
            got[name] = None
        except Exception as e:  # noqa: BLE001 - the test looks at what it was
            got[name] = (type(e).__name__, str(e))
    return got


def _survivors(world: int, how: str, tmp_path) -> list[dict]:
    import json
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="a rank failed"):
        launch.run(_leave, world_size=world, args=(how, str(tmp_path)), timeout=120,
                   group_timeout=GROUP_TIMEOUT_S if how == "stalls" else None)
    assert time.monotonic() - t0 < 100
    return [json.load(open(tmp_path / f"rank{r}.json")) for r in range(world - 1)]


def _assert_refused_after(out: dict, first: str) -> None:
    """Every later call: one DivergenceError saying the engine stopped, what to do, and the first."""
    for name, got in out["after"].items():
        assert got is not None, f"{name} ran on a stopped engine"
        kind, msg = got
        assert kind == "DivergenceError", (name, got)
        assert "stopped at a DivergenceError and runs nothing more" in msg, (name, msg)
        assert "Restart every rank's process" in msg and "engine.load_checkpoint(save_dir)" in msg, (name, msg)
        assert first in msg, (name, msg)


@pytest.mark.parametrize("world, how", [(2, "raises"), (3, "exits")])
def test_a_peer_that_leaves_is_named_as_gone_within_seconds(world, how, tmp_path):
    """A peer whose process ends closes its connections: the others' wait for its descriptor
    fails at once, and each names that rank and the collective it was at (not a timeout)."""
    gone = world - 1
    for out in _survivors(world, how, tmp_path):
        msg = out["error"]
        assert msg is not None and out["seconds"] < 10, out
        assert f"rank {gone} exited or closed its connection" in msg, msg
        assert "while this rank was at step 2, collective 1: all-gather" in msg and "of module 'a'" in msg, msg
        assert "did not reach" not in msg, msg
        _assert_refused_after(out, f"rank {gone} exited or closed its connection")


def test_a_peer_that_stalls_is_reported_after_the_groups_timeout(tmp_path):
    """A peer that is alive but issues no collective: reported once the process group's own
    timeout (what init_process_group was given) has passed, not torch's default 30 minutes."""
    out, = _survivors(2, "stalls", tmp_path)
    msg = out["error"]
    assert msg is not None and out["timeout"] == GROUP_TIMEOUT_S, out
    assert GROUP_TIMEOUT_S - 0.5 < out["seconds"] < GROUP_TIMEOUT_S + 5, out
    assert f"rank 1 did not reach a collective within {GROUP_TIMEOUT_S:.0f} s (the process group's timeout) " \
           "while this rank was at step 2, collective 1: all-gather" in msg, msg
    _assert_refused_after(out, "rank 1 did not reach a collective")


class MoE(nn.Module):
    """Top-1 hash routing: row t goes to expert argmax(x_t[:n]); only experts given rows run."""

    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.n = n
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x):
        choice = x[:, :self.n].argmax(-1)  # (B,)
        out = torch.zeros_like(x)
        for e in sorted(set(choice.tolist())):
            rows = (choice == e).nonzero()[:, 0]
            out = out.index_put((rows,), self.experts[e](x[rows]))
        return out


class MoENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.moe, self.head = MoE(8, 4), nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.moe(x))


def _moe_batch(rank: int) -> torch.Tensor:
    """Rows that all go to expert `rank`: each rank runs a different expert."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(4, 8, generator=g)  # (B, C)
    x[:, rank] += 10.0
    return x


def _moe(rank: int, world: int) -> dict:
    """The MoE marked a leaf trains; then a fresh one, unmarked, diverges (last: the ranks are
    out of step after it)."""
    import fz3
    out = {}
    for leaf in (True, False):
        net = MoENet()
        if leaf:
            fz3.set_leaf_modules(net, [MoE])
        engine = fz3.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                fz3.Config(param_persistence_threshold=0))
        try:
            for _ in range(2):
                engine.backward(engine(_moe_batch(rank)).square().mean())
                engine.step()
            out[leaf] = {"error": None, "state": engine.full_state_dict()}
        except fz3.DivergenceError as e:
            out[leaf] = {"error": str(e)}
    return out


@pytest.fixture(scope="module")
def moe_runs() -> list[dict]:
    return launch.run(_moe, world_size=2, timeout=120)


def test_a_data_dependent_expert_choice_names_the_leaf_module_to_mark(moe_runs):
    for out in moe_runs:
        msg = out[False]["error"]
        assert msg is not None and "ranks diverged" in msg, out[False]
        assert "These are modules under one parent, 'moe' (MoE): 'moe.experts.0' on rank 0; 'moe.experts.1' on " \
               "rank 1." in msg, msg
        assert "fz3.set_leaf_modules(model, [MoE]) before fz3.initialize (DeepSpeed: " \
               "deepspeed.utils.set_z3_leaf_modules(model, [MoE]), or zero_optimization.leaf_module)" in msg, msg


def test_the_moe_marked_a_leaf_trains_at_parity(moe_runs):
    """The fix the hint names: both ranks train, and equal the mean loss over both ranks'
    batches trained in one process."""
    ref = MoENet()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        sum(ref(_moe_batch(r)).square().mean() for r in range(2)).div(2).backward()
        opt.step()
    for out in moe_runs:
        assert out[True]["error"] is None, out[True]["error"]
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(out[True]["state"][k], v, rtol=1e-5, atol=1e-6)


def test_siblings_under_the_root_or_a_container_alone_get_no_leaf_hint():
    """Making the model itself a leaf would gather it whole; a ModuleList is never called, so
    the hint names its nearest called ancestor or nothing."""
    from fz3.interpreters.leaf_hint import leaf_hint
    names = ["a.weight", "layers.0.weight", "layers.1.weight", "moe.experts.0.weight", "moe.experts.1.weight"]
    modules = [("", MoENet), ("a", nn.Linear), ("layers", nn.ModuleList), ("layers.0", nn.Linear),
               ("layers.1", nn.Linear), ("moe", MoE), ("moe.experts", nn.ModuleList),
               ("moe.experts.0", nn.Linear), ("moe.experts.1", nn.Linear)]
    hint = leaf_hint(names, modules)

    def at(*params):  # each rank's descriptor, gathering one param
        return {r: [1, 0, 1, 1, p, p, 0, 4] for r, p in enumerate(params)}
    assert hint(at(0, 1)) == "" and hint(at(1, 2)) == "" and hint(at(3, 3)) == ""
    assert "one parent, 'moe' (MoE): 'moe.experts.0' on rank 0; 'moe.experts.1' on ranks 1, 2" in hint(at(3, 4, 4))


def _peer_raises_on_threads(rank: int, world: int) -> None:
    """A step together, then rank 1 raises while rank 0 goes on to the next forward."""
    import fz3
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            fz3.Config(param_persistence_threshold=0))
    engine.backward(engine(torch.ones(2, 16)).sum())
    engine.step()
    if rank == 1:
        raise ValueError("rank one's own error")
    try:
        engine(torch.ones(2, 16))
    except fz3.DivergenceError as e:
        assert "rank 0: rank 1 will not come to this rank's step 2, collective 1: all-gather" in str(e), str(e)
        assert "rank 1 raised ValueError: rank one's own error" in str(e), str(e)
        raise


def test_on_threads_the_rank_that_raised_is_named_not_the_one_it_stopped():
    """Rank 0's check names rank 1's leaving (a DivergenceError raised from the WorldFailed);
    run_threads re-raises rank 1's own error."""
    with pytest.raises(RuntimeError, match="^fz3.launch.run_threads: rank 1 raised ValueError: rank one.s own error"):
        launch.run_threads(_peer_raises_on_threads, 2, timeout_s=60)


class _Comm:
    """A transport whose messages never arrive (only the check's bookkeeping is used)."""
    rank, world_size, backend = 0, 2, "gloo"

    def timeout(self):
        import datetime
        return datetime.timedelta(seconds=42)

    def isend(self, t, dst, tag):
        return None

    irecv = isend


def test_a_collective_whose_data_fails_after_its_descriptors_agreed_names_the_peer(monkeypatch):
    """A peer that leaves mid-collective fails the data's wait: a DivergenceError naming it and
    the collective, recorded (every later collective raises it), the engine told."""
    from fz3 import DivergenceError
    from fz3.interpreters import agreement
    from fz3.interpreters.transport import PeerFailed
    monkeypatch.delenv("FZ3_DIVERGENCE_TIMEOUT", raising=False)
    ag = agreement.Agreement(_Comm(), agreement.describe_with(["w"], ["lin"]))
    assert ag.timeout.total_seconds() == 42 and ag.timeout_from == "the process group's timeout"
    told = []
    ag.on_failure = told.append
    posted = ag.post(agreement.GATHER, (0,), 4)

    class Gone:
        def wait(self, timeout=None):
            raise PeerFailed(1, RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    with pytest.raises(DivergenceError, match=r"rank 0: rank 1 exited or closed its connection: .* while this rank "
                                              r"was at step 1, collective 1: all-gather of 1 param \('w', 4 "
                                              r"elements\) of module 'lin' \(RuntimeError: Connection closed"):
        agreement.Watched(ag, posted, Gone()).wait()
    assert told == [ag.failed] and ag.failed is not None
    with pytest.raises(DivergenceError):
        ag.post(agreement.GATHER, (0,), 4)
    monkeypatch.setenv("FZ3_DIVERGENCE_TIMEOUT", "3")
    assert agreement.timeout_for(_Comm())[0].total_seconds() == 3


# ---- a pass one rank runs alone (issue #45 point 4) ----------------------------------------------

def _rank_only_eval(rank: int, world: int, when: int, train_mode: bool) -> dict:
    """nanoGPT's loop: at iteration `when`, rank 0 alone evaluates (`if master_process:
    estimate_loss()`, under torch.no_grad(), in model.eval() unless `train_mode`) while rank 1
    goes on training. Both must stop at rank 0's first gather of the evaluation."""
    import fz3
    from gpt import GPT, GPTConfig, loss_fn, markov_batch
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, d_model=32, n_head=2, n_layer=2, seq=16))
    engine = fz3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                            fz3.Config(param_persistence_threshold=0))
    t0 = time.monotonic()
    try:
        for it in range(when + 2):
            x, y = markov_batch(it, batch=2, seq=16, vocab=64)
            t0 = time.monotonic()
            if it == when and rank == 0:
                engine.train(train_mode)
                with torch.no_grad():
                    for _ in range(3):  # eval_iters
                        loss_fn(engine(x), y)
                engine.train()
            engine.backward(loss_fn(engine(x), y))
            engine.step()
    except fz3.DivergenceError as e:
        return {"error": str(e), "it": it, "seconds": time.monotonic() - t0}
    return {"error": None}


@pytest.mark.parametrize("when, train_mode", [(0, False), (2, True)])
def test_an_evaluation_on_one_rank_alone_names_the_pass_and_what_to_do(when, train_mode):
    """[Note: rank-only evaluation] (fz3/interpreters/pass_hint.py). Its first forward's gathers
    are the training forward's own, so without the pass in the descriptor the ranks went on
    together and diverged later, in rank 1's backward, naming module 'lm_head'. At the first
    iteration (traces recording) and at the third (the train trace complete: prefetch)."""
    mode = "model.train()" if train_mode else "model.eval()"
    for rank, out in enumerate(launch.run(_rank_only_eval, world_size=2, args=(when, train_mode), timeout=200)):
        msg = out["error"]
        assert msg is not None and out["it"] == when and out["seconds"] < 60, (rank, out)
        assert f"rank 0: step {when + 1}, collective 1: all-gather" in msg, msg
        assert f"of module 'wte' (shared with 'lm_head'), under torch.no_grad() in {mode}\n" in msg, msg
        assert "of module 'wte' (shared with 'lm_head'), with grad on in model.train()\n" in msg, msg
        differ = "grad mode" if train_mode else "grad mode and train/eval mode"
        assert f"The ranks are in different kinds of pass (they differ in {differ}): rank 0 runs under " \
               f"torch.no_grad() in {mode}" in msg, msg
        assert "rank 1 runs with grad on in model.train() (training)" in msg, msg
        assert "Every rank must run every forward under ZeRO-3" in msg, msg
        assert "Run the evaluation on every rank" in msg and "engine.full_state_dict() on every rank" in msg, msg
        assert "lm_head'), in a backward" not in msg, msg  # caught at the evaluation, not rank 1's backward


def test_pass_words_and_hint_for_each_kind_of_pass():
    """The descriptor's phase in words, and the paragraph only when stamped ranks differ."""
    from fz3.interpreters import agreement
    from fz3.interpreters.pass_hint import BACKWARD, GRAD, PHASE, TRAINING, pass_hint, phase_reader, words
    assert words(PHASE | GRAD | TRAINING) == "with grad on in model.train()"
    assert words(PHASE) == "under torch.no_grad() in model.eval()"
    assert words(PHASE | BACKWARD | TRAINING) == "in a backward" and words(0) == ""

    def at(*phases):
        return {r: [1, 0, 1, 1, 0, 0, 1, 4, ph] for r, ph in enumerate(phases)}
    F = agreement.PHASE_FIELD
    assert pass_hint(at(PHASE | GRAD | TRAINING, PHASE | GRAD | TRAINING), F) == ""
    assert pass_hint(at(0, PHASE | GRAD | TRAINING), F) == ""  # a step's collective: unstamped
    three = pass_hint(at(PHASE, PHASE | BACKWARD | TRAINING, PHASE | BACKWARD | TRAINING), F)
    assert "(they differ in forward or backward and train/eval mode): rank 0 runs under torch.no_grad() in " \
           "model.eval() (an evaluation); ranks 1, 2 run in a backward (training)." in three, three
    describe = agreement.describe_with(["wte.weight"], [("wte", "lm_head")])
    assert describe([1, 0, 1, 1, 0, 0, 1, 4, PHASE]) == ("step 1, collective 1: all-gather of 1 param ('wte.weight', "
                                                        "4 elements) of module 'wte' (shared with 'lm_head'), under "
                                                        "torch.no_grad() in model.eval()")
    read = phase_reader(lambda: False)
    with torch.no_grad():
        assert read() == PHASE
    assert read() == PHASE | GRAD
    x = torch.ones(1, requires_grad=True)
    seen = []
    x.register_hook(lambda g: seen.append(read()))
    (x * 2).sum().backward()
    assert seen == [PHASE | BACKWARD]


# ---- a call every rank must make, made on rank 0 alone ------------------------------------------

ALONE = {  # the call, under `if master_process:`, and how its error names it
    "full_state_dict": (lambda e, d: e.full_state_dict(), "engine.full_state_dict()"),
    "save_checkpoint": (lambda e, d: e.save_checkpoint(d, tag="t"), "engine.save_checkpoint()"),
    "load_checkpoint": (lambda e, d: e.load_checkpoint(d, tag="t"), "engine.load_checkpoint()"),
    "save_16bit_model": (lambda e, d: e.save_16bit_model(d), "engine.save_16bit_model()"),
    "full_optimizer_state_dict": (lambda e, d: e.full_optimizer_state_dict(), "engine.full_optimizer_state_dict()"),
}


def _alone(rank: int, world: int, call: str, root: str) -> dict:
    import fz3
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    engine = fz3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            fz3.Config(param_persistence_threshold=0))
    engine.gather_16bit_weights_on_model_save = True  # what fz3.deepspeed.initialize sets from the JSON key
    engine.backward(engine(torch.ones(2, 4)).square().mean())
    engine.step()
    engine.save_checkpoint(root, tag="t")  # every rank: the checkpoint load_checkpoint reads
    t0 = time.monotonic()
    try:
        if rank == 0:
            ALONE[call][0](engine, root)
        else:  # trains on
            engine.backward(engine(torch.ones(2, 4)).square().mean())
        return {"error": None}
    except fz3.DivergenceError as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}


@pytest.mark.parametrize("call", sorted(ALONE))
def test_a_call_every_rank_must_make_on_rank_0_alone_is_named_on_both(tmp_path, call):
    """HF's and nanoGPT's `if master_process:` around a call that needs every rank's shards:
    rank 0's error and rank 1's (at its next forward's gather) name the call and say what to do,
    in seconds, instead of a hang until the process group's timeout."""
    outs = launch.run_threads(_alone, 2, args=(call, str(tmp_path)), timeout_s=120)
    named = ALONE[call][1]
    for rank, out in enumerate(outs):
        msg = out["error"]
        assert msg is not None and out["seconds"] < 60, (rank, out)
        assert f"rank 0: step 2, collective 2: {named}" in msg, msg  # 1: the save both made
        assert "rank 1: step 2, collective 2: all-gather" in msg, msg
        assert " needs every rank (each holds only its shards): every rank must call it at the same point of its " \
               "program, not under `if master_process:`." in msg, msg
