"""Fixtures of the rollout tests."""

from __future__ import annotations

import pytest

from tests.rollout.test_engine_contract import _save


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two tiny policies saved as checkpoints (seeds 0 and 1), one tokenizer."""
    root = tmp_path_factory.mktemp("ckpt")
    return _save(root / "tiny", 0), _save(root / "tiny-b", 1)
