"""Collecting from outside the server: /proc and NVML samples of a process tree, and attaching
the probe to a running process."""
