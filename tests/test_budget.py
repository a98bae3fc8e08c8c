"""The hypothesis machines' example counts (tests/budget.py): quick by default, thorough on
request, any count for a soak, and a clear error for a profile that does not exist."""
import pytest

from budget import examples


def test_a_plain_run_takes_the_quick_count(monkeypatch):
    monkeypatch.delenv("PYALLOC_TEST_PROFILE", raising=False)
    monkeypatch.delenv("PYALLOC_SANITIZER_EXAMPLES", raising=False)
    assert examples(quick=3, thorough=7) == 3


def test_the_thorough_profile_takes_the_thorough_count(monkeypatch):
    monkeypatch.setenv("PYALLOC_TEST_PROFILE", "thorough")
    monkeypatch.delenv("PYALLOC_SANITIZER_EXAMPLES", raising=False)
    assert examples(quick=3, thorough=7) == 7


def test_a_soak_count_overrides_the_profile(monkeypatch):
    monkeypatch.setenv("PYALLOC_TEST_PROFILE", "thorough")
    monkeypatch.setenv("PYALLOC_SANITIZER_EXAMPLES", "5000")
    assert examples(quick=3, thorough=7) == 5000


def test_an_unknown_profile_is_an_error_naming_it_and_the_choices(monkeypatch):
    monkeypatch.setenv("PYALLOC_TEST_PROFILE", "slow")
    monkeypatch.delenv("PYALLOC_SANITIZER_EXAMPLES", raising=False)
    with pytest.raises(ValueError, match="quick, thorough, got 'slow'"):
        examples(quick=3, thorough=7)
