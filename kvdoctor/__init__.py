"""kvdoctor: a memory-leak and memory-safety doctor for LLM serving processes."""

import os

__version__ = "0.1.0"

# The directory that holds the kvdoctor package: what a probed process (started under
# `kvdoctor run`, or attached to) appends to its sys.path to import the probe.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
