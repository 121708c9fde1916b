"""The DeepSeek-V3 / Kimi K2.x target model in Flax NNX."""
