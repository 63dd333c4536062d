"""Hand-written CPU kernels, called from jitted code through `jax.ffi`."""
