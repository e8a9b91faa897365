"""Upstream bugs reproduced on the GPU machine, each file named by its bug number (README.md)."""
