"""Unit 1 · Model definition: is it math, memory or framework overhead? The roofline measured on this
machine, launch overhead, naive attention against FlashAttention (SDPA and the course's Triton
kernel), and the profiler's verdict per operator.
"""
