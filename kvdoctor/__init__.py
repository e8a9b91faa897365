"""kvdoctor: a memory-leak and memory-safety doctor for LLM serving processes."""

__version__ = "0.1.0"
