"""The trace: kvdoctor's one event format, written by probes and samplers, read by the analysis.

`schema` names every event, violation and finding kind; `writer` appends (and is all the probe
imports besides `schema`); `reader` streams a finished or still-growing trace back.
"""
