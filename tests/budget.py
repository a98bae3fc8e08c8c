"""How many examples the slowest hypothesis state machines run.

A plain `pytest -q tests` runs the quick counts, so that the README's two commands fit in four
minutes on a 2-core machine; PYALLOC_TEST_PROFILE=thorough runs the thorough ones (.ci/run does,
after timing the README's commands), and PYALLOC_SANITIZER_EXAMPLES, when set, is every
machine's count (tools/soak_sanitizer.py sets it, for a soak of thousands).
"""
import os

PROFILES = ("quick", "thorough")


def examples(quick, thorough):
    """The number of examples for a machine: `quick` (the default), `thorough` under
    PYALLOC_TEST_PROFILE=thorough, or PYALLOC_SANITIZER_EXAMPLES where set."""
    if "PYALLOC_SANITIZER_EXAMPLES" in os.environ:
        return int(os.environ["PYALLOC_SANITIZER_EXAMPLES"])
    profile = os.environ.get("PYALLOC_TEST_PROFILE", "quick")
    if profile not in PROFILES:
        raise ValueError(f"PYALLOC_TEST_PROFILE must be one of {', '.join(PROFILES)}, got {profile!r}")
    return thorough if profile == "thorough" else quick
