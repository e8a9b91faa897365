import inspect, triton, triton.runtime.jit as j
src = inspect.getsource(j.JITFunction.run)
i = src.find("launch_metadata = kernel.launch_metadata")
print(src[i-600:i+600])
from triton import knobs; print("knobs ok", knobs.runtime.launch_enter_hook)
import triton.compiler.compiler as c
print([a for a in dir(c.CompiledKernel) if not a.startswith("__")])
