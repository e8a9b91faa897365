"""Versioned probe maps: which engine method means what, one readable file per engine version."""
