"""A pytest plugin for resuming a GPU test run that a time limit cut short (the device calls run 10 minutes at
most): KTESTS_FROM=N drops the first N of the selected cases, in collection order, so a second run picks up where
the first stopped. run_gpu_checks.sh's ktests part loads it (-p pytest_skip_first)."""
import os

import pytest


@pytest.hookimpl(trylast=True)  # after -k has deselected: N counts selected cases, as the first run's dots do
def pytest_collection_modifyitems(config, items):
    n = int(os.environ.get("KTESTS_FROM", "0") or 0)
    if n:
        kept = items[n].nodeid if n < len(items) else "none"
        print(f"\nKTESTS_FROM={n}: the first {min(n, len(items))} of {len(items)} selected cases dropped; next: {kept}")
        del items[:n]
