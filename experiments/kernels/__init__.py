"""The kernel benchmark (`bench_kernels.py` and its sections `kernels_*.py`), the profiling entry points for Nsight
Compute (`profile_*.py`, `ncu_stalls.py`) and the kernel studies that time the ops against their peers
(`attention_flashmla.py`, `attention_alone_wall.py`, `attention_multicast.py`). Results: experiments/results/kernels/;
history: experiments/notes/kernels.md."""
