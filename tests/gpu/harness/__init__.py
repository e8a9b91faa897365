"""The GPU checks the tests in tests/gpu run, each a script run in a process of its own (a check
activates the probe and SGLang's CUDA state for itself). They share bench/gpu/common.py with the
GPU server suite."""
