"""Unit 4 · Compilation & serving: am I getting the most throughput per GPU dollar? Launch-bound
decode, torch.compile, a fused Triton kernel, int8 weights, dynamic batching.
"""
