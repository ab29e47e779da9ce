"""Test settings: CPU only, exact fp32 matmuls, shared fixtures."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def rng():
    """A numpy generator with a fresh seed each test run (seed printed on failure)."""
    import numpy as np
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"numpy seed {seed}")
    return np.random.default_rng(seed)
