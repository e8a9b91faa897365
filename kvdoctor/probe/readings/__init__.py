"""Readings of the process beside the ledgers: allocation attribution, memory classes and the
containers that grow. None knows an engine."""
