"""Unit 5 · Hardware: what are the physical limits? Collectives' algbw and busbw, the alpha-beta model,
contention, the communication budget, remedies, offload, real fabrics scaled.
"""
