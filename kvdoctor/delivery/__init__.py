"""Getting the probe into a process, every way kvdoctor does it, in one place.

- `run`/`gate` start the command with `pythonpath/` first on PYTHONPATH: its sitecustomize.py (the
  folder's only file, so nothing else of kvdoctor shadows a server's imports) starts the probe in
  every Python process and chains to the host's own; `launch` runs the command, its signals and
  process group, and the sampler beside it; `rendezvous` is the run's private folder the probes
  meet in at shutdown.
- `attach` puts the probe into a running server (gdb on 3.10-3.13, `sys.remote_exec` on 3.14):
  `attach_code` is what runs inside, `attach_inject` drives gdb with `attach_guard` between
  them (its exchange folder's rules), `attach_target` checks the process, `attach_trace` claims
  the attached probe's trace.
"""
