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


def run_on_fake_devices(test_file: str, n_devices: int, inner_flag: str, timeout: int) -> None:
    """Run `test_file` under pytest in a fresh process with `n_devices` fake CPU devices
    (the count must be set before jax starts) and `inner_flag`=1 set; fail with its output
    when it fails."""
    import subprocess
    import sys
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{inner_flag: "1"},
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                          f" --xla_force_host_platform_device_count={n_devices}").strip())
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           test_file], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
