"""The executor's side: one step through every layer (pipeline.py, Algorithm 1), the MoE
phase in expert waves, what is resident and in flight, KV caches, copy channels, host
compute, the timeline."""
