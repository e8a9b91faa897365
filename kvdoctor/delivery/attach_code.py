"""The code `kvdoctor attach` runs inside the target, and the gdb script that gets it there.

`INJECTED` runs in the target's interpreter. It first takes the attach's token (a rename that
kvdoctor's guard races for when the attach is cancelled: kvdoctor.delivery.attach_guard); without
it, it does nothing at all, however late it runs. With it, it only starts a thread, which puts
kvdoctor's package root at the END of `sys.path` (it never shadows the host's modules), sets
`KVDOCTOR_TRACE`, activates the probe and reports back through a small status file.
`GDB_SCRIPT` stops at the first safe point (see kvdoctor.delivery.attach) and runs it there, but
only after taking gdb's own token: once the guard holds it, gdb never calls into the target and
stopping gdb is safe.
"""

INJECTED = r"""
def _kvdoctor_attach(params):
    import json, os, sys, threading

    token = params.get("token")
    if token:
        try:
            os.rename(token, token + ".taken")
        except OSError:
            return  # the attach was cancelled: nothing in this process is touched

    def report(payload):
        path = params["status_path"]
        try:
            with open(path + ".tmp", "w") as fh:
                json.dump(payload, fh)
            os.replace(path + ".tmp", path)
        except Exception:
            pass

    def start():
        try:
            root = params["package_root"]
            if root not in sys.path:
                sys.path.append(root)
            os.environ["KVDOCTOR_TRACE"] = params["trace_path"]
            if params["fixes"]:
                os.environ["KVDOCTOR_FIXES"] = ",".join(params["fixes"])
            if params["attribution"]:
                os.environ["KVDOCTOR_ATTRIBUTION"] = params["attribution"] if isinstance(params["attribution"], str) else "1"
            from kvdoctor.probe.core import runtime
            already = runtime.current() is not None
            probe = runtime.activate(params["trace_path"], fixes=params["fixes"])
            if probe is None:
                reason = "KVDOCTOR_DISABLE is set in it" if os.environ.get("KVDOCTOR_DISABLE", "").strip().lower() in ("1", "true", "yes", "on") else "the probe failed to start"
                report({"ok": False, "error": reason})
                return
            probe.emitter.emit("probe_status", {
                "component": "attach", "state": "on",
                "reason": ("attached by kvdoctor attach; the probe was already on" if already else "attached by kvdoctor attach")
                          + "; SGLang classes already imported were hooked, later ones are hooked as they are imported",
                "already_active": already, "python": sys.version.split()[0],
            })
            try:
                from kvdoctor.probe.readings import attribution_start
                attribution_start.start_if_enabled(probe, force=bool(params["attribution"]))
            except Exception as exc:
                probe.emitter.emit("probe_status", {"component": "attribution", "state": "off", "reason": f"{type(exc).__name__}: {exc}"})
            probe.emitter.flush()
            report({"ok": True, "already_active": already, "trace_path": probe.trace_path or "", "python": sys.version.split()[0]})
        except BaseException as exc:
            report({"ok": False, "error": f"{type(exc).__name__}: {exc}"})

    threading.Thread(target=start, name="kvdoctor-attach", daemon=True).start()


_kvdoctor_attach(__import__("json").loads(_KVDOCTOR_ATTACH_PARAMS))
"""

GDB_SCRIPT = """\
set unwindonsignal on
set confirm off
sharedlibrary libc
sharedlibrary libpthread
sharedlibrary libpython
p "KVDOCTOR: attached"
b PyObject_Malloc
b PyMem_Malloc
b PyErr_CheckSignals
commands 1-3
  disable breakpoints
  delete breakpoints
  if (int)Py_IsInitialized() == 0
    p "KVDOCTOR: the interpreter is shutting down"
  else
    shell mv -- {gdb_token} {gdb_token}.taken 2>/dev/null
    if $_shell_exitcode == 0
      p "KVDOCTOR: at a safe point"
      set $kvdoctor_gil = (int)PyGILState_Ensure()
      set $kvdoctor_rc = (int)PyRun_SimpleString("{code}")
      call (void)PyGILState_Release($kvdoctor_gil)
      p $kvdoctor_rc == 0 ? "KVDOCTOR: RAN" : "KVDOCTOR: FAILED"
    else
      p "KVDOCTOR: cancelled before the call"
    end
  end
end
p "KVDOCTOR: waiting for a safe point"
continue
"""


def run_script_code(script_path: str) -> str:
    """The Python line that runs the script at `script_path` in the target. The path is written as
    an ASCII-only Python literal (`ascii`): no character a temp dir may hold (a quote, a backslash,
    a newline, a brace, non-ASCII) can end the literal or change the code."""
    path = ascii(script_path)
    return f"exec(compile(open({path}, 'rb').read(), {path}, 'exec'), {{'__name__': '__kvdoctor_attach__'}})"


def gdb_script_for(script_path: str, gdb_token: str) -> str:
    """`GDB_SCRIPT` running `run_script_code(script_path)`, escaped for gdb's C string literal;
    `gdb_token`: the guard's token file, a plain name in gdb's working directory."""
    code = run_script_code(script_path)
    return GDB_SCRIPT.format(code=code.replace("\\", "\\\\").replace('"', '\\"'), gdb_token=gdb_token)
