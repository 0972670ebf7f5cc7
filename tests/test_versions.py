"""The JAX versions jaxppo runs on: the import-time warning for a JAX newer than any tested,
and the suite's rule that a deprecation raised from jaxppo's own calls fails the test."""

import subprocess
import sys
import warnings

import jax
import pytest

import jaxppo
from jaxppo.version import TESTED_JAX, UntestedJaxWarning, release, untested_jax


def test_release_reads_the_numbers_of_a_version_string():
    assert release("0.10.2") == (0, 10, 2)
    assert release("0.12.0.1") == (0, 12, 0, 1)
    assert release("0.13.0rc1") == (0, 13, 0)
    assert release("0.11.0.dev20261001") == (0, 11, 0)
    assert release("1.0") > release("0.12.0.1") > release("0.12.0") > release("0.10.2")


def test_only_a_jax_newer_than_every_tested_minor_release_is_warned_about():
    for tested in TESTED_JAX:
        assert untested_jax(tested) is None
    assert untested_jax("0.12.3") is None  # a patch release of a tested minor
    assert untested_jax("0.11.2") is None  # between two tested releases
    message = untested_jax("0.13.0")
    assert message is not None and "0.13.0" in message and "jax==0.12.0.1" in message
    assert untested_jax("1.0.0") is not None


def test_the_installed_jax_is_a_tested_release():
    """CI's environments (README, "Tested versions") hold a tested JAX, so importing jaxppo
    there warns of nothing."""
    assert jax.__version__ in TESTED_JAX, (jax.__version__, TESTED_JAX)
    assert untested_jax(jax.__version__) is None


def test_importing_jaxppo_under_an_untested_jax_warns_once():
    """A child process whose jax reports 0.99.0 (patched before jaxppo is imported)."""
    code = ("import warnings, jax\njax.__version__ = '0.99.0'\nwarnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as seen:\n    import jaxppo\n"
            "print([str(w.message) for w in seen if w.category is jaxppo.version.UntestedJaxWarning])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = eval(done.stdout.strip().splitlines()[-1])
    assert len(out) == 1 and "jax 0.99.0" in out[0], out


@pytest.mark.parametrize("module", ["jaxppo.models.transformer", "jaxppo.run.trainer", "test_versions"])
def test_a_deprecation_attributed_to_jaxppo_or_its_tests_fails_the_suite(module):
    """pyproject's `filterwarnings` turns a DeprecationWarning (and FutureWarning) whose
    caller is a jaxppo or test module into an error; one raised in a library's own module
    (its caller not ours) stays a warning."""
    for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
        with pytest.raises(category):
            warnings.warn_explicit("old API", category, "f.py", 1, module=module)
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn_explicit("old API", DeprecationWarning, "f.py", 1, module="some_library.core",
                               registry={})
    assert len(seen) == 1


def test_untested_jax_warning_is_public():
    assert jaxppo.version.UntestedJaxWarning is UntestedJaxWarning
    assert issubclass(UntestedJaxWarning, UserWarning)
