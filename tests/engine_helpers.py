"""Shared by the engine's test modules: import ``pinned_engine_env`` into a module to use it.

``COURSE_UTILS_PREWARM_S``: an idle rank pre-imports torch._dynamo after this many seconds, which
makes timings depend on what ran before; the engine tests switch it off (a test that needs
torch._dynamo imports it itself). Set only while the module's tests run, then restored.
"""
import os

import pytest

PINNED = {"COURSE_UTILS_PREWARM_S": "1e9"}


@pytest.fixture(scope="module", autouse=True)
def pinned_engine_env():
    saved = {k: os.environ.get(k) for k in PINNED}
    os.environ.update(PINNED)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
