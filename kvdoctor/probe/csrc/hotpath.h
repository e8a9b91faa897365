/* What the compiled hot path's units share: the process state (H), a thread's hooked calls in
 * progress, the integer view of an index tensor (Ints), a host ledger (Ledger), a hooked method
 * (Hooked), and the calls every fast path makes into the host.
 *
 * One concern a unit (module.c says what the extension does, and why):
 *   lock.c          FastLock, the ledger's lock
 *   tensors.c       index tensors read without a copy: torch's own fields at places learned at
 *                   start, torch's DLPack C table, torch's getters
 *   callsites.c     the call site of a hooked call (the only unit built with Py_BUILD_CORE)
 *   ledger.c        the slot ledger's rules: when an update is healthy, and the update itself
 *   sglang_paths.c  SGLang's fast paths, kept in step with kvdoctor/probe/sglang/roles.py
 *   generic.c       the generic path (hooks.wrap_method's wrapper in C), hooked module functions,
 *                   and where the hot path's own failures go
 *   launch.c        the GPU ledger's compiled Triton kernels launched through the CUDA driver
 *   module.c        the Hooked type, the fast path of each kind, the module's functions
 *
 * Everything here is hidden from other libraries (setup.py builds with -fvisibility=hidden): the
 * one exported symbol is PyInit__hotpath. The GIL guards all of it.
 */
#ifndef KVDOCTOR_HOTPATH_H
#define KVDOCTOR_HOTPATH_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#ifdef Py_GIL_DISABLED
#error "the hot path's state is guarded by the GIL"
#endif

/* What the units declare here is hidden too (-fvisibility=hidden covers only definitions): the
 * state, the thread's record and the calls between units are then reached directly, as a single
 * unit's statics were, not through the GOT, the PLT or __tls_get_addr's general model. */
#if defined(__GNUC__)
#pragma GCC visibility push(hidden)
#endif

/* Failure and violation paths: out of line, in the cold section, so the healthy path's code stays
 * dense (the host's own code evicts ours from the instruction cache between two hooked calls). */
#if defined(__GNUC__)
#define COLD __attribute__((cold, noinline))
#else
#define COLD
#endif

/* The ledger's vocabulary (kvdoctor/probe/ledger_vocabulary.py; hotpath_loader.py checks they agree). */
#define ST_FREE 1
#define ST_OWNED 2
#define ST_TREE 4
#define ST_RESERVED 8

/* What the fast path knows how to do for a hooked method (hotpath.KINDS names them). */
enum {
    K_GENERIC = 0,   /* dispatch only: the Python role does the rest */
    K_NOTE,          /* changes no slot: call through */
    K_ALLOC,         /* alloc / alloc_extend / alloc_decode */
    K_FREE,          /* free / free_segment / free_pages */
    K_TREE_INSERT,   /* RadixCache.insert */
    K_TREE_EVICT,    /* RadixCache.evict */
    K_TREE_UNLOCK,   /* RadixCache.dec_lock_ref */
    K_REQ_WRITE,     /* ReqToTokenPool.write */
    K_REQ_ALLOC,     /* ReqToTokenPool.alloc(reqs) */
    K_REQ_FREE,      /* ReqToTokenPool.free(req) */
    K_REQ_FREE_ROWS, /* ReqToTokenPool.free_rows(indices) */
    K_LAST_LOC,      /* get_last_loc(req_to_token, req_pool_indices, prefix_lens): a module function */
    K_COUNT
};

#define MAX_DEPTH 32        /* nested hooked calls remembered per thread */
#define MAX_LEDGERS 64      /* allocators with a host ledger (more stay on the Python path) */
#define MAX_SITE_KEYS 65536 /* (caller, caller's caller) keys remembered */

/* ------------------------------------------------------------------ per-thread re-entry */

typedef struct {
    void *obj;
    int role_id;
    int composite;
} Entry;

typedef struct {
    int depth;
    int evicting; /* tree evictions in progress: frees inside one leave the tree bit alone */
    Entry e[MAX_DEPTH];
} ThreadState;

extern _Thread_local ThreadState this_thread;

/* A call that must pass straight through: the same role on the same object is in progress, or
 * (composite roles) any composite role on that object is: free_segment -> free_page_ids -> free
 * is recorded once, by the outermost. */
static inline int
blocked(void *obj, int role_id, int composite)
{
    int depth = this_thread.depth < MAX_DEPTH ? this_thread.depth : MAX_DEPTH;
    for (int i = 0; i < depth; i++) {
        Entry *e = &this_thread.e[i];
        if (e->obj == obj && (e->role_id == role_id || (composite && e->composite)))
            return 1;
    }
    return 0;
}

static inline void
push(void *obj, int role_id, int composite)
{
    if (this_thread.depth < MAX_DEPTH) {
        Entry *e = &this_thread.e[this_thread.depth];
        e->obj = obj;
        e->role_id = role_id;
        e->composite = composite;
    }
    this_thread.depth++;
}

static inline void
pop(void)
{
    if (this_thread.depth > 0)
        this_thread.depth--;
}

/* ------------------------------------------------------------------ index tensors (tensors.c) */

typedef struct {
    Py_ssize_t n;
    const void *data; /* int32 or int64 elements; from read_ints with n == 1, &one (int64) */
    int itemsize;
    int64_t one; /* n == 1 */
} Ints;          /* never copied: `data` may point into it */

static inline int64_t
ints_at(const Ints *v, Py_ssize_t i)
{
    if (v->n == 1)
        return v->one;
    if (v->itemsize == 8)
        return ((const int64_t *)v->data)[i];
    return ((const int32_t *)v->data)[i];
}

/* A CPU integer tensor's values, without a copy: 1 read, 0 not a tensor read here (no error set),
 * -1 an error (set). Only exact torch.Tensor objects on the CPU, int32/int64, contiguous. */
int read_ints(PyObject *t, Ints *out);
/* A device index tensor's address, count and width (no value read: no sync); 1 read, 0 not one
 * this reader takes (another device, dtype or layout, or no DLPack reader), never an error. */
int read_device_ints(PyObject *t, int device_type, int device_id, const void **data, Py_ssize_t *n, int *itemsize);
void ints_clear(Ints *out);

typedef struct {
    int dlpack_reader, direct_reader;
    unsigned long direct_reads, direct_checked, direct_mismatches;
} TensorReaderStats;

TensorReaderStats tensor_reader_stats(void);
PyObject *m_set_torch(PyObject *m, PyObject *a);
PyObject *m_readers_agree(PyObject *m, PyObject *t);
PyObject *m_direct_misread(PyObject *m, PyObject *unused);
PyObject *m_read_in_place(PyObject *m, PyObject *t);
PyObject *m_direct_check_every(PyObject *m, PyObject *every);

/* ------------------------------------------------------------------ the ledger's lock (lock.c) */

typedef struct {
    PyObject_HEAD
    unsigned long owner;
    long count;
    PyObject *weakrefs;
} FastLock;

extern PyTypeObject FastLockType;
int fastlock_take(FastLock *self, int blocking);
int fastlock_give(FastLock *self);

/* A ledger's lock, whichever kind it is (ledger.c): 0 taken, -1 an error. */
int lock_take(PyObject *lock);
int lock_give(PyObject *lock);

/* A fast path's update of a ledger: no Python code, the GIL held throughout. Where the ledger's
 * FastLock is held by nobody, no other thread can take it before this thread lets go of the GIL
 * (taking it needs the GIL), so the update is already exclusive and the lock is left alone. Held
 * by anyone (this thread's Python role, or another thread waiting out a census), it is taken as
 * usual. Returns 1 taken (give it back with lock_leave), 0 not needed, -1 an error. */
static inline int
lock_enter(PyObject *lock)
{
    if (Py_TYPE(lock) == &FastLockType && ((FastLock *)lock)->count == 0)
        return 0;
    return lock_take(lock) < 0 ? -1 : 1;
}

static inline int
lock_leave(PyObject *lock, int taken)
{
    return taken ? lock_give(lock) : 0;
}

/* A Python ledger method called under the ledger's lock (the slow path of every fast path). */
int slow_call(PyObject *ledger, PyObject *lock, PyObject *method, PyObject *const *args, size_t nargs,
              PyObject *kwnames);

/* ------------------------------------------------------------------ host ledgers (ledger.c) */

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
    int page_shift;       /* log2(page_size) when it is a power of two, else -1 */
    PyObject *group_attr; /* its free group (NULL: none): frees staged there are judged at the group's end */
    int group_open_when_false;
} Ledger;

Ledger *ledger_of(PyObject *allocator);
/* Each update below checks its rule first and writes only where every element passes: 1 written,
 * 0 not healthy (nothing written: the Python ledger method records it), -1 an error (set). */
int ledger_alloc(Ledger *l, const Ints *v, int only_page_starts, int site);
int ledger_free(Ledger *l, const Ints *v, int as_pages, int evicting);
int ledger_tree_insert(Ledger *l, const Ints *v, Py_ssize_t start, Py_ssize_t stop);
int ledger_owner(Ledger *l, const Ints *v, int32_t row);
int last_loc_is_healthy(const Ledger *l, const Ints *last, const Ints *req);
/* Whether table[first:first+upto] names a page still owned by `row` (a release that would leak). */
int row_still_owns(const Ledger *l, const Ints *table, Py_ssize_t first, Py_ssize_t upto, long row);
int ledger_slow(Ledger *l, PyObject *method, PyObject *const *args, size_t nargs, PyObject *kwnames);
void ledgers_release(void);
PyObject *m_register_ledger(PyObject *m, PyObject *a, PyObject *kw);

/* ------------------------------------------------------------------ call sites (callsites.c) */

/* The interned call site of the current call, as CallSites.at(sys._getframe(1)) gives it from the
 * Python wrapper; -1 with an error set. */
int current_site(void);
void sites_clear(void);
void call_site_stats(Py_ssize_t *keys, Py_ssize_t *slots, int *direct_frames);

/* ------------------------------------------------------------------ the process state */

typedef struct {
    PyObject *probe; /* strong; NULL: every wrapper passes through */
    int active;      /* probe set and its ledgers on */
    uint32_t ledgers_off;
    int fixes_on;
    uint64_t inject;
    unsigned long long calls;
    int fail_after_kind;      /* tests: raise inside this kind's fast path after the host's call */
    unsigned long generation; /* bumped by reset(): a fast path that straddles it writes nothing */
    /* per kind: calls done here, calls sent to the generic path, calls handed to the Python ledger */
    unsigned long long n_fast[K_COUNT], n_diverted[K_COUNT], n_slow[K_COUNT];

    PyObject *site_at; /* CallSites.at(frame) */

    PyObject *sg_state; /* SglangState */
    PyObject *requests; /* its RequestTable */
    PyObject *req_live, *req_finished; /* its dicts, changed here as its methods change them */
    Py_ssize_t req_max_finished;
    PyObject *last_loc_sources;
    PyObject *tree_seen; /* strong: the tree the state was last told about */
    int divert;          /* a census is pending: allocations take the Python path */
    Ledger ledgers[MAX_LEDGERS];
    int n_ledgers;
    Ledger *primary;
    struct DeviceLedger *primary_device; /* the same, where the first allocator's ledger is a GPU one */
    Py_buffer b_extent;
    int64_t *extent;
    Py_ssize_t extent_n;

    PyObject *tensor_type, *dtype_int64, *dtype_int32;
} HotPathState;

extern HotPathState H; /* one per process */

/* Attribute and method names, interned once (module.c). */
#define HOTPATH_NAMES(X)                          \
    X(numel, "numel")                             \
    X(is_cpu, "is_cpu")                           \
    X(dtype, "dtype")                             \
    X(is_contiguous, "is_contiguous")             \
    X(data_ptr, "data_ptr")                       \
    X(acquire, "acquire")                         \
    X(release, "release")                         \
    X(on_alloc, "on_alloc")                       \
    X(on_free, "on_free")                         \
    X(on_tree_insert, "on_tree_insert")           \
    X(evictable_size, "evictable_size")           \
    X(protected_size, "protected_size")           \
    X(value, "value")                             \
    X(prefix_len, "prefix_len")                   \
    X(kv_allocator, "token_to_kv_pool_allocator") \
    X(lock_ref, "lock_ref")                       \
    X(root_node, "root_node")                     \
    X(only_page_starts, "only_page_starts")       \
    X(evicting, "evicting")                       \
    X(as_pages, "as_pages")                       \
    X(tree_attr, "tree")                          \
    X(dim, "dim")                                 \
    X(note_row_write, "note_row_write")           \
    X(on_owner, "on_owner")                       \
    X(on_last_loc_alloc, "on_last_loc_alloc")     \
    X(check_last_loc, "check_last_loc")           \
    X(census_if_due, "census_if_due")             \
    X(allocated, "allocated")                     \
    X(freed, "freed")                             \
    X(request_rows_freed, "request_rows_freed")   \
    X(rid, "rid")                                 \
    X(req_to_token, "req_to_token")               \
    X(launch_enter_hook, "launch_enter_hook")     \
    X(launch_exit_hook, "launch_exit_hook")       \
    X(hook_calls, "calls")                        \
    X(unknown_rid, "?")

#define HOTPATH_DECLARE_NAME(var, text) extern PyObject *S_##var;
HOTPATH_NAMES(HOTPATH_DECLARE_NAME)
#undef HOTPATH_DECLARE_NAME

/* ------------------------------------------------------------------ the hooked method */

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
    Py_ssize_t value_pos;                                          /* tree insert: where params (or value) is */
    int value_in_params;                                           /* tree insert: value is params.value */
    Py_ssize_t node_pos;                                           /* tree unlock */
    Py_ssize_t indices_pos, values_pos;                            /* req write */
    PyObject *value_name, *node_name, *indices_name, *values_name; /* the same arguments by keyword */
    Py_ssize_t req_pos, reqs_pos;                                  /* request pool: where the request(s) are */
    PyObject *req_name, *reqs_name;
    PyObject *req_index_path; /* tuple of attribute names: the request's row (`kv.req_pool_idx`) */
    int function;             /* a module-level function: no object first, `after` on the result only */
    Py_ssize_t table_pos, rows_pos, prefix_pos; /* get_last_loc's arguments */
    PyObject *table_name, *rows_name, *prefix_name;
    Py_ssize_t sources_max; /* get_last_loc results remembered */
} Hooked;

/* A fast path: the host's result, NULL with an error the host raised, or DIVERT (declined before
 * the host's call: the generic path takes the call). */
typedef PyObject *(*FastPath)(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames);
#define DIVERT ((PyObject *)1)

static inline PyObject *
call0(PyObject *obj, PyObject *name)
{
    return PyObject_CallMethodNoArgs(obj, name);
}

/* The host's call, with the arguments it was given. */
static inline PyObject *
call_original(Hooked *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    return PyObject_Vectorcall(self->original, args, nargsf, kwnames);
}

/* The call through the host's method with this hook's entry pushed (nested hooked calls on the
 * same object see it). */
static inline PyObject *
call_pushed(Hooked *self, PyObject *obj, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    push(obj, self->role_id, self->composite);
    PyObject *r = call_original(self, args, nargsf, kwnames);
    pop();
    return r;
}

/* ------------------------------------------------------------------ failures (generic.c) */

/* The current exception goes to probe.fail(name, exc) (or fix_failed): the probe turns itself off
 * and says why; the host never sees it. 0 handled, -1 to propagate (not an Exception). */
int report_failure(PyObject *name, const char *method);
/* A fast path failed after the host's call returned `result`: reported; the host gets its result. */
PyObject *kept_after_failure(PyObject *name, PyObject *result);
/* Tests: -1 (error set) where this kind's fast path is told to fail after the host's call. */
int maybe_test_failure(Hooked *self);

PyObject *generic(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames);
PyObject *function_call(Hooked *self, PyObject *const *args, size_t nargsf, PyObject *kwnames);

/* ------------------------------------------------------------------ SGLang's fast paths (sglang_paths.c) */

PyObject *fast_alloc(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames);
PyObject *fast_free(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames);
PyObject *fast_tree_insert(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames);
PyObject *fast_tree_evict(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames);
PyObject *fast_tree_unlock(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames);
PyObject *fast_req_write(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames);
PyObject *fast_req_alloc(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames);
PyObject *fast_req_free(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames);
PyObject *fast_req_free_rows(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames);
/* get_last_loc's result remembered with the rows it read (the K_LAST_LOC function path). */
int remember_last_loc(Hooked *self, PyObject *result, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
void sglang_forget(void);
PyObject *m_sglang_context(PyObject *m, PyObject *a);
PyObject *m_set_primary(PyObject *m, PyObject *allocator);
PyObject *m_set_row_extent(PyObject *m, PyObject *arr);
PyObject *m_set_divert(PyObject *m, PyObject *flag);

/* launch.c: a compiled Triton kernel launched through the CUDA driver (kvdoctor/probe/ledger/launch.py),
 * and the GPU slot ledgers whose healthy update is one such launch from the fast paths. */
PyObject *m_launch_kernel(PyObject *m, PyObject *const *args, Py_ssize_t nargs);

#define DEVICE_MAX_PARAMS 32
/* Which kernel a call takes: its rule (alloc, or free with as_pages/evicting), then the index
 * tensor's width and alignment, as ledger/kernels.py's device_rule keys them. */
#define DEVICE_RULE_ALLOC(page_starts) ((page_starts) ? 1 : 0)
#define DEVICE_RULE_FREE(as_pages, evicting) (4 | ((as_pages) ? 2 : 0) | ((evicting) ? 1 : 0))
/* The owner kernel's plans (req_to_token writes) come after the 32 alloc and free ones: 4 for a
 * row given as one integer (the slots' width and alignment), 16 for rows given as a tensor (the
 * slots', then the rows' width and alignment), as ledger/kernels.py's owner_slot keys them. */
#define DEVICE_ROWS_SLOT(base, tensor, slots_bits, rows_bits) \
    ((base) + ((tensor) ? 4 + ((slots_bits) << 2 | (rows_bits)) : (slots_bits)))
#define DEVICE_OWNER_SLOT(tensor, slots_bits, rows_bits) DEVICE_ROWS_SLOT(32, tensor, slots_bits, rows_bits)
/* The last_loc check's (a paged alloc's): the same 20, for last_loc and the rows it was read for. */
#define DEVICE_LAST_LOC_SLOT(tensor, slots_bits, rows_bits) DEVICE_ROWS_SLOT(52, tensor, slots_bits, rows_bits)
/* The check fused with the alloc's update (one launch after the host's call): the check's 20, then
 * the allocated slots' width and alignment. */
#define DEVICE_LAST_LOC_ALLOC_SLOT(tensor, last_bits, rows_bits, slots_bits) \
    (72 + ((DEVICE_ROWS_SLOT(0, tensor, last_bits, rows_bits) << 2) | (slots_bits)))
/* A call of more than a block, alloc or free: the check (its rows are its own indices), then the
 * write, each as many programs as the call needs; by the fused plans' rule, width and alignment. */
#define DEVICE_BLOCKS_CHECK_SLOT(slot) (152 + (slot))
#define DEVICE_BLOCKS_WRITE_SLOT(slot) (184 + (slot))
#define DEVICE_PLAN_SLOTS 216

typedef struct {
    void *function; /* the compiled kernel (a CUfunction); NULL: none yet (the Python path compiles it) */
    unsigned block, shared;
    int n; /* runtime parameters */
    char kinds[DEVICE_MAX_PARAMS];
    uint64_t cells[DEVICE_MAX_PARAMS]; /* the fixed ones; the index, its count and the site per call */
    int at_index, at_count, at_site;
    int at_rows; /* the owner kernel's: where the rows' address goes (at_site then holds the row); else -1 */
    int at_last, at_last_count; /* the fused last_loc check's: where last_loc and its count go; else -1 */
} DevicePlan;

typedef struct DeviceLedger {
    PyObject *allocator; /* strong: the key, compared by identity */
    PyObject *ledger;    /* the Python SlotLedger (its kernels' Python path, evidence) */
    PyObject *lock;
    PyObject *stream_of, *device_arg; /* stream_of(device_arg): the current stream's raw handle */
    PyObject *hooks;                  /* Triton's runtime knobs (launch hooks), or NULL */
    int device_type, device_id;       /* DLPack's: the index tensors this ledger takes */
    long page_size, block_max;        /* block_max: more indices take two kernels (the Python path) */
    int off;                          /* a launch was refused: the Python path from now on */
    DevicePlan plans[DEVICE_PLAN_SLOTS];
} DeviceLedger;

DeviceLedger *device_ledger_of(PyObject *allocator);
/* The healthy case of a hooked call on a device ledger: its rule's kernel launched on the current
 * stream. 1 launched, 0 not taken here (the Python ledger method takes it), -1 an error (set). */
int device_update(DeviceLedger *d, int rule, PyObject *index, int site);
/* A req_to_token write's owner update: `values` the slots written, `rows` the rows' tensor or NULL
 * for one row `row`. Both are read before the host's call (`device_owner_reads`: 1 they are the
 * ledger's kind, 0 not, the Python role takes the call); `device_owner` after it, with the same
 * answers as device_update. A paged alloc's last_loc check reads last_loc and the rows it was read
 * for the same way (rows of another length are dropped, as the Python check drops them), and
 * `device_last_loc` launches its check before the host's call. */
typedef struct {
    const void *slots, *rows;
    Py_ssize_t n;
    int slots_bits, rows_bits; /* width (8 bytes: 2) | 16-byte alignment (1) */
} OwnerCall;
int device_owner_reads(DeviceLedger *d, PyObject *values, PyObject *rows, OwnerCall *call);
int device_owner(DeviceLedger *d, const OwnerCall *call, long row);
int device_last_loc_reads(DeviceLedger *d, PyObject *last_loc, PyObject *rows, OwnerCall *call);
int device_last_loc(DeviceLedger *d, const OwnerCall *call, int site);
/* The check and the alloc's update of `slots` (the host's result) in one launch, after the host's
 * call: 1 launched, 0 not (no plan yet, a call of more than a block; nothing was launched). */
int device_last_loc_alloc(DeviceLedger *d, const OwnerCall *call, PyObject *slots, int site);
void device_ledgers_release(void);
unsigned long long device_launch_count(void);
PyObject *m_register_device_ledger(PyObject *m, PyObject *a, PyObject *kw);
PyObject *m_device_plan(PyObject *m, PyObject *a, PyObject *kw);
PyObject *m_launch_record(PyObject *m, PyObject *list);

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif

#endif
