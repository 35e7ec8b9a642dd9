"""Profiling before deployment: torch.profiler traces with llmopt phase ranges (NVTX on CUDA),
per-op tables with FLOPs and bytes, launch counts, memory timelines and a measured roofline.
"""
