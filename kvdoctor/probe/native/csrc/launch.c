/* The GPU ledger's compiled Triton kernels launched straight through the CUDA driver.
 *
 * Why: Triton's launcher for a compiled kernel is Python before its C call (about 10 us a launch
 * on an H100), and the scheduler thread pays it for every hooked call on the GPU path before it
 * can launch the next step. The ledgers' launch.py keeps the compiled kernel and, where
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
 *
 * Device ledgers: the same launch without Python at all. A hooked alloc or free on a GPU slot
 * ledger (slot_ops.c) reads the index tensor through DLPack (no value, no sync), picks the
 * kernel its rule, index width and alignment select, fills in the index's address, its count and
 * the call site, and launches on the current stream: the update the Python role makes through
 * ledgers/kernels.py for a call of at most one block (one fused kernel). A request-table write (the owner kernel) and
 * a paged alloc's last-loc check take a kernel over slots and, per slot, a row (a tensor, or one
 * row given as a number), as many programs as it needs; a paged alloc's check and its update are
 * one kernel after the host's call (`device_last_loc_alloc`), the check alone where no slots came
 * back; an alloc or free of more than a block is its check, then its write, as the Python path
 * launches them (`device_update_blocks`). The plans (the compiled kernel, its fixed
 * parameters) are handed here by that Python path once it has compiled and launched the kernel
 * itself (`device_plan`); a call with no plan yet, a launch hook set or a refused
 * launch takes the Python path, which records exactly as it did before.
 */
#include "native.h"

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

/* Packs `values` as `kinds` says into one 8-byte cell each (a 32-bit integer in its cell's first 4
 * bytes), and points `params` at them, with the two NULL scratch pointers after: 0, or -1 (set). */
static int
pack_cells(const char *kinds, Py_ssize_t n, PyObject *const *values, uint64_t *cells, void **params)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = values[i];
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
                return -1;
            }
            int32_t y = (int32_t)x;
            memcpy(&cells[i], &y, sizeof y);
        }
        else {
            PyErr_SetString(PyExc_TypeError, "launch_kernel: kinds are 'p', 'i' or 'l'");
            return -1;
        }
        if (PyErr_Occurred())
            return -1;
        params[i] = &cells[i];
    }
    cells[n] = 0;     /* global scratch */
    cells[n + 1] = 0; /* profile scratch */
    params[n] = &cells[n];
    params[n + 1] = &cells[n + 1];
    return 0;
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
    uint64_t cells[MAX_PARAMS];
    void *params[MAX_PARAMS];
    if (pack_cells(kinds, n, args + 6, cells, params) < 0)
        return NULL;
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

/* ------------------------------------------------------------------ device ledgers */

#define DL_CPU_DEVICE 1

static DeviceLedger device_ledgers[MAX_LEDGERS];
static int n_device_ledgers;
static unsigned long long device_launches;
/* Tests: a list each device launch is appended to, (function, grid, block, shared, stream,
 * values), instead of going to the driver; NULL: the driver. A CPU ledger launches only into it. */
static PyObject *launch_record;

DeviceLedger *
device_ledger_of(PyObject *allocator)
{
    for (int i = 0; i < n_device_ledgers; i++)
        if (device_ledgers[i].allocator == allocator)
            return &device_ledgers[i];
    return NULL;
}

/* Whether a launch hook (a profiler's) is set: Triton's launcher calls it, this launch cannot
 * (ledgers/launch.py's _hooks_set). Anything unexpected counts as set. */
static int
hooks_set(PyObject *knobs)
{
    PyObject *names[2] = {S_launch_enter_hook, S_launch_exit_hook};
    for (int i = 0; i < 2; i++) {
        PyObject *hook = PyObject_GetAttr(knobs, names[i]);
        if (hook == NULL) {
            PyErr_Clear();
            return 1;
        }
        int set = 0;
        if (hook != Py_None) {
            PyObject *calls = PyObject_GetAttr(hook, S_hook_calls);
            if (calls == NULL) {
                PyErr_Clear();
                set = 1; /* a plain function */
            }
            else {
                set = PyObject_IsTrue(calls) != 0;
                if (set < 0)
                    PyErr_Clear();
                Py_DECREF(calls);
            }
        }
        Py_DECREF(hook);
        if (set)
            return 1;
    }
    return 0;
}

static PyObject *
recorded_value(char kind, uint64_t cell)
{
    if (kind == 'p')
        return PyLong_FromUnsignedLongLong(cell);
    if (kind == 'l') {
        int64_t x;
        memcpy(&x, &cell, sizeof x);
        return PyLong_FromLongLong(x);
    }
    int32_t y;
    memcpy(&y, &cell, sizeof y);
    return PyLong_FromLong(y);
}

static int
record_launch(const DevicePlan *p, unsigned grid, void *stream, const uint64_t *cells)
{
    PyObject *values = PyTuple_New(p->n);
    if (values == NULL)
        return -1;
    for (int i = 0; i < p->n; i++) {
        PyObject *v = recorded_value(p->kinds[i], cells[i]);
        if (v == NULL) {
            Py_DECREF(values);
            return -1;
        }
        PyTuple_SET_ITEM(values, i, v);
    }
    PyObject *entry = Py_BuildValue("(KIIIKN)", (unsigned long long)(uintptr_t)p->function, grid, p->block, p->shared,
                                    (unsigned long long)(uintptr_t)stream, values);
    if (entry == NULL)
        return -1;
    int rc = PyList_Append(launch_record, entry);
    Py_DECREF(entry);
    return rc;
}

/* One launch: the driver's, or the test's record. 0 launched, else the driver's refusal (nothing
 * launched), or -1 with an error set. */
static int
launch_one(const DevicePlan *p, unsigned grid, void *stream, uint64_t *cells)
{
    if (launch_record != NULL)
        return record_launch(p, grid, stream, cells) < 0 ? -1 : 0;
    void *params[DEVICE_MAX_PARAMS];
    for (int i = 0; i < p->n + 2; i++)
        params[i] = &cells[i];
    cu_launch_kernel_t launch = driver_launch();
    int rc = launch == NULL ? 1 : launch(p->function, grid, 1, 1, p->block, 1, 1, p->shared, stream, params, NULL);
    return rc == -1 ? 1 : rc; /* -1 is this file's error; a driver code is positive */
}

/* A plan's kernel (or two in turn: a check, then its write) launched on the current stream with
 * this call's cells, under the ledger's lock (the Python path's launches take it too): 1 launched,
 * 0 not (the Python path takes the call), -1 an error (set). A second launch the driver refuses
 * after the first went is an error: the check ran and its write did not, which the Python path
 * cannot take over without checking twice. */
static int
launch_plans(DeviceLedger *d, const DevicePlan *p, uint64_t *cells, const DevicePlan *then, uint64_t *then_cells,
             unsigned grid)
{
    if (launch_record == NULL && d->device_type == DL_CPU_DEVICE)
        return 0;
    if (d->hooks != NULL && hooks_set(d->hooks))
        return 0;
    PyObject *s = PyObject_CallOneArg(d->stream_of, d->device_arg);
    if (s == NULL)
        return -1;
    void *stream = PyLong_AsVoidPtr(s);
    Py_DECREF(s);
    if (stream == NULL && PyErr_Occurred())
        return -1;
    int taken = lock_enter(d->lock);
    if (taken < 0)
        return -1;
    int rc = launch_one(p, grid, stream, cells);
    int second = rc == 0 && then != NULL ? launch_one(then, grid, stream, then_cells) : 0;
    if (lock_leave(d->lock, taken) < 0 || rc < 0 || second < 0)
        return -1;
    if (rc != 0) {
        d->off = 1; /* refused, nothing launched: the Python path (Triton's launcher) from now on */
        return 0;
    }
    device_launches += then != NULL && second == 0 ? 2 : 1; /* a refused write launched nothing */
    if (second != 0) {
        d->off = 1;
        PyErr_Format(PyExc_RuntimeError, "the CUDA driver refused a ledger write after its check (%d)", second);
        return -1;
    }
    return 1;
}

static int
launch_plan(DeviceLedger *d, const DevicePlan *p, unsigned grid, uint64_t *cells)
{
    return launch_plans(d, p, cells, NULL, NULL, grid);
}

/* A call of more than a block: the check over every program, then the write (two kernels, as the
 * Python path launches them). */
static int
device_update_blocks(DeviceLedger *d, int slot, const void *data, Py_ssize_t n, int site)
{
    const DevicePlan *check = &d->plans[DEVICE_BLOCKS_CHECK_SLOT(slot)];
    const DevicePlan *write = &d->plans[DEVICE_BLOCKS_WRITE_SLOT(slot)];
    if (check->function == NULL || write->function == NULL || check->at_rows < 0 || n > INT32_MAX)
        return 0;
    uint64_t checked[DEVICE_MAX_PARAMS], written[DEVICE_MAX_PARAMS];
    memcpy(checked, check->cells, sizeof checked);
    memcpy(written, write->cells, sizeof written);
    int32_t count = (int32_t)n, at = (int32_t)site;
    checked[check->at_index] = checked[check->at_rows] = written[write->at_index] = (uint64_t)(uintptr_t)data;
    memcpy(&checked[check->at_count], &count, sizeof count);
    memcpy(&checked[check->at_site], &at, sizeof at);
    memcpy(&written[write->at_count], &count, sizeof count);
    memcpy(&written[write->at_site], &at, sizeof at);
    unsigned grid = (unsigned)((n + d->block_max - 1) / d->block_max);
    return launch_plans(d, check, checked, write, written, grid);
}

int
device_update(DeviceLedger *d, int rule, PyObject *index, int site)
{
    if (d->off)
        return 0;
    const void *data = NULL;
    Py_ssize_t n = 0;
    int itemsize = 0;
    if (!read_device_ints(index, d->device_type, d->device_id, &data, &n, &itemsize))
        return 0;
    if (n == 0)
        return 1; /* the Python method launches nothing for an empty call either */
    if (data == NULL)
        return 0;
    int aligned = ((uintptr_t)data % 16) == 0; /* the compiled kernel may assume it */
    int slot = (rule << 2) | ((itemsize == 8) << 1) | aligned;
    if (n > d->block_max)
        return device_update_blocks(d, slot, data, n, site);
    const DevicePlan *p = &d->plans[slot];
    if (p->function == NULL)
        return 0;
    uint64_t cells[DEVICE_MAX_PARAMS];
    memcpy(cells, p->cells, sizeof cells);
    cells[p->at_index] = (uint64_t)(uintptr_t)data;
    int32_t count = (int32_t)n, at = (int32_t)site;
    memcpy(&cells[p->at_count], &count, sizeof count);
    memcpy(&cells[p->at_site], &at, sizeof at);
    return launch_plan(d, p, 1, cells);
}

/* One index tensor of a call: its address, count, and width and alignment bits. */
static int
index_read(DeviceLedger *d, PyObject *t, const void **data, Py_ssize_t *n, int *bits)
{
    int itemsize = 0;
    if (!read_device_ints(t, d->device_type, d->device_id, data, n, &itemsize))
        return 0;
    *bits = ((itemsize == 8) << 1) | (((uintptr_t)*data % 16) == 0);
    return 1;
}

/* The rows beside `slots` (NULL for none); `drop_other`: rows of another length are dropped (the
 * last-loc check drops them), else they decline the call (the owner update, which the Python role
 * then leaves alone). */
static int
rows_reads(DeviceLedger *d, PyObject *slots, PyObject *rows, OwnerCall *call, int drop_other)
{
    memset(call, 0, sizeof *call);
    if (d->off || !index_read(d, slots, &call->slots, &call->n, &call->slots_bits))
        return 0;
    if (rows == NULL)
        return 1;
    Py_ssize_t n_rows = 0;
    if (!index_read(d, rows, &call->rows, &n_rows, &call->rows_bits))
        return 0;
    if (n_rows == call->n)
        return 1;
    call->rows = NULL;
    call->rows_bits = 0;
    return drop_other;
}

int
device_owner_reads(DeviceLedger *d, PyObject *values, PyObject *rows, OwnerCall *call)
{
    return rows_reads(d, values, rows, call, 0);
}

int
device_last_loc_reads(DeviceLedger *d, PyObject *last, PyObject *rows, OwnerCall *call)
{
    return rows_reads(d, last, rows, call, 1);
}

/* A kernel over slots and, per slot, a row (the owner kernel and the last-loc check): its plan
 * selected from `base` by whether there is a rows' tensor and both widths and alignments; `value`
 * goes where the plan's site is (the row, or the call site). As many programs as the kernel's
 * BLOCK needs. */
static int
rows_launch(DeviceLedger *d, int base, const OwnerCall *call, int32_t value)
{
    if (d->off)
        return 0;
    if (call->n == 0)
        return 1; /* the Python method launches nothing for an empty call either */
    if (call->n > INT32_MAX || call->slots == NULL)
        return 0;
    int tensor = call->rows != NULL;
    const DevicePlan *p = &d->plans[DEVICE_ROWS_SLOT(base, tensor, call->slots_bits, call->rows_bits)];
    if (p->function == NULL || p->at_rows < 0)
        return 0;
    uint64_t cells[DEVICE_MAX_PARAMS];
    memcpy(cells, p->cells, sizeof cells);
    cells[p->at_index] = (uint64_t)(uintptr_t)call->slots;
    /* no rows' tensor: the kernel reads none, and Python passes the slots in its place */
    cells[p->at_rows] = (uint64_t)(uintptr_t)(tensor ? call->rows : call->slots);
    int32_t count = (int32_t)call->n;
    memcpy(&cells[p->at_count], &count, sizeof count);
    memcpy(&cells[p->at_site], &value, sizeof value);
    unsigned grid = (unsigned)((call->n + d->block_max - 1) / d->block_max); /* the kernel's BLOCK a program */
    return launch_plan(d, p, grid, cells);
}

int
device_owner(DeviceLedger *d, const OwnerCall *call, long row)
{
    if (call->rows == NULL && (row < INT32_MIN || row > INT32_MAX))
        return 0;
    return rows_launch(d, DEVICE_OWNER_SLOT(0, 0, 0), call, call->rows != NULL ? 0 : (int32_t)row);
}

int
device_last_loc(DeviceLedger *d, const OwnerCall *call, int site)
{
    return rows_launch(d, DEVICE_LAST_LOC_SLOT(0, 0, 0), call, (int32_t)site);
}

int
device_last_loc_alloc(DeviceLedger *d, const OwnerCall *call, PyObject *slots, int site)
{
    const void *data = NULL;
    Py_ssize_t n = 0;
    int bits = 0;
    if (d->off || call->slots == NULL || !index_read(d, slots, &data, &n, &bits))
        return 0;
    if (n == 0 || call->n == 0 || n > d->block_max || call->n > d->block_max || data == NULL)
        return 0; /* one of them alone, or more than a block: the two kernels in turn */
    int tensor = call->rows != NULL;
    const DevicePlan *p = &d->plans[DEVICE_LAST_LOC_ALLOC_SLOT(tensor, call->slots_bits, call->rows_bits, bits)];
    if (p->function == NULL || p->at_rows < 0 || p->at_last < 0)
        return 0;
    uint64_t cells[DEVICE_MAX_PARAMS];
    memcpy(cells, p->cells, sizeof cells);
    cells[p->at_last] = (uint64_t)(uintptr_t)call->slots;
    cells[p->at_rows] = (uint64_t)(uintptr_t)(tensor ? call->rows : call->slots);
    cells[p->at_index] = (uint64_t)(uintptr_t)data;
    int32_t n_last = (int32_t)call->n, count = (int32_t)n, at = (int32_t)site;
    memcpy(&cells[p->at_last_count], &n_last, sizeof n_last);
    memcpy(&cells[p->at_count], &count, sizeof count);
    memcpy(&cells[p->at_site], &at, sizeof at);
    return launch_plan(d, p, 1, cells);
}

static void
device_ledger_release(DeviceLedger *d)
{
    Py_CLEAR(d->allocator);
    Py_CLEAR(d->ledger);
    Py_CLEAR(d->lock);
    Py_CLEAR(d->stream_of);
    Py_CLEAR(d->device_arg);
    Py_CLEAR(d->hooks);
}

void
device_ledgers_release(void)
{
    for (int i = 0; i < n_device_ledgers; i++)
        device_ledger_release(&device_ledgers[i]);
    n_device_ledgers = 0;
    H.primary_device = NULL;
}

unsigned long long
device_launch_count(void)
{
    return device_launches;
}

/* A GPU slot ledger the fast paths may update with its kernels (False: no room; it stays on the
 * Python path). Its plans come later, one per kernel, from device_plan. */
PyObject *
m_register_device_ledger(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"allocator",   "ledger",    "lock",      "stream_of", "device_arg", "hooks",
                            "device_type", "device_id", "page_size", "block_max", NULL};
    PyObject *allocator, *ledger, *lock, *stream_of, *device_arg, *hooks;
    int device_type, device_id;
    long page_size, block_max;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOiill", names, &allocator, &ledger, &lock, &stream_of,
                                     &device_arg, &hooks, &device_type, &device_id, &page_size, &block_max))
        return NULL;
    if (device_ledger_of(allocator) != NULL || n_device_ledgers >= MAX_LEDGERS || page_size < 1 || block_max < 1 ||
        !PyCallable_Check(stream_of))
        Py_RETURN_FALSE;
    DeviceLedger *d = &device_ledgers[n_device_ledgers];
    memset(d, 0, sizeof(*d));
    d->allocator = Py_NewRef(allocator);
    d->ledger = Py_NewRef(ledger);
    d->lock = Py_NewRef(lock);
    d->stream_of = Py_NewRef(stream_of);
    d->device_arg = Py_NewRef(device_arg);
    d->hooks = hooks == Py_None ? NULL : Py_NewRef(hooks);
    d->device_type = device_type;
    d->device_id = device_id;
    d->page_size = page_size;
    d->block_max = block_max;
    n_device_ledgers++;
    Py_RETURN_TRUE;
}

/* One kernel of a device ledger, as ledgers/kernels.py launched it: the slot its rule, width and
 * alignment select, the compiled function, the kinds and values of its runtime parameters (the
 * index, count and site positions' values are filled in per call). False: no such ledger. */
PyObject *
m_device_plan(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"ledger",   "slot",     "function", "kinds",   "block",   "shared",        "values",
                            "at_index", "at_count", "at_site",  "at_rows", "at_last", "at_last_count", NULL};
    PyObject *ledger, *values;
    int slot, at_index, at_count, at_site, at_rows = -1, at_last = -1, at_last_count = -1;
    unsigned long long function;
    unsigned block, shared;
    const char *kinds;
    Py_ssize_t n;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OiKy#IIO!iii|iii", names, &ledger, &slot, &function, &kinds, &n,
                                     &block, &shared, &PyTuple_Type, &values, &at_index, &at_count, &at_site, &at_rows,
                                     &at_last, &at_last_count))
        return NULL;
    /* the owner, last-loc and large calls' check plans name where their rows go */
    int fused = slot >= DEVICE_LAST_LOC_ALLOC_SLOT(0, 0, 0, 0) && slot < DEVICE_BLOCKS_CHECK_SLOT(0);
    int rows = slot >= DEVICE_OWNER_SLOT(0, 0, 0) && slot < DEVICE_BLOCKS_WRITE_SLOT(0);
    if (slot < 0 || slot >= DEVICE_PLAN_SLOTS || n + 2 > DEVICE_MAX_PARAMS || PyTuple_GET_SIZE(values) != n ||
        at_index < 0 || at_index >= n || at_count < 0 || at_count >= n || at_site < 0 || at_site >= n ||
        kinds[at_index] != 'p' || kinds[at_count] != 'i' || kinds[at_site] != 'i' || function == 0 ||
        (rows ? (at_rows < 0 || at_rows >= n || kinds[at_rows] != 'p') : at_rows != -1) ||
        (fused ? (at_last < 0 || at_last >= n || kinds[at_last] != 'p' || at_last_count < 0 || at_last_count >= n ||
                  kinds[at_last_count] != 'i')
               : (at_last != -1 || at_last_count != -1))) {
        PyErr_SetString(PyExc_ValueError, "device_plan: not a plan of a ledger kernel");
        return NULL;
    }
    DeviceLedger *d = NULL;
    for (int i = 0; i < n_device_ledgers; i++)
        if (device_ledgers[i].ledger == ledger)
            d = &device_ledgers[i];
    if (d == NULL)
        Py_RETURN_FALSE;
    DevicePlan plan;
    memset(&plan, 0, sizeof plan);
    void *params[DEVICE_MAX_PARAMS];
    if (pack_cells(kinds, n, &PyTuple_GET_ITEM(values, 0), plan.cells, params) < 0)
        return NULL;
    memcpy(plan.kinds, kinds, (size_t)n);
    plan.function = (void *)(uintptr_t)function;
    plan.block = block;
    plan.shared = shared;
    plan.n = (int)n;
    plan.at_index = at_index;
    plan.at_count = at_count;
    plan.at_site = at_site;
    plan.at_rows = at_rows;
    plan.at_last = at_last;
    plan.at_last_count = at_last_count;
    plan.cells[at_count] = 0;
    plan.cells[at_site] = 0;
    d->plans[slot] = plan;
    Py_RETURN_TRUE;
}

PyObject *
m_launch_record(PyObject *Py_UNUSED(module), PyObject *list)
{
    if (list != Py_None && !PyList_Check(list)) {
        PyErr_SetString(PyExc_TypeError, "launch_record(list or None)");
        return NULL;
    }
    Py_XSETREF(launch_record, list == Py_None ? NULL : Py_NewRef(list));
    Py_RETURN_NONE;
}
