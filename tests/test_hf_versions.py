"""fz3.hf states the transformers and accelerate it was written against and checks them before
importing either (fz3/hf/versions.py)."""
from __future__ import annotations

import warnings
from importlib import metadata

import pytest

from fz3.hf import versions


def installed(**have):
    def version(name):
        if name not in have:
            raise metadata.PackageNotFoundError(name)
        return have[name]
    return version


def test_the_tested_versions_pass_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        versions.check(installed(**versions.TESTED))
        versions.check()  # this environment's: the hf extra's


def test_an_older_major_is_an_import_error_naming_it():
    with pytest.raises(ImportError, match=r"written against transformers 5\.x \(tested with 5\.25\.0\); this "
                                          r"environment has transformers 4\.57\.1\. Install transformers>=5,<6"):
        versions.check(installed(transformers="4.57.1", accelerate="1.16.0"))


def test_a_newer_major_warns_that_fz3_never_ran_it():
    with pytest.warns(UserWarning, match=r"accelerate 2\.0\.0, which fz3 has never run"):
        versions.check(installed(transformers="5.30.0.dev0", accelerate="2.0.0"))


def test_a_missing_package_names_the_extra():
    with pytest.raises(ImportError, match=r"fz3\.hf needs accelerate \(the `hf` extra"):
        versions.check(installed(transformers="5.25.0"))
