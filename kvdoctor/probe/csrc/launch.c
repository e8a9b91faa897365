/* The GPU ledger's compiled Triton kernels launched straight through the CUDA driver.
 *
 * Why: Triton's launcher for a compiled kernel is Python before its C call (about 10 us a launch
 * on an H100), and the scheduler thread pays it for every hooked call on the GPU path before it
 * can launch the next step. kvdoctor/probe/ledger/launch.py keeps the compiled kernel and, where
 * the kernel needs nothing Triton's launcher adds (no scratch memory, one CTA per program, no
 * cluster, cooperative or programmatic launch, no launch hooks), calls this with the kernel's
 * handle and its parameters already in the kernel's order.
 *
 * `launch_kernel(function, grid, block, shared, stream, kinds, *values)`: `kinds` has one byte per
 * value, 'p' a device pointer, 'i' a 32-bit and 'l' a 64-bit integer; the two scratch pointers
 * every Triton kernel of this ABI ends with are passed as NULL. Returns the driver's result (0 for
 * success); never raises but for arguments of the wrong shape. libcuda is found at the first call
 * with dlopen (the process already has it loaded: torch made the context); where it cannot be
 * found, every call returns -1 and the caller goes back to Triton's launcher.
 */
#include "hotpath.h"

#include <dlfcn.h>

#define MAX_PARAMS 32

typedef int (*cu_launch_kernel_t)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                                  unsigned shared, void *stream, void **params, void **extra);

static cu_launch_kernel_t cu_launch_kernel;
static int cu_looked_up;

static cu_launch_kernel_t
driver_launch(void)
{
    if (!cu_looked_up) {
        cu_looked_up = 1;
        void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        if (lib == NULL)
            lib = dlopen("libcuda.so.1", RTLD_NOW);
        if (lib != NULL)
            cu_launch_kernel = (cu_launch_kernel_t)dlsym(lib, "cuLaunchKernel");
    }
    return cu_launch_kernel;
}

PyObject *
m_launch_kernel(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 6 || !PyBytes_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError, "launch_kernel(function, grid, block, shared, stream, kinds, *values)");
        return NULL;
    }
    const char *kinds = PyBytes_AS_STRING(args[5]);
    Py_ssize_t n = PyBytes_GET_SIZE(args[5]);
    if (n != nargs - 6 || n + 2 > MAX_PARAMS) {
        PyErr_SetString(PyExc_TypeError, "launch_kernel: one kind per value, at most 30 values");
        return NULL;
    }
    unsigned long long head[5];
    for (int i = 0; i < 5; i++) {
        head[i] = PyLong_AsUnsignedLongLong(args[i]);
        if (head[i] == (unsigned long long)-1 && PyErr_Occurred())
            return NULL;
    }
    /* one 8-byte cell per parameter: a 32-bit integer is read from its cell's first 4 bytes */
    uint64_t cells[MAX_PARAMS];
    void *params[MAX_PARAMS];
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = args[6 + i];
        cells[i] = 0;
        if (kinds[i] == 'p') {
            cells[i] = (uint64_t)PyLong_AsUnsignedLongLong(v);
        }
        else if (kinds[i] == 'l') {
            int64_t x = (int64_t)PyLong_AsLongLong(v);
            memcpy(&cells[i], &x, sizeof x);
        }
        else if (kinds[i] == 'i') {
            long long x = PyLong_AsLongLong(v);
            if (!(x == -1 && PyErr_Occurred()) && (x < INT32_MIN || x > INT32_MAX)) {
                PyErr_SetString(PyExc_OverflowError, "launch_kernel: a 32-bit parameter out of range");
                return NULL;
            }
            int32_t y = (int32_t)x;
            memcpy(&cells[i], &y, sizeof y);
        }
        else {
            PyErr_SetString(PyExc_TypeError, "launch_kernel: kinds are 'p', 'i' or 'l'");
            return NULL;
        }
        if (PyErr_Occurred())
            return NULL;
        params[i] = &cells[i];
    }
    cells[n] = 0; /* global scratch */
    cells[n + 1] = 0; /* profile scratch */
    params[n] = &cells[n];
    params[n + 1] = &cells[n + 1];
    if (head[1] == 0)
        return PyLong_FromLong(0); /* an empty grid: Triton's launcher launches nothing either */
    cu_launch_kernel_t launch = driver_launch();
    if (launch == NULL)
        return PyLong_FromLong(-1);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = launch((void *)(uintptr_t)head[0], (unsigned)head[1], 1, 1, (unsigned)head[2], 1, 1, (unsigned)head[3],
                (void *)(uintptr_t)head[4], params, NULL);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}
