"""JAX (XLA, its own CUDA plugin) on device 0: a jitted function with a matmul, an elementwise
tail and a reduction, a gradient, and a random draw, each checked against NumPy on the host.

    python tests/framework_scripts/jax_probe.py

Run natively and through gpupool by scripts/gpu-validation.sh (with
XLA_PYTHON_CLIENT_PREALLOCATE=false: JAX otherwise takes 75% of the GPU's memory at start).
Prints one line per failed check, then `PASS jax: N checks` or `FAIL jax: K of N checks failed`.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from checks import Checks  # noqa: E402

c = Checks("jax")


def device() -> None:
    devs = jax.devices()
    print(f"  jax {jax.__version__}: {devs}")
    c.check(bool(devs) and devs[0].platform == "gpu", f"device 0 is not a GPU: {devs}")


def jitted() -> None:
    @jax.jit
    def f(a, b):
        return jnp.sum(jnp.tanh(a @ b) * 0.5, axis=1)

    rng = np.random.default_rng(5)
    a = rng.standard_normal((256, 128)).astype(np.float32)
    b = rng.standard_normal((128, 64)).astype(np.float32)
    got = np.asarray(jax.device_get(f(jax.device_put(a), jax.device_put(b))))
    want = np.sum(np.tanh(a @ b) * 0.5, axis=1)
    c.check(np.allclose(got, want, rtol=2e-2, atol=2e-2), "jit(sum(tanh(a @ b))) differs from NumPy")
    got2 = np.asarray(f(a, b))  # the cached executable, host arrays in
    c.check(np.array_equal(got, got2), "a second call of the jitted function gave another answer")


def grad() -> None:
    def loss(w, x):
        return jnp.mean((x @ w) ** 2)

    x = np.random.default_rng(6).standard_normal((64, 16)).astype(np.float32)
    w = np.ones(16, dtype=np.float32)
    got = np.asarray(jax.jit(jax.grad(loss))(w, x))
    want = 2.0 * x.T @ (x @ w) / x.shape[0]
    c.check(np.allclose(got, want, rtol=1e-3, atol=1e-3), "grad of a mean square differs from NumPy")


def rand() -> None:
    key = jax.random.PRNGKey(0)
    u = np.asarray(jax.random.uniform(key, (1 << 20,)))
    c.check(bool(((u >= 0) & (u < 1)).all()) and abs(float(u.mean()) - 0.5) < 0.01,
            f"uniform draw: mean {u.mean()}")
    c.check(np.array_equal(u, np.asarray(jax.random.uniform(key, (1 << 20,)))),
            "the same key gave different numbers")


for part in (device, jitted, grad, rand):
    c.section(part)
c.finish()
