"""Unit-test settings shared by the property-based (Hypothesis) tests.

The suite runs a fixed set of generated examples (derandomized), so that `make test` and CI pass or fail the
same way on the same code; to search for new failures, run the fuzz tests with fresh examples, repeatedly:

    TRAINSCOUT_HYPOTHESIS=explore .venv/bin/python -m pytest -q tests/unit/test_fuzz_*.py

A failure found that way is a defect: fix it, and add the example that found it to the test with @example.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("TRAINSCOUT_HYPOTHESIS", "repeatable"))
