# SPDX-License-Identifier: Apache-2.0
"""Fixtures for tests through the real engine on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine import SPARSE_GLM5, model_dir


@pytest.fixture(scope="session")
def sparse_glm5_dir() -> Path:
    return model_dir(SPARSE_GLM5)
