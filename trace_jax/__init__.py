"""trace_jax: rollout-guided FP4 quantization-aware RL (TRACE) for Mixture-of-Experts in JAX."""

__version__ = "0.1.0"
