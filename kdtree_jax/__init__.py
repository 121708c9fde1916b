"""kdtree-jax: DDTree speculative decoding for Kimi-K2.6-class (DeepSeek-V3 architecture) models."""
