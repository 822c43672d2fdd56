"""Shared test configuration.

float64 is enabled for the whole test session so that float64 references can be computed in JAX;
float32 code paths are exercised by passing float32 arrays explicitly.
"""

import jax

jax.config.update("jax_enable_x64", True)
