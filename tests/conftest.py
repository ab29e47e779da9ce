"""Test settings: CPU only, exact fp32 matmuls, shared fixtures and helpers."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The CPU backend's LLVM passes off (read when the backend starts, and inherited by the
# tests' subprocesses): XLA compiles the many small test programs in far less time, and
# nothing here times the code it runs.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=0").strip()

from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# Lowering the first interpreted Pallas kernel imports this module, which adds a setting
# to jax's tracing context: the program being traced is then traced and compiled again at
# its next call (once per process). Imported up front, every trace sees the same context.
import jax.experimental.pallas.fuser  # noqa: E402,F401

COMPILE_CACHE_ENV = "DEJAVU_TEST_COMPILE_CACHE"


def _share_compiled_programs() -> None:
    """Point JAX's persistent compilation cache at one fresh folder per test run, which the
    xdist workers and the fake-device subprocesses inherit through $DEJAVU_TEST_COMPILE_CACHE:
    the tests build many identical programs (each test its own engine), and each is then
    compiled once. The process that made the folder removes it at exit. "off" runs without
    the cache."""
    import atexit
    import shutil
    import tempfile
    folder = os.environ.get(COMPILE_CACHE_ENV)
    if folder == "off":
        return
    if not folder:
        folder = tempfile.mkdtemp(prefix="dejavu-test-compile-cache-")
        os.environ[COMPILE_CACHE_ENV] = folder
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", folder)
    # an entry costs about as much to write as a tiny program (an eager op) takes to compile
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    # No size bound: with one, every write lists and reads the whole folder to find what to
    # evict, under a lock the other processes wait on (quadratic in the entries: over a
    # minute of a run). The folder lives for one run. Entries are written whole under a
    # temporary name and renamed, so no process reads another's half-written entry.
    jax.config.update("jax_compilation_cache_max_size", -1)
    from jax._src import lru_cache

    def put(self, key: str, value: bytes) -> None:
        path = self.path / f"{key}{lru_cache._CACHE_SUFFIX}"
        if path.exists():
            return
        part = self.path / f".{key}.{os.getpid()}.part"
        part.write_bytes(value)
        os.replace(part, path)

    assert not lru_cache.LRUCache(folder, max_size=-1).eviction_enabled
    lru_cache.LRUCache.put = put


_share_compiled_programs()


def _collect_less_often() -> None:
    """Tracing and lowering make many short-lived Python objects: the import-time heap
    (jax, transformers, ...) is moved out of the collector's sight, and the youngest
    generation collected every 50,000 allocations instead of 700."""
    import gc
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)


_collect_less_often()

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module. Each one loaded keeps its code
    mapped into the process, and a worker that ran a few hundred modules' programs neared
    the kernel's limit of 65,530 memory mappings per process, where XLA's CPU compiler and
    its cache reader crash. A later module's program is read back from the compile cache."""
    yield
    import gc
    jax.clear_caches()
    gc.collect()

# Tests that each run a whole suite in other processes (tens of seconds): started first, so
# that no worker is left running one alone at the end of a parallel run.
LONG_FIRST = ("test_sharding.py::test_sharding_suite_on_8_fake_cpu_devices",
              "test_eval_mesh.py::test_eval_mesh_suite_on_8_fake_cpu_devices",
              "test_notebook.py::test_notebook_runs_on_tiny_model")


def pytest_collection_modifyitems(session, config, items):
    """The LONG_FIRST tests moved to the front, in that order (the rest keep theirs)."""
    rank = {name: i for i, name in enumerate(LONG_FIRST)}

    def key(item):
        return rank.get(item.nodeid.split("/")[-1], len(LONG_FIRST))
    items.sort(key=key)


SEED_ENV = "DEJAVU_TEST_SEED"


def pytest_report_header(config):
    """Name the seed override in the run's header, so a fuzzing run says how to repeat it."""
    if os.environ.get(SEED_ENV):
        return f"{SEED_ENV}={os.environ[SEED_ENV]}: every test's `rng` fixture uses this seed"
    return None


@pytest.fixture
def rng(request):
    """A numpy generator with a fixed seed per test, derived from the test's node id (so
    tests draw different numbers, the same ones every run). DEJAVU_TEST_SEED=N seeds every
    test with N instead, to fuzz or to repeat a failure; the seed is printed either way."""
    import zlib

    import numpy as np
    override = os.environ.get(SEED_ENV)
    seed = int(override) if override else zlib.crc32(request.node.nodeid.encode())
    print(f"numpy seed {seed} ({SEED_ENV} to override)" if not override
          else f"numpy seed {seed} (from {SEED_ENV})")
    return np.random.default_rng(seed)


def step_logits(engine, engine_params, prompts, steps, cache_len=16):
    """Logits [len(steps), B, V] of an engine that prefills `prompts` [B, T] (no padding)
    and then decodes each row of `steps` [n, B] (teacher-forced), prefill and step jitted."""
    import jax.numpy as jnp
    import numpy as np
    ids = jnp.asarray(prompts)
    state = engine.init_state(ids.shape[0], cache_len, jnp.float32)
    _, state = jax.jit(engine.prefill)(engine_params, ids, jnp.ones_like(ids), state)
    step = jax.jit(engine.step)
    out = []
    for tokens in steps:
        logits, state = step(engine_params, state, jnp.asarray(tokens))
        out.append(np.asarray(logits))
    return np.stack(out)


def assert_finite_close(actual, desired, *, rtol=1e-7, atol=0.0, err_msg=""):
    """np.testing.assert_allclose for values that must be real numbers: both arrays have
    one shape, are non-empty and finite everywhere (assert_allclose alone passes NaN
    against NaN and broadcasts shapes), then agree within rtol / atol."""
    import numpy as np
    actual, desired = np.asarray(actual), np.asarray(desired)
    assert actual.shape == desired.shape, f"shapes {actual.shape} != {desired.shape} {err_msg}"
    assert actual.size, f"nothing to compare: empty arrays {err_msg}"
    for name, a in (("actual", actual), ("desired", desired)):
        bad = int((~np.isfinite(a)).sum())
        assert not bad, f"{name}: {bad} of {a.size} values are not finite {err_msg}"
    np.testing.assert_allclose(actual, desired, rtol=rtol, atol=atol, equal_nan=False,
                               err_msg=err_msg)


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
