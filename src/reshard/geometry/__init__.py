"""Geometry of global tensors: boxes, the tiling checks, and the grid rule of packed tensors.

Pure, and below everything else: the metadata model, planning and the I/O layer build on it, and it imports
nothing of reshard's but itself.
"""
