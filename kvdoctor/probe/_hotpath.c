/* The probe's compiled hot path: the wrapper every hooked method gets, and the slot ledger's
 * healthy-case updates, without a Python frame.
 *
 * Why: SGLang's scheduler is CPU-bound at small batches, and a Python wrapper that reads index
 * tensors through torch's Python API and updates the ledger with numpy costs 9-21 us per hooked
 * call there. This module does the same work as `kvdoctor.probe.hooks.wrap_method` plus the roles
 * it knows (`kind`), in C:
 *
 * - dispatch: the probe's switches, re-entry (composite roles), the hooked-call count;
 * - the call site: looked up by (code object, offset) of the caller and its caller, interned by
 *   the same `CallSites` table the Python path uses (asked once per new key); on 3.11 and 3.12 the
 *   key is read from the interpreter's frame records, without making frame objects;
 * - index tensors: described by torch's DLPack C exchange table (`Tensor.__dlpack_c_exchange_api__`,
 *   one C call, no Python attribute reads) and read through their data pointer (CPU, int32/int64,
 *   contiguous); where the table is missing or declines a tensor, torch's Python getters;
 * - the ledger: the numpy arrays the Python `SlotLedger` owns, through their buffers, under a lock
 *   whose uncontended acquire is two stores (FastLock).
 *
 * It only ever takes the healthy case: every rule is checked first, and anything else (a
 * violation, an index it cannot read, a census due, a fix on, a fault injected) goes to the
 * Python role or ledger method, which records it exactly as it always has. What it writes is
 * what the Python path would have written; the tests compare the two on the same workloads.
 * Never raises into the host: its own failures go to `probe.fail`, like the Python wrapper's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#if PY_VERSION_HEX < 0x030B0000
#include <frameobject.h>
#endif
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030D0000
/* 3.11 and 3.12: the interpreter's own frame records, read to key call sites without making frame
 * objects (see site_key_direct; every key it makes is checked against the public API first). */
#ifndef Py_BUILD_CORE
#define Py_BUILD_CORE 1
#define KVD_UNDEF_BUILD_CORE 1
#endif
#include <internal/pycore_frame.h>
#ifdef KVD_UNDEF_BUILD_CORE
#undef Py_BUILD_CORE
#endif
#define KVD_DIRECT_FRAMES 1
#endif
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#ifdef Py_GIL_DISABLED
#error "the hot path's state is guarded by the GIL"
#endif

/* Failure and violation paths: out of line, in the cold section, so the healthy path's code stays
 * dense (the host's own code evicts ours from the instruction cache between two hooked calls). */
#if defined(__GNUC__)
#define COLD __attribute__((cold, noinline))
#else
#define COLD
#endif

/* The ledger's vocabulary (kvdoctor/probe/ledger/states.py; hotpath.py checks they agree). */
#define ST_FREE 1
#define ST_OWNED 2
#define ST_TREE 4
#define ST_RESERVED 8

/* What the fast path knows how to do for a hooked method. */
enum {
    K_GENERIC = 0, /* dispatch only: the Python role does the rest */
    K_NOTE,        /* changes no slot: call through */
    K_ALLOC,       /* alloc / alloc_extend / alloc_decode */
    K_FREE,        /* free / free_segment / free_pages */
    K_TREE_INSERT, /* RadixCache.insert */
    K_TREE_EVICT,  /* RadixCache.evict */
    K_TREE_UNLOCK, /* RadixCache.dec_lock_ref */
    K_REQ_WRITE,   /* ReqToTokenPool.write */
    K_REQ_ALLOC,   /* ReqToTokenPool.alloc(reqs) */
    K_REQ_FREE,    /* ReqToTokenPool.free(req) */
    K_REQ_FREE_ROWS, /* ReqToTokenPool.free_rows(indices) */
    K_LAST_LOC,      /* get_last_loc(req_to_token, req_pool_indices, prefix_lens): a module function */
    K_COUNT
};

#define MAX_DEPTH 32       /* nested hooked calls remembered per thread */
#define MAX_LEDGERS 64     /* allocators with a host ledger (more stay on the Python path) */
#define MAX_SITE_KEYS 65536 /* (caller, caller's caller) keys remembered */

/* ------------------------------------------------------------------ DLPack (the open standard's C ABI) */

/* The part of DLPack 1.x's C ABI the probe reads (dlpack.h, `DLTensor` and `DLPackExchangeAPI`):
 * torch publishes the table as a capsule on its tensor type, and its `dltensor_from_py_object_no_sync`
 * fills a DLTensor that views the tensor's own metadata, without a copy, a sync or a Python call. */
typedef struct {
    int32_t device_type; /* kDLCPU = 1 */
    int32_t device_id;
} DlDevice;
typedef struct {
    uint8_t code; /* kDLInt = 0 */
    uint8_t bits;
    uint16_t lanes;
} DlDataType;
typedef struct {
    void *data;
    DlDevice device;
    int32_t ndim;
    DlDataType dtype;
    int64_t *shape;
    int64_t *strides; /* NULL: compact row-major */
    uint64_t byte_offset;
} DlTensor;
typedef int (*DLTensorFromPy)(void *py_object, DlTensor *out);
typedef struct DlExchangeHeader {
    struct {
        uint32_t major, minor;
    } version;
    struct DlExchangeHeader *prev_api;
} DlExchangeHeader;
typedef struct {
    DlExchangeHeader header;
    void *managed_tensor_allocator;
    void *managed_tensor_from_py_object_no_sync;
    void *managed_tensor_to_py_object_no_sync;
    DLTensorFromPy dltensor_from_py_object_no_sync; /* may be NULL */
    void *current_work_stream;
} DlExchangeAPI;
#define DL_CPU 1
#define DL_CUDA_HOST 3 /* page-locked host memory: a CPU tensor to torch (is_cpu), if a producer says so */
#define DL_ROCM_HOST 11
#define DL_INT 0

/* ------------------------------------------------------------------ per-thread re-entry */

typedef struct {
    void *obj;
    int role_id;
    int composite;
} Entry;

typedef struct {
    int depth;
    int evicting;
    Entry e[MAX_DEPTH];
} ThreadState;

static _Thread_local ThreadState tls;

/* A call that must pass straight through: the same role on the same object is in progress, or
 * (composite roles) any composite role on that object is: free_segment -> free_page_ids -> free
 * is recorded once, by the outermost. */
static int
blocked(void *obj, int role_id, int composite)
{
    int depth = tls.depth < MAX_DEPTH ? tls.depth : MAX_DEPTH;
    for (int i = 0; i < depth; i++) {
        Entry *e = &tls.e[i];
        if (e->obj == obj && (e->role_id == role_id || (composite && e->composite)))
            return 1;
    }
    return 0;
}

static int
push(void *obj, int role_id, int composite)
{
    if (tls.depth < MAX_DEPTH) {
        Entry *e = &tls.e[tls.depth];
        e->obj = obj;
        e->role_id = role_id;
        e->composite = composite;
    }
    tls.depth++;
    return 0;
}

static void
pop(void)
{
    if (tls.depth > 0)
        tls.depth--;
}

/* ------------------------------------------------------------------ the ledger's lock */

/* A reentrant lock, like threading.RLock, that C takes without a method call. Its state is only
 * read and written with the GIL held (every caller holds it), so an uncontended acquire is a
 * thread-id compare and two stores: no lock of the system's. A thread that finds it held by
 * another (one that let go of the GIL inside its locked section, as a census in the writer thread
 * can) waits without the GIL, looking again every 50 us. Python uses it as `with ledger.lock:`. */
typedef struct {
    PyObject_HEAD
    unsigned long owner;
    long count;
    PyObject *weakrefs;
} FastLock;

static PyTypeObject FastLockType;

static int
fastlock_take(FastLock *self, int blocking)
{
    unsigned long me = PyThread_get_thread_ident();
    if (self->count > 0) {
        if (self->owner == me) {
            self->count++;
            return 1;
        }
        if (!blocking)
            return 0;
        while (self->count > 0) {
            Py_BEGIN_ALLOW_THREADS
            struct timespec pause = {0, 50 * 1000};
            nanosleep(&pause, NULL);
            Py_END_ALLOW_THREADS
        }
    }
    self->owner = me;
    self->count = 1;
    return 1;
}

static int
fastlock_give(FastLock *self)
{
    if (self->count <= 0 || self->owner != PyThread_get_thread_ident()) {
        PyErr_SetString(PyExc_RuntimeError, "cannot release un-acquired lock");
        return -1;
    }
    if (--self->count == 0)
        self->owner = 0;
    return 0;
}

static PyObject *
fastlock_new(PyTypeObject *type, PyObject *a, PyObject *kw)
{
    return type->tp_alloc(type, 0);
}

static void
fastlock_dealloc(FastLock *self)
{
    if (self->weakrefs != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
fastlock_acquire(FastLock *self, PyObject *a, PyObject *kw)
{
    static char *names[] = {"blocking", "timeout", NULL};
    int blocking = 1;
    double timeout = -1;
    if (!PyArg_ParseTupleAndKeywords(a, kw, "|pd", names, &blocking, &timeout))
        return NULL;
    if (timeout >= 0 && blocking) {
        PyErr_SetString(PyExc_ValueError, "the ledger lock takes no timeout");
        return NULL;
    }
    int r = fastlock_take(self, blocking);
    if (r < 0)
        return NULL;
    return PyBool_FromLong(r);
}

static PyObject *
fastlock_enter(FastLock *self, PyObject *unused)
{
    if (fastlock_take(self, 1) < 0)
        return NULL;
    Py_RETURN_TRUE;
}

static PyObject *
fastlock_release(FastLock *self, PyObject *unused)
{
    if (fastlock_give(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
fastlock_exit(FastLock *self, PyObject *args)
{
    if (fastlock_give(self) < 0)
        return NULL;
    Py_RETURN_FALSE;
}

static PyObject *
fastlock_is_owned(FastLock *self, PyObject *unused)
{
    return PyBool_FromLong(self->count > 0 && self->owner == PyThread_get_thread_ident());
}

static PyObject *
fastlock_at_fork_reinit(FastLock *self, PyObject *unused)
{
    /* in a forked child: whoever held it in the parent does not exist here */
    self->owner = 0;
    self->count = 0;
    Py_RETURN_NONE;
}

static PyMethodDef fastlock_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))fastlock_acquire, METH_VARARGS | METH_KEYWORDS, NULL},
    {"release", (PyCFunction)fastlock_release, METH_NOARGS, NULL},
    {"__enter__", (PyCFunction)fastlock_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)fastlock_exit, METH_VARARGS, NULL},
    {"_is_owned", (PyCFunction)fastlock_is_owned, METH_NOARGS, NULL},
    {"_at_fork_reinit", (PyCFunction)fastlock_at_fork_reinit, METH_NOARGS, NULL},
    {NULL}};

static PyTypeObject FastLockType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvdoctor.probe._hotpath.FastLock",
    .tp_basicsize = sizeof(FastLock),
    .tp_dealloc = (destructor)fastlock_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A reentrant lock the compiled path takes without a method call (see threading.RLock).",
    .tp_weaklistoffset = offsetof(FastLock, weakrefs),
    .tp_methods = fastlock_methods,
    .tp_new = fastlock_new,
};

/* ------------------------------------------------------------------ process state */

typedef struct {
    PyObject *allocator; /* strong: the key, compared by identity */
    PyObject *ledger;    /* the Python SlotLedger (slow path, evidence) */
    PyObject *lock;      /* its lock */
    Py_buffer b_state, b_owner, b_site;
    int8_t *state;
    int32_t *owner;
    int32_t *alloc_site;
    Py_ssize_t n;
    long rows, page_size, num_pages, sink;
    int page_shift; /* log2(page_size) when it is a power of two, else -1 */
    PyObject *group_attr; /* its free group (NULL: none): frees staged there are judged at the group's end */
    int group_open_when_false;
} Ledger;

typedef struct {
    PyCodeObject *code, *back;
    int lasti, back_lasti;
    int site;
} SiteKey;

static struct {
    PyObject *probe; /* strong; NULL: every wrapper passes through */
    int active;      /* probe set and its ledgers on */
    uint32_t ledgers_off;
    int fixes_on;
    uint64_t inject;
    unsigned long long calls;
    int fail_after_kind; /* tests: raise inside this kind's fast path after the host's call */
    unsigned long generation; /* bumped by reset(): a fast path that straddles it writes nothing */
    /* per kind: calls done here, calls sent to the generic path, calls handed to the Python ledger */
    unsigned long long n_fast[K_COUNT], n_diverted[K_COUNT], n_slow[K_COUNT];

    PyObject *site_at; /* CallSites.at(frame) */
    SiteKey *sites;
    Py_ssize_t sites_cap, sites_len;

    PyObject *sg_state; /* SglangState */
    PyObject *requests; /* its RequestTable */
    PyObject *last_loc_sources;
    PyObject *tree_seen; /* strong: the tree the state was last told about */
    int divert;          /* a census is pending: allocations take the Python path */
    Ledger ledgers[MAX_LEDGERS];
    int n_ledgers;
    Ledger *primary;
    Py_buffer b_extent;
    int64_t *extent;
    Py_ssize_t extent_n;

    PyObject *tensor_type, *dtype_int64, *dtype_int32;
    DLTensorFromPy dl_read; /* torch's DLPack reader; NULL: torch's Python getters */
} H;

static PyObject *S_numel, *S_item, *S_is_cpu, *S_dtype, *S_is_contiguous, *S_data_ptr, *S_fail, *S_acquire,
    *S_release, *S_on_alloc, *S_on_free, *S_on_tree_insert, *S_evictable_size, *S_protected_size, *S_value,
    *S_prefix_len, *S_tree, *S_kv_allocator, *S_lock_ref, *S_root_node, *S_only_page_starts, *S_evicting,
    *S_as_pages, *S_tree_attr, *S_dim, *S_note_row_write, *S_on_owner, *S_census_if_due, *S_allocated, *S_freed,
    *S_request_rows_freed, *S_rid, *S_req_to_token, *S_unknown_rid;

/* ------------------------------------------------------------------ failures */

/* The current exception goes to probe.fail(name, exc) (or fix_failed): the probe turns itself off
 * and says why; the host never sees it. BaseExceptions that are not Exceptions (KeyboardInterrupt)
 * propagate, as they do through the Python wrapper. Returns 0 when handled, -1 to propagate. */
COLD static int
report_failure(PyObject *name, const char *method)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (type == NULL)
        return 0;
    PyErr_NormalizeException(&type, &value, &tb);
    if (!PyErr_GivenExceptionMatches(type, PyExc_Exception)) {
        PyErr_Restore(type, value, tb);
        return -1;
    }
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    if (H.probe != NULL && value != NULL) {
        PyObject *r = PyObject_CallMethod(H.probe, method, "OO", name, value);
        if (r == NULL)
            PyErr_Clear();
        Py_XDECREF(r);
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return 0;
}

/* A fast path failed after the host's call returned `result`: the failure is reported (the probe
 * turns itself off) and the host gets its result, unless the failure is not an Exception. */
COLD static PyObject *
kept_after_failure(PyObject *name, PyObject *result)
{
    if (report_failure(name, "fail") < 0) {
        Py_DECREF(result);
        return NULL;
    }
    return result;
}

/* ------------------------------------------------------------------ reading index tensors */

typedef struct {
    Py_ssize_t n;
    const void *data; /* int32 or int64 elements; from read_ints with n == 1, &one (int64) */
    int itemsize;
    int64_t one; /* n == 1 */
} Ints; /* never copied: `data` may point into it */

static inline int64_t
ints_at(const Ints *v, Py_ssize_t i)
{
    if (v->n == 1)
        return v->one;
    if (v->itemsize == 8)
        return ((const int64_t *)v->data)[i];
    return ((const int32_t *)v->data)[i];
}

static PyObject *
call0(PyObject *obj, PyObject *name)
{
    return PyObject_CallMethodNoArgs(obj, name);
}

/* Both readers' last step: the elements (n and itemsize set) are at `ptr`; one is read now. */
static int
ints_found(Ints *out, const void *ptr)
{
    out->data = ptr;
    if (out->n == 1) {
        out->one = out->itemsize == 8 ? *(const int64_t *)ptr : *(const int32_t *)ptr;
        out->data = NULL;
    }
    return 1;
}

/* The element count of a tensor of this shape, and whether its strides are torch's is_contiguous
 * (size-1 dimensions' strides do not count; NULL strides: compact). Both readers ask it. */
static inline int
contiguous_count(const int64_t *shape, const int64_t *strides, int64_t ndim, Py_ssize_t *n)
{
    Py_ssize_t count = 1;
    for (int64_t i = 0; i < ndim; i++)
        count *= (Py_ssize_t)shape[i];
    *n = count;
    if (count <= 1 || strides == NULL)
        return 1;
    int64_t expected = 1;
    for (int64_t i = ndim - 1; i >= 0; i--) {
        if (shape[i] != 1) {
            if (strides[i] != expected)
                return 0;
            expected *= shape[i];
        }
    }
    return 1;
}

/* read_ints through DLPack: the same answers as torch's getters below (the tests compare them),
 * -1 with an error set where torch declines the tensor. */
static int
read_ints_dlpack(PyObject *t, Ints *out)
{
    DlTensor d;
    if (H.dl_read(t, &d) != 0)
        return -1;
    int host = d.device.device_type == DL_CPU || d.device.device_type == DL_CUDA_HOST ||
               d.device.device_type == DL_ROCM_HOST;
    if (!host || d.dtype.code != DL_INT || d.dtype.lanes != 1 ||
        (d.dtype.bits != 64 && d.dtype.bits != 32) || d.ndim < 0)
        return 0;
    Py_ssize_t n;
    int contiguous = contiguous_count(d.shape, d.strides, d.ndim, &n);
    int itemsize = d.dtype.bits / 8;
    out->n = n;
    out->itemsize = itemsize;
    if (n == 0)
        return 1;
    if (!contiguous)
        return 0;
    const char *ptr = (const char *)d.data + d.byte_offset;
    if (ptr == NULL)
        return 0;
    return ints_found(out, ptr);
}

/* read_ints through torch's Python getters (is_cpu, dtype, numel(), is_contiguous(), data_ptr()). */
static int
read_ints_getters(PyObject *t, Ints *out)
{
    PyObject *cpu = PyObject_GetAttr(t, S_is_cpu);
    if (cpu == NULL)
        return -1;
    int on_cpu = (cpu == Py_True);
    Py_DECREF(cpu);
    if (!on_cpu)
        return 0;
    PyObject *dtype = PyObject_GetAttr(t, S_dtype);
    if (dtype == NULL)
        return -1;
    int itemsize = dtype == H.dtype_int64 ? 8 : dtype == H.dtype_int32 ? 4 : 0;
    Py_DECREF(dtype);
    if (!itemsize)
        return 0;
    PyObject *n_obj = call0(t, S_numel);
    if (n_obj == NULL)
        return -1;
    Py_ssize_t n = PyLong_AsSsize_t(n_obj);
    Py_DECREF(n_obj);
    if (n < 0)
        return PyErr_Occurred() ? -1 : 0;
    out->n = n;
    out->itemsize = itemsize;
    if (n == 0)
        return 1;
    if (n > 1) { /* one element is contiguous whatever its strides */
        PyObject *c = call0(t, S_is_contiguous);
        if (c == NULL)
            return -1;
        int contiguous = (c == Py_True);
        Py_DECREF(c);
        if (!contiguous)
            return 0;
    }
    /* data_ptr(), not item(): item() goes through the dispatcher and lets go of the GIL */
    PyObject *p = call0(t, S_data_ptr);
    if (p == NULL)
        return -1;
    void *ptr = PyLong_AsVoidPtr(p);
    Py_DECREF(p);
    if (ptr == NULL)
        return PyErr_Occurred() ? -1 : 0;
    return ints_found(out, ptr);
}

static void
ints_clear(Ints *out)
{
    out->n = 0;
    out->data = NULL;
    out->itemsize = 0;
    out->one = 0;
}

/* A CPU integer tensor's values, without a copy: 1 read, 0 not a tensor we read here (no error
 * set), -1 an error (set). Only exact torch.Tensor objects on the CPU, int32/int64, contiguous. */
/* ------------------------------------------------------------------ torch's own tensor fields

torch's DLPack call costs about 600 instructions, most of them pybind11's (a GIL check, a type
caster, two reference counts), and from cold caches more than the rest of a hooked call. Where a
tensor is torch's plain CPU tensor, the same facts lie at fixed places: the TensorImpl pointer in the
Python object, its sizes and strides (inline up to 5 dimensions), storage offset, dtype, device and
dispatch keys, and the data pointer in its StorageImpl. Those places are not guessed: at start they
are found on sample tensors, each by the DLPack call's own answer, and taken only where every
sample agrees on one place (a pointer is followed only where it points where DLPack's shape array
or data are). A tensor is then read this way only if its TensorImpl and StorageImpl are of the very
classes the samples had, on the CPU, of an index dtype, with dispatch keys a sample had; anything
else is asked of DLPack. One read in CHECK_EVERY is also read through DLPack and compared: a
difference turns this reader off for good. KVDOCTOR_HOTPATH_DIRECT=0 never uses it. */

#define DIRECT_CHECK_EVERY 1024
#define DIRECT_MAX_KEYSETS 4

typedef struct {
    int on;
    Py_ssize_t impl;          /* in the Python object: the TensorImpl pointer */
    const void *impl_class;   /* the plain TensorImpl's vtable */
    Py_ssize_t ndim, sizes, strides, inline_dims, storage_offset, dtype, device, keys;
    uint16_t dtype_i64, dtype_i32;
    uint64_t keysets[DIRECT_MAX_KEYSETS];
    int n_keysets;
    Py_ssize_t storage;       /* in the TensorImpl: the StorageImpl pointer */
    const void *storage_class;
    Py_ssize_t data;          /* in the StorageImpl: the data pointer */
    unsigned long reads, checked, check_every, until_check, mismatches;
} DirectLayout;

static DirectLayout DIRECT = {.check_every = DIRECT_CHECK_EVERY, .until_check = DIRECT_CHECK_EVERY};

#define AT(base, off, type) (*(const type *)((const char *)(base) + (off)))

static inline int
plausible_pointer(uintptr_t p)
{
    return p >= 65536 && (p & 7) == 0;
}

/* 1 read, -2 not a tensor this reader knows (DLPack is asked). Reads nothing it has not checked. */
static int
read_ints_direct(PyObject *t, Ints *out)
{
    const DirectLayout *L = &DIRECT;
    const char *impl = AT(t, L->impl, const char *);
    if (impl == NULL || AT(impl, 0, const void *) != L->impl_class)
        return -2;
    if (AT(impl, L->device, uint8_t) != 0 || AT(impl, L->device + 2, uint8_t) != 1) /* CPU, and set */
        return -2;
    uint64_t keys = AT(impl, L->keys, uint64_t);
    int known = 0;
    for (int i = 0; i < L->n_keysets; i++)
        known |= keys == L->keysets[i];
    if (!known)
        return -2;
    uint16_t dtype = AT(impl, L->dtype, uint16_t);
    int itemsize = dtype == L->dtype_i64 ? 8 : dtype == L->dtype_i32 ? 4 : 0;
    uint64_t ndim = AT(impl, L->ndim, uint64_t);
    if (itemsize == 0 || ndim > (uint64_t)L->inline_dims)
        return -2;
    const int64_t *shape = (const int64_t *)(impl + L->sizes), *strides = (const int64_t *)(impl + L->strides);
    Py_ssize_t n;
    if (!contiguous_count(shape, strides, (int64_t)ndim, &n) || n < 0)
        return -2;
    out->n = n;
    out->itemsize = itemsize;
    if (n == 0)
        return 1;
    const char *storage = AT(impl, L->storage, const char *);
    if (storage == NULL || AT(storage, 0, const void *) != L->storage_class)
        return -2;
    const char *data = AT(storage, L->data, const char *);
    int64_t offset = AT(impl, L->storage_offset, int64_t);
    if (data == NULL || offset < 0)
        return -2;
    return ints_found(out, data + offset * itemsize);
}

static int
same_ints(const Ints *a, const Ints *b)
{
    return a->n == b->n && a->itemsize == b->itemsize && a->data == b->data && a->one == b->one;
}

/* One sample as DLPack and torch's getters describe it, for learning the places. */
typedef struct {
    PyObject *t;
    DlTensor d;
    int dl_ok;
    int meta;
    int64_t storage_offset;
    const char *impl;
} Sample;

/* The one offset in [lo, hi) (step `step`) where `fits` holds for every sample; -1: none, or more
 * than one (a place two fields could be is no place). */
typedef int (*Fits)(const Sample *s, int n, Py_ssize_t off);

static Py_ssize_t
only_offset(const Sample *s, int n, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t step, Fits fits)
{
    Py_ssize_t found = -1;
    for (Py_ssize_t off = lo; off < hi; off += step) {
        if (fits(s, n, off)) {
            if (found >= 0)
                return -1;
            found = off;
        }
    }
    return found;
}

static int
is_index_dtype(const DlTensor *d, int bits)
{
    return d->dtype.code == DL_INT && d->dtype.lanes == 1 && d->dtype.bits == bits;
}

static int
fits_storage_offset(const Sample *s, int n, Py_ssize_t off)
{
    int varied = 0;
    for (int i = 0; i < n; i++) {
        if (s[i].meta)
            continue;
        if (AT(s[i].impl, off, int64_t) != s[i].storage_offset)
            return 0;
        varied |= s[i].storage_offset != 0;
    }
    return varied;
}

/* the dtype: one value per DLPack dtype, different dtypes different values */
static int
fits_dtype(const Sample *s, int n, Py_ssize_t off)
{
    for (int i = 0; i < n; i++) {
        if (s[i].meta || !s[i].dl_ok)
            continue;
        for (int j = 0; j < i; j++) {
            if (s[j].meta || !s[j].dl_ok)
                continue;
            int same_type = s[i].d.dtype.code == s[j].d.dtype.code && s[i].d.dtype.bits == s[j].d.dtype.bits &&
                            s[i].d.dtype.lanes == s[j].d.dtype.lanes;
            int same_value = AT(s[i].impl, off, uint16_t) == AT(s[j].impl, off, uint16_t);
            if (same_type != same_value)
                return 0;
        }
    }
    return 1;
}

/* the device: c10's Device {type, index} and its optional's flag: CPU (0), index -1, set; the meta
 * sample's type is not CPU */
static int
fits_device(const Sample *s, int n, Py_ssize_t off)
{
    int saw_meta = 0;
    for (int i = 0; i < n; i++) {
        uint8_t type = AT(s[i].impl, off, uint8_t), index = AT(s[i].impl, off + 1, uint8_t);
        uint8_t set = AT(s[i].impl, off + 2, uint8_t);
        if (index != 0xff || set != 1)
            return 0;
        if (s[i].meta) {
            if (type == 0)
                return 0;
            saw_meta = 1;
        }
        else if (type != 0)
            return 0;
    }
    return saw_meta;
}

static int
learn_direct(PyObject *samples)
{
    DirectLayout L = {.check_every = DIRECT_CHECK_EVERY, .until_check = DIRECT_CHECK_EVERY};
    int n = (int)PyList_GET_SIZE(samples);
    if (n < 4 || n > 64 || H.dl_read == NULL)
        return 0;
    Sample s[64];
    memset(s, 0, sizeof(s));
    Py_ssize_t basic = ((PyTypeObject *)H.tensor_type)->tp_basicsize;
    /* what DLPack and the getters say of each sample */
    for (int i = 0; i < n; i++) {
        PyObject *t = PyList_GET_ITEM(samples, i);
        if (Py_TYPE(t) != (PyTypeObject *)H.tensor_type)
            return 0;
        s[i].t = t;
        PyObject *meta = PyObject_GetAttrString(t, "is_meta");
        PyObject *offset = meta ? PyObject_CallMethod(t, "storage_offset", NULL) : NULL;
        s[i].meta = meta == Py_True;
        s[i].storage_offset = offset ? PyLong_AsLongLong(offset) : -1;
        Py_XDECREF(meta);
        Py_XDECREF(offset);
        if (PyErr_Occurred())
            return -1;
        if (!s[i].meta) {
            s[i].dl_ok = H.dl_read(t, &s[i].d) == 0 && s[i].d.device.device_type == DL_CPU;
            PyErr_Clear();
            if (!s[i].dl_ok)
                return 0;
        }
    }
    /* the TensorImpl pointer: where DLPack's shape array lies a little past it, in every sample */
    for (Py_ssize_t off = 16; off <= 24 && L.impl == 0; off += 8) {
        if (off + 8 > basic)
            break;
        Py_ssize_t sizes = -1;
        int ok = 1;
        for (int i = 0; i < n && ok; i++) {
            uintptr_t p = AT(s[i].t, off, uintptr_t);
            if (!plausible_pointer(p)) {
                ok = 0;
                break;
            }
            if (s[i].meta || s[i].d.ndim < 1)
                continue;
            intptr_t d = (intptr_t)s[i].d.shape - (intptr_t)p;
            if (d < 16 || d >= 512 || d % 8 || (sizes >= 0 && d != sizes))
                ok = 0;
            sizes = d;
        }
        if (ok && sizes > 0) {
            L.impl = off;
            L.sizes = sizes;
        }
    }
    if (L.impl == 0)
        return 0;
    for (int i = 0; i < n; i++)
        s[i].impl = AT(s[i].t, L.impl, const char *);
    L.impl_class = AT(s[0].impl, 0, const void *);
    L.strides = -1;
    for (int i = 0; i < n; i++) {
        if (AT(s[i].impl, 0, const void *) != L.impl_class)
            return 0;
        if (s[i].meta || s[i].d.ndim < 1)
            continue;
        if (s[i].d.strides == NULL)
            return 0;
        Py_ssize_t d = (const char *)s[i].d.strides - s[i].impl;
        if (d <= L.sizes || (L.strides >= 0 && d != L.strides))
            return 0;
        L.strides = d;
    }
    L.inline_dims = (L.strides - L.sizes) / 8;
    L.ndim = L.sizes - 8;
    if (L.strides < 0 || L.inline_dims < 2 || L.inline_dims > 8)
        return 0;
    int max_ndim = 0;
    for (int i = 0; i < n; i++) {
        if (!s[i].meta && AT(s[i].impl, L.ndim, uint64_t) != (uint64_t)s[i].d.ndim)
            return 0;
        if (!s[i].meta && s[i].d.ndim > max_ndim)
            max_ndim = s[i].d.ndim;
    }
    if (max_ndim < 2)
        return 0;
    /* past the sizes and strides: storage offset, then dtype, device and dispatch keys */
    Py_ssize_t past = L.strides + 8 * L.inline_dims;
    L.storage_offset = only_offset(s, n, past, past + 32, 8, fits_storage_offset);
    if (L.storage_offset < 0)
        return 0;
    L.dtype = only_offset(s, n, L.storage_offset + 8, L.storage_offset + 48, 2, fits_dtype);
    L.device = only_offset(s, n, L.storage_offset + 8, L.storage_offset + 48, 1, fits_device);
    if (L.dtype < 0 || L.device < 0)
        return 0;
    L.keys = (L.device + 3 + 7) / 8 * 8;
    int have64 = 0, have32 = 0;
    for (int i = 0; i < n; i++) {
        if (s[i].meta)
            continue;
        if (is_index_dtype(&s[i].d, 64)) {
            L.dtype_i64 = AT(s[i].impl, L.dtype, uint16_t);
            have64 = 1;
        }
        if (is_index_dtype(&s[i].d, 32)) {
            L.dtype_i32 = AT(s[i].impl, L.dtype, uint16_t);
            have32 = 1;
        }
        if (is_index_dtype(&s[i].d, 64) || is_index_dtype(&s[i].d, 32)) {
            uint64_t keys = AT(s[i].impl, L.keys, uint64_t);
            int known = 0;
            for (int k = 0; k < L.n_keysets; k++)
                known |= L.keysets[k] == keys;
            if (!known) {
                if (L.n_keysets == DIRECT_MAX_KEYSETS)
                    return 0;
                L.keysets[L.n_keysets++] = keys;
            }
        }
    }
    if (!have64 || !have32 || L.dtype_i64 == L.dtype_i32)
        return 0;
    /* the data: the StorageImpl pointer, and the data pointer in it, where DLPack's data is */
    for (Py_ssize_t st = 16; st <= 24 && L.storage == 0; st += 8) {
        for (Py_ssize_t dp = 16; dp <= 24 && L.storage == 0; dp += 8) {
            int ok = 1, seen = 0;
            const void *storage_class = NULL;
            for (int i = 0; i < n && ok; i++) {
                if (s[i].meta)
                    continue;
                Py_ssize_t item = s[i].d.dtype.bits / 8;
                Py_ssize_t numel;
                contiguous_count(s[i].d.shape, s[i].d.strides, s[i].d.ndim, &numel);
                if (numel == 0 || item == 0)
                    continue;
                uintptr_t storage = AT(s[i].impl, st, uintptr_t);
                if (!plausible_pointer(storage)) {
                    ok = 0;
                    break;
                }
                const char *want = (const char *)s[i].d.data + s[i].d.byte_offset - s[i].storage_offset * item;
                const void *cls = AT(storage, 0, const void *);
                ok = AT(storage, dp, const char *) == want && (storage_class == NULL || cls == storage_class);
                storage_class = cls;
                seen++;
            }
            if (ok && seen >= 3) {
                L.storage = st;
                L.data = dp;
                L.storage_class = storage_class;
            }
        }
    }
    if (L.storage == 0)
        return 0;
    /* every sample, read both ways: what DLPack reads, this reads the same; what DLPack declines
     * (another dtype, not contiguous) or cannot describe (meta), this leaves to it */
    L.on = 1;
    DirectLayout saved = DIRECT;
    DIRECT = L;
    for (int i = 0; i < n; i++) {
        Ints a, b;
        ints_clear(&a);
        ints_clear(&b);
        int ra = read_ints_direct(s[i].t, &a);
        int rb = s[i].meta ? -1 : read_ints_dlpack(s[i].t, &b);
        PyErr_Clear();
        if (rb == 1 ? !(ra == 1 && same_ints(&a, &b)) : ra != -2) {
            DIRECT = saved;
            return 0;
        }
    }
    return 1;
}

static int
read_ints(PyObject *t, Ints *out)
{
    ints_clear(out);
    if (H.tensor_type == NULL || Py_TYPE(t) != (PyTypeObject *)H.tensor_type)
        return 0;
    int rc = -1;
    if (DIRECT.on) {
        rc = read_ints_direct(t, out);
        if (rc == 1)
            DIRECT.reads++;
        if (rc == 1 && --DIRECT.until_check == 0) {
            DIRECT.until_check = DIRECT.check_every;
            Ints check;
            ints_clear(&check);
            DIRECT.checked++;
            if (read_ints_dlpack(t, &check) != 1 || !same_ints(out, &check)) {
                PyErr_Clear();
                DIRECT.mismatches++;
                DIRECT.on = 0; /* a layout we misread: DLPack from now on */
                rc = -1;
            }
        }
        if (rc != 1) {
            rc = -1;
            ints_clear(out);
        }
    }
    if (rc < 0 && H.dl_read != NULL) {
        rc = read_ints_dlpack(t, out);
        if (rc < 0) {
            PyErr_Clear(); /* a tensor DLPack cannot describe (a meta tensor): torch's own getters say */
            ints_clear(out);
        }
    }
    if (rc < 0)
        rc = read_ints_getters(t, out);
    if (rc == 1 && out->n == 1) { /* one element: read like the others (EACH_INT), from `one` */
        out->data = &out->one;
        out->itemsize = 8;
    }
    return rc;
}

/* ------------------------------------------------------------------ call sites */

static inline Py_ssize_t
site_hash(void *a, int b, void *c, int d, Py_ssize_t mask)
{
    uint64_t h = (uint64_t)(uintptr_t)a * 0x9E3779B97F4A7C15ULL;
    h ^= ((uint64_t)(uint32_t)b + 0x632BE59BD9B4E019ULL) * 0xBF58476D1CE4E5B9ULL;
    h ^= (uint64_t)(uintptr_t)c * 0x94D049BB133111EBULL;
    h ^= (uint64_t)(uint32_t)d * 0xD6E8FEB86659FD93ULL;
    h ^= h >> 31;
    return (Py_ssize_t)(h & (uint64_t)mask);
}

COLD static int
sites_grow(void)
{
    Py_ssize_t cap = H.sites_cap ? H.sites_cap * 2 : 256;
    SiteKey *fresh = PyMem_Calloc((size_t)cap, sizeof(SiteKey));
    if (fresh == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < H.sites_cap; i++) {
        SiteKey *k = &H.sites[i];
        if (k->code == NULL)
            continue;
        Py_ssize_t j = site_hash(k->code, k->lasti, k->back, k->back_lasti, cap - 1);
        while (fresh[j].code != NULL)
            j = (j + 1) & (cap - 1);
        fresh[j] = *k;
    }
    PyMem_Free(H.sites);
    H.sites = fresh;
    H.sites_cap = cap;
    return 0;
}

static void
sites_clear(void)
{
    for (Py_ssize_t i = 0; i < H.sites_cap; i++) {
        Py_XDECREF(H.sites[i].code);
        Py_XDECREF(H.sites[i].back);
    }
    PyMem_Free(H.sites);
    H.sites = NULL;
    H.sites_cap = H.sites_len = 0;
}

/* The site already interned for this key, or -1. */
static int
site_lookup(PyCodeObject *code, int lasti, PyCodeObject *back_code, int back_lasti)
{
    if (!H.sites_cap)
        return -1;
    Py_ssize_t mask = H.sites_cap - 1;
    Py_ssize_t j = site_hash(code, lasti, back_code, back_lasti, mask);
    while (H.sites[j].code != NULL) {
        SiteKey *k = &H.sites[j];
        if (k->code == code && k->lasti == lasti && k->back == back_code && k->back_lasti == back_lasti)
            return k->site;
        j = (j + 1) & mask;
    }
    return -1;
}

#ifdef KVD_DIRECT_FRAMES
static int direct_frames = 1; /* off for good after one disagreement with the public API */

static inline _PyInterpreterFrame *
first_complete(_PyInterpreterFrame *f)
{
    while (f != NULL && _PyFrame_IsIncomplete(f))
        f = f->previous;
    return f;
}

static inline int
frame_lasti(_PyInterpreterFrame *f)
{
    int lasti = _PyInterpreterFrame_LASTI(f);
    return lasti < 0 ? -1 : lasti * (int)sizeof(_Py_CODEUNIT); /* PyFrame_GetLasti's units */
}

/* The key of the current call site from the interpreter's frame records: what the public API below
 * gives, without PyEval_GetFrame/PyFrame_GetBack making (and later freeing) two frame objects per
 * caller. Borrowed code objects. */
static int
site_key_direct(PyCodeObject **code, int *lasti, PyCodeObject **back_code, int *back_lasti)
{
    PyThreadState *ts = PyThreadState_GET();
    _PyInterpreterFrame *f = first_complete(ts->cframe->current_frame);
    if (f == NULL)
        return 0;
    *code = f->f_code;
    *lasti = frame_lasti(f);
    _PyInterpreterFrame *b = first_complete(f->previous);
    *back_code = b != NULL ? b->f_code : NULL;
    *back_lasti = b != NULL ? frame_lasti(b) : -1;
    return 1;
}
#endif

/* The interned call site of the current call (the hooked method's caller and its caller), the same
 * id `CallSites.at(sys._getframe(1))` gives from the Python wrapper. -1 with an error set. */
static int
current_site(void)
{
    if (H.site_at == NULL)
        return 0;
#ifdef KVD_DIRECT_FRAMES
    PyCodeObject *d_code = NULL, *d_back = NULL;
    int d_lasti = -1, d_back_lasti = -1;
    int direct = direct_frames && site_key_direct(&d_code, &d_lasti, &d_back, &d_back_lasti);
    if (direct) {
        int found = site_lookup(d_code, d_lasti, d_back, d_back_lasti);
        if (found >= 0)
            return found;
    }
#endif
    PyFrameObject *frame = PyEval_GetFrame(); /* borrowed: the caller of the hooked method */
    if (frame == NULL)
        return 0;
    PyCodeObject *code = PyFrame_GetCode(frame);
#if PY_VERSION_HEX >= 0x030B0000
    int lasti = PyFrame_GetLasti(frame);
#else
    int lasti = frame->f_lasti;
#endif
    PyFrameObject *back = PyFrame_GetBack(frame);
    PyCodeObject *back_code = NULL;
    int back_lasti = -1;
    if (back != NULL) {
        back_code = PyFrame_GetCode(back);
#if PY_VERSION_HEX >= 0x030B0000
        back_lasti = PyFrame_GetLasti(back);
#else
        back_lasti = back->f_lasti;
#endif
        Py_DECREF(back);
    }
#ifdef KVD_DIRECT_FRAMES
    /* a new key: the direct read must name the same frames, or it is not used again */
    if (direct && (d_code != code || d_lasti != lasti || d_back != back_code || d_back_lasti != back_lasti))
        direct_frames = 0;
#endif
    int site = site_lookup(code, lasti, back_code, back_lasti);
    if (site >= 0) {
        Py_DECREF(code);
        Py_XDECREF(back_code);
        return site;
    }
    PyObject *r = PyObject_CallOneArg(H.site_at, (PyObject *)frame);
    if (r == NULL) {
        Py_DECREF(code);
        Py_XDECREF(back_code);
        return -1;
    }
    site = (int)PyLong_AsLong(r);
    Py_DECREF(r);
    if (site < 0 || PyErr_Occurred()) {
        Py_DECREF(code);
        Py_XDECREF(back_code);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "negative call site id");
        return -1;
    }
    if (H.sites_len < MAX_SITE_KEYS) {
        if ((H.sites_len + 1) * 2 > H.sites_cap && sites_grow() < 0) {
            PyErr_Clear(); /* not remembered: the next call asks CallSites again */
        }
        else {
            Py_ssize_t mask = H.sites_cap - 1;
            Py_ssize_t j = site_hash(code, lasti, back_code, back_lasti, mask);
            while (H.sites[j].code != NULL)
                j = (j + 1) & mask;
            H.sites[j].code = code; /* the references are kept: an id is never reused while keyed */
            H.sites[j].back = back_code;
            H.sites[j].lasti = lasti;
            H.sites[j].back_lasti = back_lasti;
            H.sites[j].site = site;
            H.sites_len++;
            return site;
        }
    }
    Py_DECREF(code);
    Py_XDECREF(back_code);
    return site;
}

/* ------------------------------------------------------------------ ledgers */

static Ledger *
ledger_of(PyObject *allocator)
{
    for (int i = 0; i < H.n_ledgers; i++)
        if (H.ledgers[i].allocator == allocator)
            return &H.ledgers[i];
    return NULL;
}

static int
lock_ledger(Ledger *l)
{
    if (Py_TYPE(l->lock) == &FastLockType)
        return fastlock_take((FastLock *)l->lock, 1) < 0 ? -1 : 0;
    PyObject *r = call0(l->lock, S_acquire);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static int
unlock_ledger(Ledger *l)
{
    if (Py_TYPE(l->lock) == &FastLockType)
        return fastlock_give((FastLock *)l->lock);
    PyObject *r = call0(l->lock, S_release);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* A fast path's update of a ledger: pure C, no Python code, the GIL held throughout. Where the
 * ledger's FastLock is held by nobody, no other thread can take it before this thread lets go of
 * the GIL (taking it needs the GIL), so the update is already exclusive and the lock is left alone.
 * Held by anyone (this thread's Python role, or another thread waiting out a census), it is taken
 * as usual. Returns 1 taken (give it back with ledger_leave), 0 not needed, -1 an error. */
static inline int
ledger_enter(Ledger *l)
{
    if (Py_TYPE(l->lock) == &FastLockType && ((FastLock *)l->lock)->count == 0)
        return 0;
    return lock_ledger(l) < 0 ? -1 : 1;
}

static inline int
ledger_leave(Ledger *l, int taken)
{
    return taken ? unlock_ledger(l) : 0;
}

/* A ledger's shape in locals for its loops: the state array is int8, which may alias anything, so
 * fields read through the ledger inside a loop would be read again after every store. */
typedef struct {
    int64_t rows, num_pages;
    long page_size;
    int shift; /* log2(page_size), or -1 */
} Shape;

static inline Shape
shape_of(const Ledger *l)
{
    Shape s = {l->rows, l->num_pages, l->page_size, l->page_shift};
    return s;
}

/* The page of a slot (slot >= 0): a shift for the usual power-of-two page sizes. */
static inline int64_t
page_at(const Shape *s, int64_t slot)
{
    return s->shift >= 0 ? slot >> s->shift : slot / s->page_size;
}

/* Whether a slot (>= 0) starts its page. */
static inline int
starts_page(const Shape *s, int64_t slot)
{
    return s->shift >= 0 ? (slot & ((INT64_C(1) << s->shift) - 1)) == 0 : slot % s->page_size == 0;
}

static inline int
in_body(const Shape *s, int64_t page)
{
    return page >= 1 && page <= s->num_pages;
}

/* Runs the statements after `x` for each element v[start:stop] bound to `x` (int64 or int32, the
 * type chosen once, not per element). `continue` skips an element; `return` leaves the caller. */
#define EACH_INT(v, start, stop, x, ...)                                                                    \
    do {                                                                                                    \
        if ((v)->itemsize == 8) {                                                                           \
            const int64_t *each_ = (const int64_t *)(v)->data;                                              \
            for (Py_ssize_t i_ = (start); i_ < (stop); i_++) {                                              \
                const int64_t x = each_[i_];                                                                \
                __VA_ARGS__                                                                                 \
            }                                                                                               \
        }                                                                                                   \
        else {                                                                                              \
            const int32_t *each_ = (const int32_t *)(v)->data;                                              \
            for (Py_ssize_t i_ = (start); i_ < (stop); i_++) {                                              \
                const int64_t x = each_[i_];                                                                \
                __VA_ARGS__                                                                                 \
            }                                                                                               \
        }                                                                                                   \
    } while (0)

/* alloc: every page handed out (page starts only, with `only_page_starts`) must be free. */
static int
alloc_is_healthy(const Ledger *l, const Ints *v, int only_page_starts)
{
    const Shape s = shape_of(l);
    const int8_t *state = l->state;
    EACH_INT(v, 0, v->n, slot, {
        if (slot < 0 || slot >= s.rows)
            return 0;
        if (only_page_starts && !starts_page(&s, slot))
            continue;
        int64_t page = page_at(&s, slot);
        if (!in_body(&s, page) || state[page] != ST_FREE)
            return 0;
    });
    return 1;
}

static void
alloc_apply(Ledger *l, const Ints *v, int only_page_starts, int site)
{
    const Shape s = shape_of(l);
    int8_t *state = l->state;
    int32_t *owner = l->owner, *alloc_site = l->alloc_site;
    EACH_INT(v, 0, v->n, slot, {
        if (only_page_starts && !starts_page(&s, slot))
            continue;
        int64_t page = page_at(&s, slot);
        state[page] = ST_OWNED;
        owner[page] = -1;
        alloc_site[page] = site;
    });
}

/* free: every page named must be held (not free) and inside the pool. */
static int
free_is_healthy(const Ledger *l, const Ints *v, int as_pages)
{
    const Shape s = shape_of(l);
    const int8_t *state = l->state;
    EACH_INT(v, 0, v->n, x, {
        int64_t page;
        if (as_pages)
            page = x;
        else {
            if (x < 0 || x >= s.rows)
                return 0;
            page = page_at(&s, x);
        }
        if (!in_body(&s, page) || (state[page] & ST_FREE))
            return 0;
    });
    return 1;
}

static void
free_apply(Ledger *l, const Ints *v, int as_pages, int evicting)
{
    const Shape s = shape_of(l);
    int8_t *state = l->state;
    EACH_INT(v, 0, v->n, x, {
        int64_t page = as_pages ? x : page_at(&s, x);
        state[page] = evicting ? ST_FREE : (int8_t)((state[page] & ST_TREE) | ST_FREE);
    });
}

/* tree insert of value[start:stop]: every page must be held, not free. */
static int
tree_insert_is_healthy(const Ledger *l, const Ints *v, Py_ssize_t start, Py_ssize_t stop)
{
    const Shape s = shape_of(l);
    const int8_t *state = l->state;
    EACH_INT(v, start, stop, slot, {
        if (slot < 0 || slot >= s.rows)
            return 0;
        int64_t page = page_at(&s, slot);
        if (!in_body(&s, page) || (state[page] & ST_FREE))
            return 0;
    });
    return 1;
}

static void
tree_insert_apply(Ledger *l, const Ints *v, Py_ssize_t start, Py_ssize_t stop)
{
    const Shape s = shape_of(l);
    int8_t *state = l->state;
    int32_t *owner = l->owner;
    EACH_INT(v, start, stop, slot, {
        int64_t page = page_at(&s, slot);
        state[page] = ST_TREE;
        owner[page] = -1;
    });
}

/* last_loc must point into a page its request still holds (-1: no prefix). */
static int
last_loc_is_healthy(const Ledger *l, const Ints *last, const Ints *req)
{
    const Shape s = shape_of(l);
    for (Py_ssize_t i = 0; i < last->n; i++) {
        int64_t v = ints_at(last, i);
        if (v == -1)
            continue;
        if (v < 0 || v >= s.rows)
            return 0;
        int64_t page = page_at(&s, v);
        if (!in_body(&s, page))
            return 0;
        int st = l->state[page];
        if ((st & ST_FREE) || !(st & (ST_OWNED | ST_TREE)))
            return 0;
        if (req != NULL && st == ST_OWNED) {
            int64_t own = l->owner[page];
            int64_t r = ints_at(req, i);
            if (own >= 0 && r >= 0 && own != r)
                return 0;
        }
    }
    return 1;
}

/* ------------------------------------------------------------------ the wrapper type */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;
    PyObject *original;
    PyObject *role;
    PyObject *hook;
    PyObject *name;
    PyObject *before, *after, *rewrite, *finally_, *prepare, *rewrite_result; /* NULL: Role's no-op */
    int role_id;
    int composite;
    int wants_site;
    uint32_t ledger_mask;
    uint64_t role_bit;
    int kind;
    /* fast-path parameters */
    Py_ssize_t last_loc_pos; /* -1: none */
    PyObject *last_loc_name;
    int only_page_starts;
    int as_pages;
    PyObject *group_attr; /* NULL: no free groups */
    int group_open_when_false;
    Py_ssize_t value_pos; /* tree insert: where params (or value) is */
    int value_in_params;  /* tree insert: value is params.value */
    Py_ssize_t node_pos;  /* tree unlock */
    Py_ssize_t indices_pos, values_pos; /* req write */
    PyObject *value_name, *node_name, *indices_name, *values_name; /* the same arguments by keyword */
    Py_ssize_t req_pos, reqs_pos;           /* request pool: where the request(s) are */
    PyObject *req_name, *reqs_name;
    PyObject *req_index_path; /* tuple of attribute names: the request's row (`kv.req_pool_idx`) */
    int function;             /* a module-level function: no object first, `after` on the result only */
    Py_ssize_t table_pos, rows_pos, prefix_pos; /* get_last_loc's arguments */
    PyObject *table_name, *rows_name, *prefix_name;
    Py_ssize_t sources_max; /* get_last_loc results remembered */
} Hooked;

static PyTypeObject HookedType;
#ifdef KVD_TIMING
#include <time.h>
static double T_orig[16], T_all[16];
#endif

/* The host's call, with the arguments it was given. */
static inline PyObject *
call_original(Hooked *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
#ifdef KVD_TIMING
    struct timespec a, b; clock_gettime(CLOCK_MONOTONIC, &a);
    PyObject *r = PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    clock_gettime(CLOCK_MONOTONIC, &b);
    T_orig[self->kind] += (b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec);
    return r;
#else
    return PyObject_Vectorcall(self->original, args, nargsf, kwnames);
#endif
}

/* An argument by keyword, else by position (args[0] is the object): borrowed, NULL if absent. */
static PyObject *
arg_at(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, Py_ssize_t pos, PyObject *name)
{
    if (kwnames != NULL && name != NULL) {
        Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t i = 0; i < nk; i++) {
            PyObject *k = PyTuple_GET_ITEM(kwnames, i);
            if (k == name || PyUnicode_Compare(k, name) == 0)
                return args[nargs + i];
        }
    }
    if (pos >= 0 && pos + 1 < nargs)
        return args[pos + 1];
    return NULL;
}

/* The call through the host's method with this hook's entry pushed (nested hooked calls on the
 * same object see it). */
static PyObject *
call_pushed(Hooked *self, PyObject *obj, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    push(obj, self->role_id, self->composite);
    PyObject *r = call_original(self, args, nargsf, kwnames);
    pop();
    return r;
}

static int
maybe_test_failure(Hooked *self)
{
    if (H.fail_after_kind == self->kind && self->kind != K_GENERIC) {
        PyErr_Format(PyExc_RuntimeError, "fault injected into the %U fast path", self->name);
        return -1;
    }
    return 0;
}

/* The Python ledger method, under the ledger's lock, for what the fast path does not record itself
 * (a violation: its evidence is made there, exactly as without this module). */
COLD static int
ledger_slow(Ledger *l, PyObject *method, PyObject *const *args, size_t nargs, PyObject *kwnames)
{
    if (lock_ledger(l) < 0)
        return -1;
    PyObject *m = PyObject_GetAttr(l->ledger, method);
    PyObject *r = m ? PyObject_Vectorcall(m, args, nargs, kwnames) : NULL;
    Py_XDECREF(m);
    int rc = r ? 0 : -1;
    Py_XDECREF(r);
    if (rc < 0) {
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        if (unlock_ledger(l) < 0)
            PyErr_Clear();
        PyErr_Restore(t, v, tb);
        return -1;
    }
    return unlock_ledger(l);
}

/* Tells the SGLang state which radix tree it is looking at (`SglangState.tree`), once per tree. */
static int
note_tree(PyObject *tree)
{
    if (H.tree_seen == tree)
        return 0;
    if (H.sg_state == NULL || PyObject_SetAttr(H.sg_state, S_tree_attr, tree) < 0)
        return -1;
    Py_INCREF(tree);
    Py_XSETREF(H.tree_seen, tree);
    return 0;
}

#define DIVERT ((PyObject *)1) /* the fast path declines, before the host's call: take the generic path */

/* --- alloc / alloc_extend / alloc_decode --- */
static PyObject *
fast_alloc(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *obj = args[0];
    Ledger *l = ledger_of(obj);
    if (l == NULL)
        return DIVERT;
    if (H.divert) {
        /* the idle census the last release asked for: taken here, as the Python role does */
        if (H.sg_state == NULL)
            return DIVERT;
        PyObject *r = call0(H.sg_state, S_census_if_due);
        if (r == NULL) {
            if (report_failure(self->name, "fail") < 0)
                return NULL;
            return call_original(self, args, nargsf, kwnames); /* the probe is off now */
        }
        Py_DECREF(r);
        if (!H.active)
            return call_original(self, args, nargsf, kwnames);
    }
    if (self->last_loc_pos >= 0) {
        PyObject *last_loc = arg_at(args, nargs, kwnames, self->last_loc_pos, self->last_loc_name);
        if (last_loc != NULL && last_loc != Py_None) {
            Ints last, req;
            int rc = read_ints(last_loc, &last);
            if (rc != 1) {
                PyErr_Clear();
                return DIVERT;
            }
            Ints *reqp = NULL;
            if (H.last_loc_sources != NULL) {
                PyObject *key = PyLong_FromVoidPtr(last_loc);
                if (key == NULL) {
                    PyErr_Clear();
                    return DIVERT;
                }
                PyObject *source = PyDict_GetItemWithError(H.last_loc_sources, key); /* borrowed */
                Py_DECREF(key);
                if (source == NULL && PyErr_Occurred()) {
                    PyErr_Clear();
                    return DIVERT;
                }
                if (source != NULL && PyTuple_Check(source) && PyTuple_GET_SIZE(source) >= 2 &&
                    PyTuple_GET_ITEM(source, 0) == last_loc) {
                    PyObject *req_indices = PyTuple_GET_ITEM(source, 1);
                    if (req_indices != Py_None) {
                        rc = read_ints(req_indices, &req);
                        if (rc != 1) {
                            PyErr_Clear();
                            return DIVERT;
                        }
                        if (req.n == last.n) /* the Python check ignores rows of another shape */
                            reqp = &req;
                    }
                }
            }
            if (!last_loc_is_healthy(l, &last, reqp))
                return DIVERT;
        }
    }
    int site = current_site();
    if (site < 0) {
        PyErr_Clear();
        return DIVERT;
    }
    unsigned long gen = H.generation;
    PyObject *result = call_pushed(self, obj, args, nargsf, kwnames);
    if (result == NULL || result == Py_None || gen != H.generation)
        return result;
    Ints v;
    int rc = read_ints(result, &v);
    if (rc == 1 && maybe_test_failure(self) < 0)
        rc = -1;
    if (rc < 0)
        goto failed;
    int taken = ledger_enter(l);
    if (taken < 0)
        goto failed;
    int healthy = rc == 1 && alloc_is_healthy(l, &v, self->only_page_starts);
    if (healthy)
        alloc_apply(l, &v, self->only_page_starts, site);
    if (ledger_leave(l, taken) < 0)
        goto failed;
    if (!healthy) {
        PyObject *site_obj = PyLong_FromLong(site);
        PyObject *kw = Py_BuildValue("(O)", S_only_page_starts);
        if (site_obj == NULL || kw == NULL) {
            Py_XDECREF(site_obj);
            Py_XDECREF(kw);
            goto failed;
        }
        PyObject *call_args[3] = {result, site_obj, self->only_page_starts ? Py_True : Py_False};
        H.n_slow[K_ALLOC]++;
        int src = ledger_slow(l, S_on_alloc, call_args, 2, kw);
        Py_DECREF(site_obj);
        Py_DECREF(kw);
        if (src < 0)
            goto failed;
    }
    return result;
failed:
    return kept_after_failure(self->name, result);
}

/* --- free / free_segment / free_pages --- */
static int
group_is_open(Hooked *self, PyObject *obj)
{
    if (self->group_attr == NULL)
        return 0;
    PyObject *value = PyObject_GetAttr(obj, self->group_attr);
    if (value == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
        value = Py_NewRef(Py_None);
    }
    int open = self->group_open_when_false ? (value == Py_False) : (value != Py_None);
    Py_DECREF(value);
    return open;
}

static PyObject *
fast_free(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *obj = args[0];
    int open = group_is_open(self, obj);
    if (open < 0) {
        PyErr_Clear();
        return DIVERT;
    }
    if (open) /* staged in the group; recorded when the group ends */
        return call_pushed(self, obj, args, nargsf, kwnames);
    Ledger *l = ledger_of(obj);
    if (l == NULL)
        return DIVERT;
    PyObject *index = nargs >= 2 ? args[1] : (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0 ? args[nargs] : NULL);
    if (index == NULL)
        return DIVERT;
    Py_INCREF(index); /* the host may drop its own reference during the call */
    unsigned long gen = H.generation;
    PyObject *result = call_pushed(self, obj, args, nargsf, kwnames);
    if (result == NULL || gen != H.generation) {
        Py_DECREF(index);
        return result;
    }
    Ints v;
    int rc = read_ints(index, &v);
    if (rc == 1 && maybe_test_failure(self) < 0)
        rc = -1;
    if (rc < 0)
        goto failed;
    if (rc == 1 && v.n == 0)
        goto done;
    int evicting = tls.evicting > 0;
    if (rc == 1) {
        int taken = ledger_enter(l);
        if (taken < 0)
            goto failed;
        int healthy = free_is_healthy(l, &v, self->as_pages);
        if (healthy)
            free_apply(l, &v, self->as_pages, evicting);
        if (ledger_leave(l, taken) < 0)
            goto failed;
        if (healthy)
            goto done;
    }
    else {
        /* not a tensor we read: the Python role's own test (has numel, not empty) decides */
        PyObject *n = PyObject_HasAttr(index, S_numel) ? call0(index, S_numel) : NULL;
        if (n == NULL) {
            if (PyErr_Occurred())
                goto failed;
            goto done;
        }
        int empty = PyObject_Not(n);
        Py_DECREF(n);
        if (empty)
            goto done;
    }
    {
        int site = current_site();
        if (site < 0)
            goto failed;
        PyObject *site_obj = PyLong_FromLong(site);
        PyObject *kw = Py_BuildValue("(OO)", S_evicting, S_as_pages);
        if (site_obj == NULL || kw == NULL) {
            Py_XDECREF(site_obj);
            Py_XDECREF(kw);
            goto failed;
        }
        PyObject *call_args[4] = {index, site_obj, evicting ? Py_True : Py_False, self->as_pages ? Py_True : Py_False};
        H.n_slow[K_FREE]++;
        int src = ledger_slow(l, S_on_free, call_args, 2, kw);
        Py_DECREF(site_obj);
        Py_DECREF(kw);
        if (src < 0)
            goto failed;
    }
done:
    Py_DECREF(index);
    return result;
failed:
    Py_DECREF(index);
    return kept_after_failure(self->name, result);
}

/* --- RadixCache.insert --- */
static int
tree_size(PyObject *tree, long *out)
{
    PyObject *a = call0(tree, S_evictable_size);
    if (a == NULL)
        return -1;
    PyObject *b = call0(tree, S_protected_size);
    if (b == NULL) {
        Py_DECREF(a);
        return -1;
    }
    PyObject *ai = PyNumber_Long(a), *bi = PyNumber_Long(b);
    Py_DECREF(a);
    Py_DECREF(b);
    if (ai == NULL || bi == NULL) {
        Py_XDECREF(ai);
        Py_XDECREF(bi);
        return -1;
    }
    long x = PyLong_AsLong(ai), y = PyLong_AsLong(bi);
    Py_DECREF(ai);
    Py_DECREF(bi);
    if (PyErr_Occurred())
        return -1;
    *out = x + y;
    return 0;
}

/* The tree's allocator's ledger; NULL without an error when the tree names none or it is not ours. */
static Ledger *
tree_ledger(PyObject *tree, int *no_allocator)
{
    *no_allocator = 0;
    PyObject *allocator = PyObject_GetAttr(tree, S_kv_allocator);
    if (allocator == NULL) {
        PyErr_Clear();
        *no_allocator = 1;
        return NULL;
    }
    if (allocator == Py_None) {
        Py_DECREF(allocator);
        *no_allocator = 1;
        return NULL;
    }
    Ledger *l = ledger_of(allocator);
    Py_DECREF(allocator);
    return l;
}

static PyObject *
fast_tree_insert(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *obj = args[0];
    int no_allocator;
    Ledger *l = tree_ledger(obj, &no_allocator);
    if (l == NULL) /* the Python role decides what a tree without our allocator means */
        return DIVERT;
    if (note_tree(obj) < 0) {
        PyErr_Clear();
        return DIVERT;
    }
    long size_before;
    if (tree_size(obj, &size_before) < 0) {
        PyErr_Clear();
        return DIVERT;
    }
    int site = current_site();
    if (site < 0) {
        PyErr_Clear();
        return DIVERT;
    }
    PyObject *carrier = arg_at(args, nargs, kwnames, self->value_pos, self->value_name);
    Py_XINCREF(carrier);
    unsigned long gen = H.generation;
    PyObject *result = call_pushed(self, obj, args, nargsf, kwnames);
    if (result == NULL || gen != H.generation) {
        Py_XDECREF(carrier);
        return result;
    }
    PyObject *value = NULL;
    if (carrier != NULL) {
        if (self->value_in_params) {
            value = PyObject_GetAttr(carrier, S_value);
            if (value == NULL)
                PyErr_Clear();
        }
        else
            value = Py_NewRef(carrier);
    }
    Py_XDECREF(carrier);
    if (value == NULL || value == Py_None || !PyObject_HasAttr(value, S_numel))
        goto done;
    long size_after;
    if (maybe_test_failure(self) < 0 || tree_size(obj, &size_after) < 0)
        goto failed;
    long grown = size_after - size_before;
    long prefix_len;
    PyObject *pl = PyObject_GetAttr(result, S_prefix_len);
    if (pl == NULL) {
        PyErr_Clear();
        if (!PyLong_Check(result))
            goto done;
        pl = Py_NewRef(result);
    }
    if (!PyLong_Check(pl)) {
        Py_DECREF(pl);
        goto done;
    }
    prefix_len = PyLong_AsLong(pl);
    Py_DECREF(pl);
    if (PyErr_Occurred())
        goto failed;
    if (grown <= 0)
        goto done;
    Ints v;
    int rc = read_ints(value, &v);
    if (rc < 0)
        goto failed;
    int healthy = 0;
    if (rc == 1 && prefix_len >= 0) {
        /* value[prefix_len : prefix_len + grown] of a 1-D tensor */
        PyObject *d = call0(value, S_dim);
        if (d == NULL)
            goto failed;
        long dim = PyLong_AsLong(d);
        Py_DECREF(d);
        if (dim == 1) {
            Py_ssize_t start = prefix_len < v.n ? prefix_len : v.n;
            Py_ssize_t stop = prefix_len + grown < v.n ? prefix_len + grown : v.n;
            int taken = ledger_enter(l);
            if (taken < 0)
                goto failed;
            healthy = tree_insert_is_healthy(l, &v, start, stop);
            if (healthy)
                tree_insert_apply(l, &v, start, stop);
            if (ledger_leave(l, taken) < 0)
                goto failed;
        }
    }
    if (!healthy) {
        PyObject *part = PySequence_GetSlice(value, prefix_len, prefix_len + grown);
        if (part == NULL)
            goto failed;
        PyObject *site_obj = PyLong_FromLong(site);
        if (site_obj == NULL) {
            Py_DECREF(part);
            goto failed;
        }
        PyObject *call_args[2] = {part, site_obj};
        H.n_slow[K_TREE_INSERT]++;
        int src = ledger_slow(l, S_on_tree_insert, call_args, 2, NULL);
        Py_DECREF(part);
        Py_DECREF(site_obj);
        if (src < 0)
            goto failed;
    }
done:
    Py_XDECREF(value);
    return result;
failed:
    Py_XDECREF(value);
    return kept_after_failure(self->name, result);
}

/* --- RadixCache.evict --- */
static PyObject *
fast_tree_evict(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *obj = args[0];
    int no_allocator;
    Ledger *l = tree_ledger(obj, &no_allocator);
    if (l == NULL)
        return DIVERT;
    if (note_tree(obj) < 0) {
        PyErr_Clear();
        return DIVERT;
    }
    tls.evicting++;
    PyObject *result = call_pushed(self, obj, args, nargsf, kwnames);
    tls.evicting--;
    return result;
}

/* --- RadixCache.dec_lock_ref: a node already at lock_ref 0 goes to the Python role (violation) --- */
static PyObject *
fast_tree_unlock(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *obj = args[0];
    PyObject *node = arg_at(args, nargs, kwnames, self->node_pos, self->node_name);
    if (node != NULL) {
        PyObject *lock_ref = PyObject_GetAttr(node, S_lock_ref);
        if (lock_ref == NULL) {
            PyErr_Clear();
        }
        else {
            int underflow = 0;
            if (PyLong_Check(lock_ref)) {
                long value = PyLong_AsLong(lock_ref);
                if (PyErr_Occurred()) {
                    PyErr_Clear();
                    underflow = 1; /* let the Python role look */
                }
                else
                    underflow = value <= 0;
            }
            Py_DECREF(lock_ref);
            if (underflow) {
                PyObject *root = PyObject_GetAttr(obj, S_root_node);
                if (root == NULL)
                    PyErr_Clear();
                int is_root = root == node;
                Py_XDECREF(root);
                if (!is_root)
                    return DIVERT;
            }
        }
    }
    return call_pushed(self, obj, args, nargsf, kwnames);
}

/* --- ReqToTokenPool.write((row, columns), values) --- */
static PyObject *
fast_req_write(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *obj = args[0];
    Ledger *l = H.primary;
    if (l == NULL || H.extent == NULL)
        return DIVERT; /* the Python role sets both up on its first call */
    PyObject *indices = arg_at(args, nargs, kwnames, self->indices_pos, self->indices_name);
    PyObject *values = arg_at(args, nargs, kwnames, self->values_pos, self->values_name);
    if (indices == NULL || values == NULL || !PyTuple_CheckExact(indices) || PyTuple_GET_SIZE(indices) != 2 ||
        H.tensor_type == NULL || Py_TYPE(values) != (PyTypeObject *)H.tensor_type)
        return DIVERT;
    PyObject *row = PyTuple_GET_ITEM(indices, 0);
    PyObject *columns = PyTuple_GET_ITEM(indices, 1);
    if (!PyLong_CheckExact(row) || !PySlice_Check(columns))
        return DIVERT; /* batched rows or column tensors: the Python role */
    PySliceObject *sl = (PySliceObject *)columns;
    if ((sl->stop != Py_None && !PyLong_CheckExact(sl->stop)) || (sl->start != Py_None && !PyLong_CheckExact(sl->start)))
        return DIVERT;
    long r = PyLong_AsLong(row);
    if (r == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return DIVERT;
    }
    Py_INCREF(values);
    Py_INCREF(indices);
    unsigned long gen = H.generation;
    PyObject *result = call_pushed(self, obj, args, nargsf, kwnames);
    if (result == NULL || gen != H.generation) {
        Py_DECREF(values);
        Py_DECREF(indices);
        return result;
    }
    Ints v;
    int rc = read_ints(values, &v);
    if (rc == 1 && maybe_test_failure(self) < 0)
        rc = -1;
    if (rc < 0)
        goto failed;
    if (rc == 0) {
        /* a value we do not read here: the Python role's two steps, exactly */
        H.n_slow[K_REQ_WRITE]++;
        PyObject *a[4] = {obj, row, columns, values};
        PyObject *m = PyObject_GetAttr(H.sg_state, S_note_row_write);
        PyObject *x = m ? PyObject_Vectorcall(m, a, 4, NULL) : NULL;
        Py_XDECREF(m);
        if (x == NULL)
            goto failed;
        Py_DECREF(x);
        PyObject *b[2] = {values, row};
        if (ledger_slow(l, S_on_owner, b, 2, NULL) < 0)
            goto failed;
        goto done;
    }
    {
        /* note_row_write: how far the row was written */
        int64_t stop;
        if (sl->stop != Py_None) {
            stop = PyLong_AsLongLong(sl->stop);
        }
        else {
            int64_t start = 0;
            if (sl->start != Py_None) {
                start = PyLong_AsLongLong(sl->start);
            }
            stop = start + v.n;
        }
        if (PyErr_Occurred())
            goto failed;
        if (r >= 0 && r < H.extent_n && stop > H.extent[r])
            H.extent[r] = stop;
        /* on_owner: the slots the row now points at belong to it */
        int taken = ledger_enter(l);
        if (taken < 0)
            goto failed;
        const Shape shape = shape_of(l);
        const int8_t *state = l->state;
        int32_t *owner = l->owner;
        EACH_INT(&v, 0, v.n, slot, {
            if (slot < 0 || slot >= shape.rows)
                continue;
            int64_t page = page_at(&shape, slot);
            if (state[page] == ST_OWNED)
                owner[page] = (int32_t)r;
        });
        if (ledger_leave(l, taken) < 0)
            goto failed;
    }
done:
    Py_DECREF(values);
    Py_DECREF(indices);
    return result;
failed:
    Py_DECREF(values);
    Py_DECREF(indices);
    return kept_after_failure(self->name, result);
}

/* --- ReqToTokenPool.alloc(reqs): rows handed to requests --- */
static PyObject *
fast_req_alloc(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *obj = args[0];
    if (H.requests == NULL)
        return DIVERT;
    PyObject *reqs = arg_at(args, nargs, kwnames, self->reqs_pos, self->reqs_name);
    Py_XINCREF(reqs);
    unsigned long gen = H.generation;
    PyObject *result = call_pushed(self, obj, args, nargsf, kwnames);
    if (result == NULL || gen != H.generation) {
        Py_XDECREF(reqs);
        return result;
    }
    PyObject *seq = NULL;
    int empty = PyObject_Not(result);
    if (empty < 0)
        goto failed;
    if (empty)
        goto done;
    seq = PySequence_Fast(result, "rows");
    if (seq == NULL)
        goto failed;
    int listed = reqs != NULL && (PyList_Check(reqs) || PyTuple_Check(reqs));
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_ssize_t nreqs = listed ? PySequence_Size(reqs) : n;
    for (Py_ssize_t i = 0; i < n && i < nreqs; i++) {
        PyObject *index = PyNumber_Long(PySequence_Fast_GET_ITEM(seq, i));
        if (index == NULL)
            goto failed;
        PyObject *rid_obj = NULL;
        if (listed) {
            PyObject *req = PySequence_GetItem(reqs, i);
            if (req == NULL) {
                Py_DECREF(index);
                goto failed;
            }
            rid_obj = PyObject_GetAttr(req, S_rid);
            Py_DECREF(req);
            if (rid_obj == NULL) {
                if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
                    Py_DECREF(index);
                    goto failed;
                }
                PyErr_Clear();
            }
        }
        PyObject *rid = rid_obj != NULL ? PyObject_Str(rid_obj) : Py_NewRef(S_unknown_rid);
        Py_XDECREF(rid_obj);
        if (rid == NULL) {
            Py_DECREF(index);
            goto failed;
        }
        PyObject *a[3] = {H.requests, index, rid};
        PyObject *r = PyObject_VectorcallMethod(S_allocated, a, 3, NULL);
        Py_DECREF(index);
        Py_DECREF(rid);
        if (r == NULL)
            goto failed;
        Py_DECREF(r);
    }
done:
    Py_XDECREF(seq);
    Py_XDECREF(reqs);
    return result;
failed:
    Py_XDECREF(seq);
    Py_XDECREF(reqs);
    return kept_after_failure(self->name, result);
}

/* `SglangState.check_release` for a host ledger, as a test: 1 the row's release is healthy (nothing it
 * pointed at is still its own, no free group open), 0 the Python check must look (a leak to name, a
 * group to wait for, a table we do not read), -1 an error. Changes nothing. */
static int
release_is_healthy(PyObject *pool, long row)
{
    if (H.extent == NULL || row < 0 || row >= H.extent_n)
        return 1; /* the Python check returns at once too */
    int64_t extent = H.extent[row];
    Ledger *l = H.primary;
    if (extent == 0 || l == NULL)
        return 1;
    if (l->group_attr != NULL) {
        PyObject *value = PyObject_GetAttr(l->allocator, l->group_attr);
        if (value == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError))
                return -1;
            PyErr_Clear();
        }
        else {
            int open = l->group_open_when_false ? (value == Py_False) : (value != Py_None);
            Py_DECREF(value);
            if (open)
                return 0;
        }
    }
    PyObject *table = PyObject_GetAttr(pool, S_req_to_token);
    if (table == NULL) {
        PyErr_Clear();
        return 0;
    }
    Ints t;
    int rc = read_ints(table, &t);
    if (rc != 1 || t.n < 2 || t.n % H.extent_n) {
        Py_DECREF(table);
        if (rc < 0)
            PyErr_Clear();
        return 0;
    }
    Py_ssize_t cols = t.n / H.extent_n;
    Py_ssize_t upto = extent < cols ? (Py_ssize_t)extent : cols;
    const Shape shape = shape_of(l);
    const int8_t *state = l->state;
    const int32_t *owner = l->owner;
    Py_ssize_t first = (Py_ssize_t)row * cols;
    int healthy = 1;
    EACH_INT(&t, first, first + upto, slot, {
        if (slot < 0)
            continue;
        int64_t page = page_at(&shape, slot);
        if (in_body(&shape, page) && state[page] == ST_OWNED && owner[page] == row) {
            healthy = 0;
            break;
        }
    });
    Py_DECREF(table);
    return healthy;
}

static void
release_done(long row)
{
    if (H.extent != NULL && row >= 0 && row < H.extent_n)
        H.extent[row] = 0;
}

/* After a release: the request table's bookkeeping, in its own Python methods. */
static int
rows_freed(PyObject *const *rows, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a[2] = {H.requests, rows[i]};
        PyObject *r = PyObject_VectorcallMethod(S_freed, a, 2, NULL);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
    }
    PyObject *r = call0(H.sg_state, S_request_rows_freed);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* --- ReqToTokenPool.free(req) --- */
static PyObject *
fast_req_free(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *obj = args[0];
    if (H.requests == NULL || H.sg_state == NULL || self->req_index_path == NULL)
        return DIVERT;
    PyObject *req = arg_at(args, nargs, kwnames, self->req_pos, self->req_name);
    PyObject *index = NULL;
    if (req != NULL) {
        index = Py_NewRef(req);
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(self->req_index_path) && index != Py_None; i++) {
            PyObject *next = PyObject_GetAttr(index, PyTuple_GET_ITEM(self->req_index_path, i));
            if (next == NULL) {
                if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
                    PyErr_Clear();
                    Py_DECREF(index);
                    return DIVERT;
                }
                PyErr_Clear();
                next = Py_NewRef(Py_None);
            }
            Py_SETREF(index, next);
        }
        if (index == Py_None && PyLong_Check(req))
            Py_SETREF(index, Py_NewRef(req));
    }
    long row = -1;
    if (index != NULL && PyLong_Check(index)) {
        row = PyLong_AsLong(index);
        if (row == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            Py_DECREF(index);
            return DIVERT;
        }
        int healthy = release_is_healthy(obj, row);
        if (healthy != 1) {
            if (healthy < 0)
                PyErr_Clear();
            Py_DECREF(index);
            return DIVERT;
        }
        release_done(row);
    }
    else
        Py_CLEAR(index);
    unsigned long gen = H.generation;
    PyObject *result = call_pushed(self, obj, args, nargsf, kwnames);
    if (result != NULL && gen == H.generation && H.active) {
        if (maybe_test_failure(self) < 0 || rows_freed(&index, index != NULL ? 1 : 0) < 0) {
            if (report_failure(self->name, "fail") < 0)
                Py_CLEAR(result);
        }
    }
    Py_XDECREF(index);
    return result;
}

/* --- ReqToTokenPool.free_rows(indices) --- */
static PyObject *
fast_req_free_rows(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *obj = args[0];
    if (H.requests == NULL || H.sg_state == NULL)
        return DIVERT;
    PyObject *indices = arg_at(args, nargs, kwnames, self->indices_pos, self->indices_name);
    if (indices == NULL || !(PyList_CheckExact(indices) || PyTuple_CheckExact(indices)))
        return DIVERT; /* a tensor of rows, or nothing: the Python role */
    PyObject *seq = PySequence_Fast(indices, "rows"); /* a new reference to the same list or tuple */
    if (seq == NULL) {
        PyErr_Clear();
        return DIVERT;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        long row = PyLong_CheckExact(items[i]) ? PyLong_AsLong(items[i]) : -1;
        if (!PyLong_CheckExact(items[i]) || (row == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            Py_DECREF(seq);
            return DIVERT;
        }
        int healthy = release_is_healthy(obj, row);
        if (healthy != 1) {
            if (healthy < 0)
                PyErr_Clear();
            Py_DECREF(seq);
            return DIVERT;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++)
        release_done(PyLong_AsLong(items[i]));
    unsigned long gen = H.generation;
    PyObject *result = call_pushed(self, obj, args, nargsf, kwnames);
    if (result != NULL && gen == H.generation && H.active) {
        if (maybe_test_failure(self) < 0 || rows_freed(items, n) < 0) {
            if (report_failure(self->name, "fail") < 0)
                Py_CLEAR(result);
        }
    }
    Py_DECREF(seq);
    return result;
}

/* --- the generic path: `wrap_method`'s wrapper, step for step --- */
static PyObject *
generic(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *obj = args[0];
    PyObject *probe = Py_NewRef(H.probe);
    PyObject *call_tuple = NULL, *call_kwargs = NULL, *ctx = NULL, *result = NULL;
    int ok = 1, rewritten = 0, fixes_on = 0;
    int site = 0;

    PyObject *targs = PyTuple_New(nargs - 1);
    PyObject *kwargs = PyDict_New();
    if (targs == NULL || kwargs == NULL)
        goto before_failed;
    for (Py_ssize_t i = 1; i < nargs; i++)
        PyTuple_SET_ITEM(targs, i - 1, Py_NewRef(args[i]));
    if (kwnames != NULL) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); i++)
            if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0)
                goto before_failed;
    }
    if (H.inject & self->role_bit) {
        PyErr_Format(PyExc_RuntimeError, "fault injected into the %U hook", self->name);
        goto before_failed;
    }
    if (self->wants_site) {
        site = current_site();
        if (site < 0)
            goto before_failed;
    }
    if (self->prepare != NULL) {
        PyObject *pr = PyObject_CallFunctionObjArgs(self->prepare, targs, kwargs, NULL);
        if (pr == NULL)
            goto before_failed;
        if (!PyTuple_Check(pr) || PyTuple_GET_SIZE(pr) != 2 || !PyTuple_Check(PyTuple_GET_ITEM(pr, 0)) ||
            !PyDict_Check(PyTuple_GET_ITEM(pr, 1))) {
            Py_DECREF(pr);
            PyErr_SetString(PyExc_TypeError, "prepare_args must return (args, kwargs)");
            goto before_failed;
        }
        Py_SETREF(targs, Py_NewRef(PyTuple_GET_ITEM(pr, 0)));
        Py_SETREF(kwargs, Py_NewRef(PyTuple_GET_ITEM(pr, 1)));
        Py_DECREF(pr);
        rewritten = 1; /* a one-shot iterator was turned into a list: the host gets the list */
    }
    {
        PyObject *site_obj = PyLong_FromLong(site);
        if (site_obj == NULL)
            goto before_failed;
        if (self->before != NULL) {
            PyObject *ba[6] = {probe, self->hook, obj, targs, kwargs, site_obj};
            ctx = PyObject_Vectorcall(self->before, ba, 6, NULL);
            Py_DECREF(site_obj);
            if (ctx == NULL)
                goto before_failed;
        }
        else
            ctx = site_obj;
    }
    goto before_done;
before_failed:
    ok = 0;
    if (report_failure(self->name, "fail") < 0)
        goto out;
before_done:
    fixes_on = H.fixes_on;
    if (ok && fixes_on && self->rewrite != NULL) {
        PyObject *ra[6] = {probe, self->hook, obj, targs, kwargs, ctx};
        PyObject *rr = PyObject_Vectorcall(self->rewrite, ra, 6, NULL);
        if (rr != NULL && PyTuple_Check(rr) && PyTuple_GET_SIZE(rr) == 2 && PyTuple_Check(PyTuple_GET_ITEM(rr, 0)) &&
            PyDict_Check(PyTuple_GET_ITEM(rr, 1))) {
            if (PyTuple_GET_ITEM(rr, 0) != targs || PyTuple_GET_ITEM(rr, 1) != kwargs) {
                call_tuple = Py_NewRef(PyTuple_GET_ITEM(rr, 0));
                call_kwargs = Py_NewRef(PyTuple_GET_ITEM(rr, 1));
            }
            Py_DECREF(rr);
        }
        else {
            if (rr != NULL) {
                Py_DECREF(rr);
                PyErr_SetString(PyExc_TypeError, "rewrite must return (args, kwargs)");
            }
            if (report_failure(self->name, "fix_failed") < 0)
                goto out;
        }
    }
    push(obj, self->role_id, self->composite);
    if (call_tuple != NULL || (rewritten && targs != NULL)) {
        PyObject *ct = call_tuple ? call_tuple : targs;
        PyObject *ck = call_kwargs ? call_kwargs : kwargs;
        Py_ssize_t n = PyTuple_GET_SIZE(ct);
        PyObject *full = PyTuple_New(n + 1);
        if (full != NULL) {
            PyTuple_SET_ITEM(full, 0, Py_NewRef(obj));
            for (Py_ssize_t i = 0; i < n; i++)
                PyTuple_SET_ITEM(full, i + 1, Py_NewRef(PyTuple_GET_ITEM(ct, i)));
            result = PyObject_Call(self->original, full, PyDict_GET_SIZE(ck) ? ck : NULL);
            Py_DECREF(full);
        }
    }
    else
        result = call_original(self, args, nargsf, kwnames);
    pop();
    if (ok && self->finally_ != NULL) {
        PyObject *t = NULL, *v = NULL, *tb = NULL;
        if (result == NULL)
            PyErr_Fetch(&t, &v, &tb);
        PyObject *fa[2] = {probe, ctx ? ctx : Py_None};
        PyObject *fr = PyObject_Vectorcall(self->finally_, fa, 2, NULL);
        if (fr == NULL) {
            ok = 0;
            if (report_failure(self->name, "fail") < 0) {
                /* a BaseException from our own code: it wins, as in Python's finally block */
                Py_XDECREF(t);
                Py_XDECREF(v);
                Py_XDECREF(tb);
                Py_CLEAR(result);
                goto out;
            }
        }
        Py_XDECREF(fr);
        if (result == NULL)
            PyErr_Restore(t, v, tb);
    }
    if (result == NULL)
        goto out;
    if (ok && H.active) {
        if (self->after != NULL) {
            PyObject *aa[7] = {probe, self->hook, obj, targs, kwargs, result, ctx ? ctx : Py_None};
            PyObject *ar = PyObject_Vectorcall(self->after, aa, 7, NULL);
            if (ar == NULL) {
                if (report_failure(self->name, "fail") < 0) {
                    Py_CLEAR(result);
                    goto out;
                }
            }
            Py_XDECREF(ar);
        }
        if (fixes_on && self->rewrite_result != NULL) {
            PyObject *xa[3] = {probe, obj, result};
            PyObject *xr = PyObject_Vectorcall(self->rewrite_result, xa, 3, NULL);
            if (xr == NULL) {
                if (report_failure(self->name, "fix_failed") < 0) {
                    Py_CLEAR(result);
                    goto out;
                }
            }
            else
                Py_SETREF(result, xr);
        }
    }
out:
    Py_XDECREF(targs);
    Py_XDECREF(kwargs);
    Py_XDECREF(ctx);
    Py_XDECREF(call_tuple);
    Py_XDECREF(call_kwargs);
    Py_DECREF(probe);
    return result;
}

/* A function's argument by keyword, else by position (no object first): borrowed, NULL if absent. */
static PyObject *
fn_arg(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, Py_ssize_t pos, PyObject *name)
{
    if (pos < 0 && name == NULL)
        return NULL;
    if (kwnames != NULL && name != NULL) {
        Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t i = 0; i < nk; i++) {
            PyObject *k = PyTuple_GET_ITEM(kwnames, i);
            if (k == name || PyUnicode_Compare(k, name) == 0)
                return args[nargs + i];
        }
    }
    return pos >= 0 && pos < nargs ? args[pos] : NULL;
}

/* get_last_loc's result remembered with the rows it read (SglangState.remember_last_loc_source,
 * here without a Python call): keyed by the result's id, the oldest dropped past sources_max. */
static int
remember_last_loc(Hooked *self, PyObject *result, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *sources = H.last_loc_sources;
    if (sources == NULL || !PyDict_CheckExact(sources))
        return 0;
    PyObject *table = fn_arg(args, nargs, kwnames, self->table_pos, self->table_name);
    PyObject *rows = fn_arg(args, nargs, kwnames, self->rows_pos, self->rows_name);
    PyObject *prefix = fn_arg(args, nargs, kwnames, self->prefix_pos, self->prefix_name);
    PyObject *entry = PyTuple_Pack(4, result, rows ? rows : Py_None, table ? table : Py_None, prefix ? prefix : Py_None);
    if (entry == NULL)
        return -1;
    PyObject *key = PyLong_FromVoidPtr(result);
    if (key == NULL) {
        Py_DECREF(entry);
        return -1;
    }
    Py_INCREF(sources); /* a reset() from inside the dict's own callbacks must not free it under us */
    int rc = PyDict_SetItem(sources, key, entry);
    Py_DECREF(key);
    Py_DECREF(entry);
    if (rc == 0 && PyDict_GET_SIZE(sources) > self->sources_max) {
        Py_ssize_t pos = 0;
        PyObject *first, *value;
        if (PyDict_Next(sources, &pos, &first, &value)) {
            Py_INCREF(first);
            rc = PyDict_DelItem(sources, first);
            Py_DECREF(first);
        }
    }
    Py_DECREF(sources);
    return rc;
}

/* A hooked module-level function: the host's call, then the role's `after` on its result. */
static PyObject *
function_call(Hooked *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PyObject *result = call_original(self, args, nargsf, kwnames);
    if (result == NULL || H.probe == NULL || !H.active || (H.ledgers_off & self->ledger_mask))
        return result;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    int rc; /* not counted in calls(): the Python path counts hooked methods only */
    if (self->kind == K_LAST_LOC) {
        rc = maybe_test_failure(self);
        if (rc == 0)
            rc = remember_last_loc(self, result, args, nargs, kwnames);
        H.n_fast[K_LAST_LOC]++;
    }
    else if (self->after != NULL) {
        PyObject *targs = PyTuple_New(nargs);
        PyObject *kwargs = PyDict_New();
        rc = -1;
        if (targs != NULL && kwargs != NULL) {
            rc = 0;
            for (Py_ssize_t i = 0; i < nargs; i++)
                PyTuple_SET_ITEM(targs, i, Py_NewRef(args[i]));
            Py_ssize_t nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
            for (Py_ssize_t i = 0; i < nk && rc == 0; i++)
                rc = PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]);
            if (rc == 0) {
                PyObject *probe = Py_NewRef(H.probe);
                PyObject *aa[7] = {probe, self->hook, Py_None, targs, kwargs, result, Py_None};
                PyObject *r = PyObject_Vectorcall(self->after, aa, 7, NULL);
                Py_DECREF(probe);
                rc = r == NULL ? -1 : 0;
                Py_XDECREF(r);
            }
        }
        Py_XDECREF(targs);
        Py_XDECREF(kwargs);
    }
    else
        rc = 0;
    if (rc < 0 && report_failure(self->name, "fail") < 0) {
        Py_DECREF(result);
        return NULL;
    }
    return result;
}

static PyObject *
hooked_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Hooked *self = (Hooked *)callable;
    if (self->function)
        return function_call(self, args, nargsf, kwnames);
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 1 || H.probe == NULL || !H.active || (H.ledgers_off & self->ledger_mask))
        return call_original(self, args, nargsf, kwnames);
    PyObject *obj = args[0];
    if (blocked(obj, self->role_id, self->composite))
        return call_original(self, args, nargsf, kwnames);
    H.calls++;
    if (self->kind > K_GENERIC && !H.fixes_on && !(H.inject & self->role_bit)) {
        PyObject *r;
#ifdef KVD_TIMING
        struct timespec ta, tb; clock_gettime(CLOCK_MONOTONIC, &ta);
#endif
        switch (self->kind) {
        case K_NOTE:
            H.n_fast[K_NOTE]++;
            return call_pushed(self, obj, args, nargsf, kwnames);
        case K_ALLOC:
            r = fast_alloc(self, args, nargsf, nargs, kwnames);
            break;
        case K_FREE:
            r = fast_free(self, args, nargsf, nargs, kwnames);
            break;
        case K_TREE_INSERT:
            r = fast_tree_insert(self, args, nargsf, nargs, kwnames);
            break;
        case K_TREE_EVICT:
            r = fast_tree_evict(self, args, nargsf, nargs, kwnames);
            break;
        case K_TREE_UNLOCK:
            r = fast_tree_unlock(self, args, nargsf, nargs, kwnames);
            break;
        case K_REQ_WRITE:
            r = fast_req_write(self, args, nargsf, nargs, kwnames);
            break;
        case K_REQ_ALLOC:
            r = fast_req_alloc(self, args, nargsf, nargs, kwnames);
            break;
        case K_REQ_FREE:
            r = fast_req_free(self, args, nargsf, nargs, kwnames);
            break;
        case K_REQ_FREE_ROWS:
            r = fast_req_free_rows(self, args, nargsf, nargs, kwnames);
            break;
        default:
            r = DIVERT;
        }
#ifdef KVD_TIMING
        clock_gettime(CLOCK_MONOTONIC, &tb);
        T_all[self->kind] += (tb.tv_sec - ta.tv_sec) * 1e9 + (tb.tv_nsec - ta.tv_nsec);
        if (getenv("KVD_TIMING_DUMP") && H.calls % 20000 == 0) { for (int k = 0; k < K_COUNT; k++) fprintf(stderr, "kind %d all %.0f orig %.0f over %.0f us\n", k, T_all[k]/1e3, T_orig[k]/1e3, (T_all[k]-T_orig[k])/1e3); }
#endif
        if (r != DIVERT) {
            H.n_fast[self->kind]++;
            return r;
        }
        H.n_diverted[self->kind]++;
    }
    return generic(self, args, nargsf, nargs, kwnames);
}

/* ------------------------------------------------------------------ the type's plumbing */

static int
hooked_init(Hooked *self, PyObject *a, PyObject *kw)
{
    static char *names[] = {"original", "role", "hook", "name", "role_id", "ledger_mask", "role_bit", "composite",
                            "wants_site", "kind", "before", "after", "rewrite", "finally_", "prepare",
                            "rewrite_result", "last_loc_pos", "last_loc_name", "only_page_starts", "as_pages",
                            "group_attr", "group_open_when_false", "value_pos", "value_in_params", "node_pos",
                            "indices_pos", "values_pos", "value_name", "node_name", "indices_name", "values_name",
                            "req_pos", "reqs_pos", "req_name", "reqs_name", "req_index_path", "function", "table_pos",
                            "rows_pos", "prefix_pos", "table_name", "rows_name", "prefix_name", "sources_max", NULL};
    PyObject *original, *role, *hook, *name, *before = Py_None, *after = Py_None, *rewrite = Py_None,
                                                  *finally_ = Py_None, *prepare = Py_None, *rewrite_result = Py_None,
                                                  *last_loc_name = Py_None, *group_attr = Py_None, *value_name = Py_None,
                                                  *node_name = Py_None, *indices_name = Py_None, *values_name = Py_None,
                                                  *req_name = Py_None, *reqs_name = Py_None, *req_index_path = Py_None,
                                                  *table_name = Py_None, *rows_name = Py_None, *prefix_name = Py_None;
    int function = 0;
    Py_ssize_t table_pos = -1, rows_pos = -1, prefix_pos = -1, sources_max = 64;
    int role_id, composite = 0, wants_site = 0, kind = K_GENERIC, only_page_starts = 0, as_pages = 0,
                 group_open_when_false = 0, value_in_params = 0;
    unsigned int ledger_mask = 0;
    unsigned long long role_bit = 0;
    Py_ssize_t last_loc_pos = -1, value_pos = -1, node_pos = -1, indices_pos = -1, values_pos = -1, req_pos = -1,
               reqs_pos = -1;
    if (!PyArg_ParseTupleAndKeywords(a, kw, "OOOUiIK|ppiOOOOOOnOppOpnpnnnOOOOnnOOOpnnnOOOn", names, &original, &role, &hook, &name,
                                     &role_id, &ledger_mask, &role_bit, &composite, &wants_site, &kind, &before,
                                     &after, &rewrite, &finally_, &prepare, &rewrite_result, &last_loc_pos,
                                     &last_loc_name, &only_page_starts, &as_pages, &group_attr,
                                     &group_open_when_false, &value_pos, &value_in_params, &node_pos, &indices_pos,
                                     &values_pos, &value_name, &node_name, &indices_name, &values_name, &req_pos,
                                     &reqs_pos, &req_name, &reqs_name, &req_index_path, &function, &table_pos,
                                     &rows_pos, &prefix_pos, &table_name, &rows_name, &prefix_name, &sources_max))
        return -1;
    if (kind < 0 || kind >= K_COUNT) {
        PyErr_SetString(PyExc_ValueError, "unknown fast-path kind");
        return -1;
    }
    if (req_index_path != Py_None && !PyTuple_CheckExact(req_index_path)) {
        PyErr_SetString(PyExc_TypeError, "req_index_path must be a tuple of attribute names");
        return -1;
    }
#define SET(field, value) Py_XSETREF(self->field, (value) == Py_None ? NULL : Py_NewRef(value))
    Py_XSETREF(self->original, Py_NewRef(original));
    Py_XSETREF(self->role, Py_NewRef(role));
    Py_XSETREF(self->hook, Py_NewRef(hook));
    Py_XSETREF(self->name, Py_NewRef(name));
    SET(before, before);
    SET(after, after);
    SET(rewrite, rewrite);
    SET(finally_, finally_);
    SET(prepare, prepare);
    SET(rewrite_result, rewrite_result);
    SET(last_loc_name, last_loc_name);
    SET(group_attr, group_attr);
    SET(value_name, value_name);
    SET(node_name, node_name);
    SET(indices_name, indices_name);
    SET(values_name, values_name);
    SET(req_name, req_name);
    SET(reqs_name, reqs_name);
    SET(req_index_path, req_index_path);
    SET(table_name, table_name);
    SET(rows_name, rows_name);
    SET(prefix_name, prefix_name);
#undef SET
    self->function = function;
    self->table_pos = table_pos;
    self->rows_pos = rows_pos;
    self->prefix_pos = prefix_pos;
    self->sources_max = sources_max;
    self->req_pos = req_pos;
    self->reqs_pos = reqs_pos;
    self->role_id = role_id;
    self->ledger_mask = ledger_mask;
    self->role_bit = role_bit;
    self->composite = composite;
    self->wants_site = wants_site;
    self->kind = kind;
    self->last_loc_pos = last_loc_pos;
    self->only_page_starts = only_page_starts;
    self->as_pages = as_pages;
    self->group_open_when_false = group_open_when_false;
    self->value_pos = value_pos;
    self->value_in_params = value_in_params;
    self->node_pos = node_pos;
    self->indices_pos = indices_pos;
    self->values_pos = values_pos;
    self->vectorcall = hooked_vectorcall;
    return 0;
}

static PyObject *
hooked_new(PyTypeObject *type, PyObject *a, PyObject *kw)
{
    Hooked *self = (Hooked *)type->tp_alloc(type, 0);
    if (self != NULL)
        self->vectorcall = hooked_vectorcall;
    return (PyObject *)self;
}

static int
hooked_traverse(Hooked *self, visitproc visit, void *arg)
{
    Py_VISIT(self->dict);
    Py_VISIT(self->original);
    Py_VISIT(self->role);
    Py_VISIT(self->hook);
    Py_VISIT(self->before);
    Py_VISIT(self->after);
    Py_VISIT(self->rewrite);
    Py_VISIT(self->finally_);
    Py_VISIT(self->prepare);
    Py_VISIT(self->rewrite_result);
    return 0;
}

static int
hooked_clear(Hooked *self)
{
    Py_CLEAR(self->dict);
    Py_CLEAR(self->original);
    Py_CLEAR(self->role);
    Py_CLEAR(self->hook);
    Py_CLEAR(self->name);
    Py_CLEAR(self->before);
    Py_CLEAR(self->after);
    Py_CLEAR(self->rewrite);
    Py_CLEAR(self->finally_);
    Py_CLEAR(self->prepare);
    Py_CLEAR(self->rewrite_result);
    Py_CLEAR(self->last_loc_name);
    Py_CLEAR(self->group_attr);
    Py_CLEAR(self->value_name);
    Py_CLEAR(self->node_name);
    Py_CLEAR(self->indices_name);
    Py_CLEAR(self->values_name);
    Py_CLEAR(self->req_name);
    Py_CLEAR(self->reqs_name);
    Py_CLEAR(self->req_index_path);
    Py_CLEAR(self->table_name);
    Py_CLEAR(self->rows_name);
    Py_CLEAR(self->prefix_name);
    return 0;
}

static void
hooked_dealloc(Hooked *self)
{
    PyObject_GC_UnTrack(self);
    hooked_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
hooked_descr_get(PyObject *self, PyObject *obj, PyObject *type)
{
    if (obj == NULL || obj == Py_None)
        return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static PyObject *
hooked_repr(Hooked *self)
{
    return PyUnicode_FromFormat("<kvdoctor hook %U of %R>", self->name ? self->name : Py_None,
                                self->original ? self->original : Py_None);
}

static PyMemberDef hooked_members[] = {
    {"__dictoffset__", T_PYSSIZET, offsetof(Hooked, dict), READONLY, NULL},
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(Hooked, vectorcall), READONLY, NULL},
    {"kind", T_INT, offsetof(Hooked, kind), READONLY, "the fast path this hook takes (0: generic)"},
    {NULL}};

static PyGetSetDef hooked_getset[] = {{"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
                                      {NULL}};

static PyTypeObject HookedType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvdoctor.probe._hotpath.Hooked",
    .tp_basicsize = sizeof(Hooked),
    .tp_dealloc = (destructor)hooked_dealloc,
    .tp_vectorcall_offset = offsetof(Hooked, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_repr = (reprfunc)hooked_repr,
    .tp_getattro = PyObject_GenericGetAttr,
    .tp_setattro = PyObject_GenericSetAttr,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_doc = "A hooked engine method: the probe's wrapper, with compiled fast paths for the slot ledger.",
    .tp_traverse = (traverseproc)hooked_traverse,
    .tp_clear = (inquiry)hooked_clear,
    .tp_members = hooked_members,
    .tp_getset = hooked_getset,
    .tp_descr_get = hooked_descr_get,
    .tp_dictoffset = offsetof(Hooked, dict),
    .tp_init = (initproc)hooked_init,
    .tp_new = hooked_new,
};

/* ------------------------------------------------------------------ module functions */

static PyObject *
m_configure(PyObject *m, PyObject *a, PyObject *kw)
{
    static char *names[] = {"probe", "active", "ledgers_off", "fixes_on", "inject", "site_at", NULL};
    PyObject *probe, *site_at = Py_None;
    int active, fixes_on;
    unsigned int ledgers_off;
    unsigned long long inject;
    if (!PyArg_ParseTupleAndKeywords(a, kw, "OpIpK|O", names, &probe, &active, &ledgers_off, &fixes_on, &inject,
                                     &site_at))
        return NULL;
    Py_XSETREF(H.probe, probe == Py_None ? NULL : Py_NewRef(probe));
    if (site_at != Py_None)
        Py_XSETREF(H.site_at, Py_NewRef(site_at));
    H.active = active && H.probe != NULL;
    H.ledgers_off = ledgers_off;
    H.fixes_on = fixes_on;
    H.inject = inject;
    Py_RETURN_NONE;
}

/* Both readers on one tensor: whether they agree (a result, or both declining). */
static int
readers_agree(PyObject *t)
{
    Ints a, b;
    ints_clear(&a);
    ints_clear(&b);
    int ra = read_ints_dlpack(t, &a);
    if (ra < 0) {
        PyErr_Clear();
        ints_clear(&b);
        return !DIRECT.on || read_ints_direct(t, &b) == -2; /* declined: read_ints asks the getters */
    }
    if (DIRECT.on) {
        int rd = read_ints_direct(t, &b);
        if (rd != -2 && !(ra == 1 && rd == 1 && same_ints(&a, &b))) /* -2: it asks DLPack */
            return 0;
        ints_clear(&b);
    }
    int rb = read_ints_getters(t, &b);
    if (rb < 0) {
        PyErr_Clear();
        return 0;
    }
    if (ra != rb)
        return 0;
    if (ra == 0)
        return 1;
    return a.n == b.n && a.itemsize == b.itemsize && a.data == b.data && a.one == b.one;
}

/* torch's DLPack reader, if its table is one this file knows and it reads every sample as the
 * getters do; NULL otherwise (the getters then read every tensor). */
static DLTensorFromPy
dlpack_reader(PyObject *tensor_type, PyObject *samples)
{
    PyObject *capsule = PyObject_GetAttrString(tensor_type, "__dlpack_c_exchange_api__");
    if (capsule == NULL) {
        PyErr_Clear();
        return NULL;
    }
    DlExchangeAPI *api = PyCapsule_IsValid(capsule, "dlpack_exchange_api")
                             ? (DlExchangeAPI *)PyCapsule_GetPointer(capsule, "dlpack_exchange_api")
                             : NULL;
    Py_DECREF(capsule);
    if (api == NULL || api->header.version.major != 1 || api->dltensor_from_py_object_no_sync == NULL) {
        PyErr_Clear();
        return NULL;
    }
    DLTensorFromPy saved = H.dl_read;
    H.dl_read = api->dltensor_from_py_object_no_sync;
    int agree = samples != NULL && PyList_Check(samples) && PyList_GET_SIZE(samples) > 0;
    for (Py_ssize_t i = 0; agree && i < PyList_GET_SIZE(samples); i++) {
        PyObject *t = PyList_GET_ITEM(samples, i);
        agree = Py_TYPE(t) == (PyTypeObject *)tensor_type && readers_agree(t);
    }
    H.dl_read = saved;
    return agree ? api->dltensor_from_py_object_no_sync : NULL;
}

static PyObject *
m_readers_agree(PyObject *m, PyObject *t)
{
    if (H.dl_read == NULL || H.tensor_type == NULL || Py_TYPE(t) != (PyTypeObject *)H.tensor_type) {
        PyErr_SetString(PyExc_ValueError, "the DLPack reader is not in use, or not a tensor");
        return NULL;
    }
    return PyBool_FromLong(readers_agree(t));
}

/* Tests: the learned layout misreads from now on (int64 taken for int32 and back: the same bytes,
 * in bounds, the wrong element size), as a torch we misunderstood would; the next compared read
 * must turn the in-place reader off. */
static PyObject *
m_direct_misread(PyObject *m, PyObject *unused)
{
    uint16_t i64 = DIRECT.dtype_i64;
    DIRECT.dtype_i64 = DIRECT.dtype_i32;
    DIRECT.dtype_i32 = i64;
    Py_RETURN_NONE;
}

static PyObject *
m_read_in_place(PyObject *m, PyObject *t)
{
    Ints v;
    ints_clear(&v);
    int tensor = H.tensor_type != NULL && Py_TYPE(t) == (PyTypeObject *)H.tensor_type;
    return PyBool_FromLong(DIRECT.on && tensor && read_ints_direct(t, &v) == 1);
}

static PyObject *
m_set_torch(PyObject *m, PyObject *a)
{
    PyObject *t, *i64, *i32, *samples = NULL;
    int use_dlpack = 1, use_direct = 1;
    if (!PyArg_ParseTuple(a, "OOO|Opp", &t, &i64, &i32, &samples, &use_dlpack, &use_direct))
        return NULL;
    if (!PyType_Check(t)) {
        PyErr_SetString(PyExc_TypeError, "tensor type expected");
        return NULL;
    }
    Py_XSETREF(H.tensor_type, Py_NewRef(t));
    Py_XSETREF(H.dtype_int64, Py_NewRef(i64));
    Py_XSETREF(H.dtype_int32, Py_NewRef(i32));
    H.dl_read = use_dlpack ? dlpack_reader(t, samples) : NULL;
    DIRECT.on = 0;
    if (H.dl_read != NULL && use_direct && samples != NULL && PyList_Check(samples) && learn_direct(samples) < 0)
        return NULL;
    return PyBool_FromLong(H.dl_read != NULL);
}

static void
ledger_release(Ledger *l)
{
    PyBuffer_Release(&l->b_state);
    PyBuffer_Release(&l->b_owner);
    PyBuffer_Release(&l->b_site);
    Py_CLEAR(l->allocator);
    Py_CLEAR(l->ledger);
    Py_CLEAR(l->lock);
    Py_CLEAR(l->group_attr);
}

static int
get_array(PyObject *arr, Py_buffer *buf, Py_ssize_t itemsize, const char *what, Py_ssize_t n)
{
    if (PyObject_GetBuffer(arr, buf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (buf->itemsize != itemsize || buf->len != n * itemsize) {
        PyBuffer_Release(buf);
        PyErr_Format(PyExc_ValueError, "ledger array %s has the wrong shape or type", what);
        return -1;
    }
    return 0;
}

static PyObject *
m_register_ledger(PyObject *m, PyObject *a, PyObject *kw)
{
    static char *names[] = {"allocator", "ledger", "state", "owner", "alloc_site", "rows", "page_size",
                            "num_pages", "sink", "lock", "group_attr", "group_open_when_false", NULL};
    PyObject *allocator, *ledger, *state, *owner, *site, *lock, *group_attr = Py_None;
    long rows, page_size, num_pages, sink;
    int group_open_when_false = 0;
    if (!PyArg_ParseTupleAndKeywords(a, kw, "OOOOOllllO|Op", names, &allocator, &ledger, &state, &owner, &site,
                                     &rows, &page_size, &num_pages, &sink, &lock, &group_attr,
                                     &group_open_when_false))
        return NULL;
    if (ledger_of(allocator) != NULL)
        Py_RETURN_FALSE;
    if (H.n_ledgers >= MAX_LEDGERS || page_size < 1 || num_pages < 1 || sink != num_pages + 1 ||
        rows != (num_pages + 1) * page_size)
        Py_RETURN_FALSE; /* not a ledger shape we know: it stays on the Python path */
    Ledger *l = &H.ledgers[H.n_ledgers];
    memset(l, 0, sizeof(*l));
    Py_ssize_t n = num_pages + 2;
    if (get_array(state, &l->b_state, 1, "state", n) < 0)
        return NULL;
    if (get_array(owner, &l->b_owner, 4, "owner", n) < 0) {
        PyBuffer_Release(&l->b_state);
        return NULL;
    }
    if (get_array(site, &l->b_site, 4, "alloc_site", n) < 0) {
        PyBuffer_Release(&l->b_state);
        PyBuffer_Release(&l->b_owner);
        return NULL;
    }
    l->state = l->b_state.buf;
    l->owner = l->b_owner.buf;
    l->alloc_site = l->b_site.buf;
    l->n = n;
    l->rows = rows;
    l->page_size = page_size;
    l->page_shift = -1;
    for (int b = 0; b < 62; b++)
        if ((1L << b) == page_size)
            l->page_shift = b;
    l->num_pages = num_pages;
    l->sink = sink;
    l->allocator = Py_NewRef(allocator);
    l->ledger = Py_NewRef(ledger);
    l->lock = Py_NewRef(lock);
    l->group_attr = group_attr == Py_None ? NULL : Py_NewRef(group_attr);
    l->group_open_when_false = group_open_when_false;
    H.n_ledgers++;
    Py_RETURN_TRUE;
}

static PyObject *
m_sglang_context(PyObject *m, PyObject *a)
{
    PyObject *state, *sources, *requests;
    if (!PyArg_ParseTuple(a, "OO!O", &state, &PyDict_Type, &sources, &requests))
        return NULL;
    Py_XSETREF(H.sg_state, Py_NewRef(state));
    Py_XSETREF(H.requests, Py_NewRef(requests));
    Py_XSETREF(H.last_loc_sources, Py_NewRef(sources));
    Py_CLEAR(H.tree_seen);
    Py_RETURN_NONE;
}

static PyObject *
m_set_primary(PyObject *m, PyObject *allocator)
{
    H.primary = ledger_of(allocator);
    return PyBool_FromLong(H.primary != NULL);
}

static PyObject *
m_set_row_extent(PyObject *m, PyObject *arr)
{
    if (H.extent != NULL) {
        PyBuffer_Release(&H.b_extent);
        H.extent = NULL;
        H.extent_n = 0;
    }
    if (arr == Py_None)
        Py_RETURN_NONE;
    if (PyObject_GetBuffer(arr, &H.b_extent, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (H.b_extent.itemsize != 8) {
        PyBuffer_Release(&H.b_extent);
        PyErr_SetString(PyExc_ValueError, "row extents must be int64");
        return NULL;
    }
    H.extent = H.b_extent.buf;
    H.extent_n = H.b_extent.len / 8;
    Py_RETURN_NONE;
}

static PyObject *
m_set_divert(PyObject *m, PyObject *flag)
{
    int v = PyObject_IsTrue(flag);
    if (v < 0)
        return NULL;
    H.divert = v;
    Py_RETURN_NONE;
}

static PyObject *
m_reset(PyObject *m, PyObject *unused)
{
    for (int i = 0; i < H.n_ledgers; i++)
        ledger_release(&H.ledgers[i]);
    H.n_ledgers = 0;
    H.primary = NULL;
    if (H.extent != NULL) {
        PyBuffer_Release(&H.b_extent);
        H.extent = NULL;
        H.extent_n = 0;
    }
    Py_CLEAR(H.sg_state);
    Py_CLEAR(H.requests);
    Py_CLEAR(H.last_loc_sources);
    Py_CLEAR(H.tree_seen);
    Py_CLEAR(H.site_at);
    Py_CLEAR(H.probe);
    H.active = 0;
    H.divert = 0;
    H.fail_after_kind = -1;
    H.generation++;
    sites_clear();
    Py_RETURN_NONE;
}

static PyObject *
m_calls(PyObject *m, PyObject *unused)
{
    return PyLong_FromUnsignedLongLong(H.calls);
}

static PyObject *
m_evicting(PyObject *m, PyObject *unused)
{
    return PyLong_FromLong(tls.evicting);
}

static PyObject *
m_evict_add(PyObject *m, PyObject *delta)
{
    long d = PyLong_AsLong(delta);
    if (d == -1 && PyErr_Occurred())
        return NULL;
    tls.evicting += (int)d;
    Py_RETURN_NONE;
}

static PyObject *
m_direct_check_every(PyObject *m, PyObject *every)
{
    long n = PyLong_AsLong(every);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    DIRECT.check_every = n >= 1 ? (unsigned long)n : DIRECT_CHECK_EVERY;
    DIRECT.until_check = DIRECT.check_every;
    Py_RETURN_NONE;
}

static PyObject *
m_fail_after(PyObject *m, PyObject *kind)
{
    long k = PyLong_AsLong(kind);
    if (k == -1 && PyErr_Occurred())
        return NULL;
    H.fail_after_kind = (int)k;
    Py_RETURN_NONE;
}

static PyObject *
m_stats(PyObject *m, PyObject *unused)
{
    PyObject *fast = PyList_New(K_COUNT), *diverted = PyList_New(K_COUNT), *slow = PyList_New(K_COUNT);
    if (fast == NULL || diverted == NULL || slow == NULL) {
        Py_XDECREF(fast);
        Py_XDECREF(diverted);
        Py_XDECREF(slow);
        return NULL;
    }
    for (int k = 0; k < K_COUNT; k++) {
        PyList_SET_ITEM(fast, k, PyLong_FromUnsignedLongLong(H.n_fast[k]));
        PyList_SET_ITEM(diverted, k, PyLong_FromUnsignedLongLong(H.n_diverted[k]));
        PyList_SET_ITEM(slow, k, PyLong_FromUnsignedLongLong(H.n_slow[k]));
    }
#ifdef KVD_DIRECT_FRAMES
    int direct = direct_frames;
#else
    int direct = 0;
#endif
    return Py_BuildValue("{s:n,s:n,s:i,s:i,s:N,s:N,s:N,s:O,s:O,s:O,s:k,s:k,s:k}", "site_keys", H.sites_len,
                         "site_slots", H.sites_cap, "ledgers", H.n_ledgers, "depth", tls.depth, "fast", fast,
                         "diverted", diverted, "slow", slow, "direct_frames", direct ? Py_True : Py_False,
                         "dlpack_reader", H.dl_read != NULL ? Py_True : Py_False, "direct_reader",
                         DIRECT.on ? Py_True : Py_False, "direct_reads", DIRECT.reads, "direct_checked",
                         DIRECT.checked, "direct_mismatches", DIRECT.mismatches);
}

static PyMethodDef module_methods[] = {
    {"configure", (PyCFunction)(void (*)(void))m_configure, METH_VARARGS | METH_KEYWORDS,
     "The probe's switches: which probe, on or off, ledgers off (bit mask), fixes on, roles with a fault injected."},
    {"set_torch", m_set_torch, METH_VARARGS,
     "torch.Tensor, torch.int64 and torch.int32: what index tensors are; sample tensors on which torch's DLPack "
     "reader must agree with its getters before it is used (False: not used); use_dlpack=False keeps the getters."},
    {"readers_agree", m_readers_agree, METH_O, "Tests: whether the readers (in place, DLPack, getters) read a tensor alike."},
    {"register_ledger", (PyCFunction)(void (*)(void))m_register_ledger, METH_VARARGS | METH_KEYWORDS,
     "A host slot ledger the fast paths may update (its numpy arrays, shape, lock)."},
    {"sglang_context", m_sglang_context, METH_VARARGS, "The SGLang state and its last_loc sources."},
    {"set_primary", m_set_primary, METH_O, "The allocator whose slots request rows point at."},
    {"set_row_extent", m_set_row_extent, METH_O, "How far each request row was written (int64 array)."},
    {"set_divert", m_set_divert, METH_O, "True: a census is due; allocations take the Python path."},
    {"reset", m_reset, METH_NOARGS, "Forget every ledger, the state and the call-site keys."},
    {"calls", m_calls, METH_NOARGS, "Hooked calls dispatched here since the process started."},
    {"evicting", m_evicting, METH_NOARGS, "Tree evictions in progress on this thread."},
    {"evict_add", m_evict_add, METH_O, "Adds to this thread's evictions in progress."},
    {"direct_misread", m_direct_misread, METH_NOARGS, "Tests: the in-place reader swaps the index dtypes."},
    {"read_in_place", m_read_in_place, METH_O, "Tests: whether this tensor is read from torch's own fields."},
    {"direct_check_every", m_direct_check_every, METH_O,
     "Tests: compare every n-th direct tensor read with DLPack's (0: the default, 1024)."},
    {"fail_after", m_fail_after, METH_O, "Tests: a fast path of this kind fails after the host's call (-1: none)."},
    {"stats", m_stats, METH_NOARGS, "Sizes of what this module holds."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_hotpath",
                                        "The probe's compiled hot path (see the C source's header).", -1,
                                        module_methods};

#define INTERN(var, text)                                  \
    do {                                                   \
        var = PyUnicode_InternFromString(text);            \
        if (var == NULL)                                   \
            return NULL;                                   \
    } while (0)

PyMODINIT_FUNC
PyInit__hotpath(void)
{
    INTERN(S_numel, "numel");
    INTERN(S_item, "item");
    INTERN(S_is_cpu, "is_cpu");
    INTERN(S_dtype, "dtype");
    INTERN(S_is_contiguous, "is_contiguous");
    INTERN(S_data_ptr, "data_ptr");
    INTERN(S_fail, "fail");
    INTERN(S_acquire, "acquire");
    INTERN(S_release, "release");
    INTERN(S_on_alloc, "on_alloc");
    INTERN(S_on_free, "on_free");
    INTERN(S_on_tree_insert, "on_tree_insert");
    INTERN(S_evictable_size, "evictable_size");
    INTERN(S_protected_size, "protected_size");
    INTERN(S_value, "value");
    INTERN(S_prefix_len, "prefix_len");
    INTERN(S_tree, "tree");
    INTERN(S_kv_allocator, "token_to_kv_pool_allocator");
    INTERN(S_lock_ref, "lock_ref");
    INTERN(S_root_node, "root_node");
    INTERN(S_only_page_starts, "only_page_starts");
    INTERN(S_evicting, "evicting");
    INTERN(S_as_pages, "as_pages");
    INTERN(S_tree_attr, "tree");
    INTERN(S_dim, "dim");
    INTERN(S_note_row_write, "note_row_write");
    INTERN(S_on_owner, "on_owner");
    INTERN(S_census_if_due, "census_if_due");
    INTERN(S_allocated, "allocated");
    INTERN(S_freed, "freed");
    INTERN(S_request_rows_freed, "request_rows_freed");
    INTERN(S_rid, "rid");
    INTERN(S_req_to_token, "req_to_token");
    INTERN(S_unknown_rid, "?");
    H.fail_after_kind = -1;
    if (PyType_Ready(&HookedType) < 0 || PyType_Ready(&FastLockType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Hooked", (PyObject *)&HookedType) < 0 ||
        PyModule_AddObjectRef(m, "FastLock", (PyObject *)&FastLockType) < 0 ||
        PyModule_AddIntConstant(m, "FREE", ST_FREE) < 0 || PyModule_AddIntConstant(m, "OWNED", ST_OWNED) < 0 ||
        PyModule_AddIntConstant(m, "TREE", ST_TREE) < 0 || PyModule_AddIntConstant(m, "RESERVED", ST_RESERVED) < 0 ||
        PyModule_AddIntConstant(m, "K_GENERIC", K_GENERIC) < 0 || PyModule_AddIntConstant(m, "K_NOTE", K_NOTE) < 0 ||
        PyModule_AddIntConstant(m, "K_ALLOC", K_ALLOC) < 0 || PyModule_AddIntConstant(m, "K_FREE", K_FREE) < 0 ||
        PyModule_AddIntConstant(m, "K_TREE_INSERT", K_TREE_INSERT) < 0 ||
        PyModule_AddIntConstant(m, "K_TREE_EVICT", K_TREE_EVICT) < 0 ||
        PyModule_AddIntConstant(m, "K_TREE_UNLOCK", K_TREE_UNLOCK) < 0 ||
        PyModule_AddIntConstant(m, "K_REQ_WRITE", K_REQ_WRITE) < 0 ||
        PyModule_AddIntConstant(m, "K_REQ_ALLOC", K_REQ_ALLOC) < 0 ||
        PyModule_AddIntConstant(m, "K_REQ_FREE", K_REQ_FREE) < 0 ||
        PyModule_AddIntConstant(m, "K_REQ_FREE_ROWS", K_REQ_FREE_ROWS) < 0 ||
        PyModule_AddIntConstant(m, "K_LAST_LOC", K_LAST_LOC) < 0 ||
        PyModule_AddIntConstant(m, "MAX_SITE_KEYS", MAX_SITE_KEYS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
