"""`python -m fz3 verify --patch MODULE:FUNCTION=MODULE:FUNCTION` and `fz3.testing.patch.patched`: a
planted replacement makes verify fail naming the broken rule, FAILED and the shrunk case printed
before the table; the same run without it passes; the replacement is bound wherever fz3 binds
the original and put back after the run, even a failing one; a bad --patch is one line naming
what was passed and what is allowed, exit status 2 (fz3/testing/patch.py)."""
from __future__ import annotations

import re
import sys
import types

import pytest

import fz3.core.param.backward as backward
import fz3.core.param.fetch as fetch
import fz3.core.param.release as release
from fz3.__main__ import main
from fz3.testing import planted
from fz3.testing.patch import PatchError, patched
from fz3.testing.verify import verify

RELEASE = planted.PLANTED["release"]
HUNT = ["verify", "--profile", "hunt", "--machines", "params", "--seed", "0"]


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_a_planted_release_fails_verify_naming_the_rule_failed_first(capsys):
    code, out, err = run(HUNT + ["--patch", RELEASE.patch], capsys)
    assert code == 1, out + err
    lines = out.splitlines()
    assert lines[0] == "patched fz3.core.param.release.release_into (also bound in fz3.core.param.backward)", out
    failed = out.index("FAILED in params: AssertionError: ")
    assert re.search(RELEASE.caught, out[failed:].splitlines()[0]), out  # the rule the bug breaks
    assert failed < out.index("def test_params_regression():") < out.index("invariant ") < out.index("what holds")
    assert out.rstrip().endswith("FAILED in params (the shrunk case is at the top)"), out
    assert "Traceback" in err  # Hypothesis' own account, on stderr


def test_the_same_run_without_the_patch_passes(capsys):
    code, out, err = run(HUNT + ["--examples", "30"], capsys)
    assert code == 0, out + err
    assert "FAILED" not in out and "patched" not in out
    assert out.startswith("fz3 verify (profile hunt): 30 examples per machine, up to 8 rules each"), out


def test_the_patch_is_undone_after_a_failing_run():
    from fz3.core.grad import epilogue, grads
    boundary, original = planted.PLANTED["boundary"], grads.flush_waiting
    report = verify(machines=("grads",), profile="hunt", seed=0, patches=[boundary.patch])
    assert report.failure is not None
    assert report.patches == ["patched fz3.core.grad.grads.flush_waiting (also bound in fz3.core.grad.epilogue)"]
    assert grads.flush_waiting is original and epilogue.flush_waiting is original


def test_the_replacements_own_module_keeps_the_original():
    """fz3/testing/planted.py calls the original through its own import of it: left alone."""
    original = release.release_into
    with patched(RELEASE.target, RELEASE.replacement):
        assert backward.release_into is planted.release_ignoring_other_users
        assert planted.release_into is original


def test_every_binding_is_replaced_and_put_back_even_on_an_error():
    original = fetch.fetch_into

    def mine(tx, module, *, forward, config, grad_inputs=0):
        pass

    with pytest.raises(RuntimeError, match="inside"):
        with patched("fz3.core.param.fetch:fetch_into", mine) as p:
            assert fetch.fetch_into is mine and backward.fetch_into is mine
            assert str(p) == "patched fz3.core.param.fetch.fetch_into (also bound in fz3.core.param.backward)"
            raise RuntimeError("inside")
    assert fetch.fetch_into is original and backward.fetch_into is original


def test_a_module_first_imported_while_patched_gets_the_original_back(monkeypatch):
    """A module imported during the patch bound the replacement by name: put back too."""
    original = release.release_into
    late = types.ModuleType("fz3.imported_while_patched")
    with patched(RELEASE.target, RELEASE.replacement) as p:
        late.release_into = release.release_into  # what `from fz3.core.param.release import release_into` does
        monkeypatch.setitem(sys.modules, late.__name__, late)
        assert late.release_into is planted.release_ignoring_other_users
    assert late.release_into is original, p


def test_one_patch_of_a_function_at_a_time():
    with patched(RELEASE.target, RELEASE.replacement):
        with pytest.raises(PatchError, match="already patched"):
            with patched("fz3.core.param.backward:release_into", lambda tx, module, *, config: None):
                pass


BAD = "fz3.core.param.release:release_into="
PLANTED_READ = "fz3.testing.planted:read_not_borrowing"


@pytest.mark.parametrize("patch, message", [
    ("nope", "--patch 'nope' is not MODULE:FUNCTION=MODULE:FUNCTION (the function of fz3, then your replacement"),
    ("fz3.core.param.release:release_into", "is not MODULE:FUNCTION=MODULE:FUNCTION"),
    ("fz3.core.param.relase:release_into=" + PLANTED_READ,
     "'fz3.core.param.relase:release_into': cannot import 'fz3.core.param.relase': ModuleNotFoundError"),
    ("fz3.core.param.release:relase_into=" + PLANTED_READ,
     "fz3.core.param.release has no function 'relase_into'; its functions: "),
    ("os.path:join=" + PLANTED_READ, "'os.path' is not a module of fz3; a patch replaces a function of fz3"),
    ("fz3.core.param.fetch:Txn=" + PLANTED_READ, "fz3.core.param.fetch.Txn is a type, not a function"),
    ("fz3.testing.verify:given=" + PLANTED_READ,
     "fz3.testing.verify.given is hypothesis.core.given, a function of another package imported into fz3"),
    (BAD + "no_such_module_fz3:f", "the replacement for fz3.core.param.release:release_into: "
                                    "'no_such_module_fz3:f': cannot import 'no_such_module_fz3'"),
    (BAD + "fz3.testing.planted:nothing", "'fz3.testing.planted' has no attribute 'nothing'"),
    (BAD + "fz3.testing.planted:PLANTED", "'fz3.testing.planted:PLANTED', is a dict, not callable"),
    (BAD + "no_such_file_fz3.py:f", "'no_such_file_fz3.py': no such file"),
    (BAD + "fz3.testing.planted:boundary_forgetting_waiting_grads",
     "takes (state, *, config), but fz3 calls fz3.core.param.release.release_into(tx, module, *, config): it "
     "must accept every argument the original does"),
])
def test_a_bad_patch_is_one_line_naming_the_value(patch, message, capsys):
    code, out, err = run(["verify", "--machines", "params", "--examples", "1", "--patch", patch], capsys)
    assert code == 2, (code, out, err)
    assert err.startswith("python -m fz3 verify: ") and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert out == ""  # refused before anything ran
    assert release.release_into.__module__ == "fz3.core.param.release"


def test_the_same_function_patched_twice_is_refused(capsys):
    code, _, err = run(["verify", "--examples", "1", "--patch", RELEASE.patch, "--patch",
                        f"fz3.core.param.backward:release_into={RELEASE.replacement}"], capsys)
    assert code == 2 and "fz3.core.param.release.release_into is already patched by --patch" in err, err


def test_an_unknown_profile_is_named(capsys):
    code, _, err = run(["verify", "--profile", "quick"], capsys)
    assert code == 2 and "profile 'quick': choose from ['dev', 'ci', 'mutation', 'nightly', 'hunt']" in err, err


def test_the_hunt_stops_shrinking_at_its_budget_and_says_so(capsys):
    """A budget far below what the shrink takes: the case as far as it got, still a test that
    fails with the bug, a line saying shrinking stopped, and Hypothesis' own warning (five minutes,
    please report) not printed."""
    from hypothesis.internal.conjecture import engine
    read = planted.PLANTED["read"]
    report = verify(machines=("calls",), profile="hunt", seed=0, patches=[read.patch], shrink_seconds=0.2)
    assert report.shrink_stopped and "shrinking stopped after 0.2 s" in report.text(), report.text()
    assert report.regression and re.search(read.caught, str(report.failure[1]))
    assert "five minutes" not in capsys.readouterr().out
    assert engine.MAX_SHRINKING_SECONDS == 300  # put back


def test_several_patches_are_in_force_together_and_all_put_back():
    boundary = planted.PLANTED["boundary"]
    from fz3.core.grad import epilogue, grads
    original = grads.flush_waiting
    report = verify(machines=("scaler",), examples=2, patches=[RELEASE.patch, boundary.patch])
    assert report.failure is None  # the loss scale uses neither
    assert report.patches == ["patched fz3.core.param.release.release_into (also bound in fz3.core.param.backward)",
                              "patched fz3.core.grad.grads.flush_waiting (also bound in fz3.core.grad.epilogue)"]
    assert grads.flush_waiting is original and epilogue.flush_waiting is original
