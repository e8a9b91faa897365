/* What the native path's units share: the process state (H), a thread's hooked calls in
 * progress, the integer view of an index tensor (Ints), a host ledger (Ledger), a hooked method
 * (Hooked), and the calls every fast path makes into the host.
 *
 * The units know no engine. A fast path is a ledger operation (alloc, free, tree-in, tree-out,
 * tree unlock, owner write, last-loc check and source, request row alloc and free); every name it
 * reads on the host's objects (Hooked's *_attr fields) and every call it makes into the engine's
 * Python state (NativeState's context) is handed over from Python when a method is wrapped or the
 * context is set: the roles declare them (`fast_names`), the maps version them.
 *
 * One concern a unit (module.c says what the extension does, and why):
 *   lock.c          FastLock, the ledger's lock
 *   tensors.c       index tensors read without a copy: torch's own fields at places learned at
 *                   start, torch's DLPack C table, torch's getters
 *   callsites.c     the call site of a hooked call (the only unit built with Py_BUILD_CORE)
 *   ledger.c        the slot ledger's rules: when an update is healthy, and the update itself
 *   slot_ops.c      alloc and free (with the last-loc check of a paged alloc)
 *   tree_ops.c      tree-in, tree-out, tree unlock
 *   row_ops.c       owner write, request row alloc and free, the last-loc source
 *   context.c       the engine's state as the fast paths call it, and the module's setters for it
 *   generic.c       the generic path (hooks.wrap_method's wrapper in C), hooked module functions,
 *                   and where the native path's own failures go
 *   launch.c        the GPU ledger's compiled Triton kernels launched through the CUDA driver
 *   module.c        the Hooked type, the fast path of each kind, the module's functions
 *
 * Everything here is hidden from other libraries (setup.py builds with -fvisibility=hidden): the
 * one exported symbol is PyInit__native. The GIL guards all of it.
 */
#ifndef KVDOCTOR_NATIVE_H
#define KVDOCTOR_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#ifdef Py_GIL_DISABLED
#error "the native path's state is guarded by the GIL"
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

/* The ledger's vocabulary (kvdoctor/probe/base/vocabulary.py; the loader checks they agree). */
#define ST_FREE 1
#define ST_OWNED 2
#define ST_TREE 4
#define ST_RESERVED 8
/* Never seen outside one checked call (C only, the GIL and the ledger's lock held): a page this
 * call already named, so a page named twice in one call is caught (ledger.c). */
#define ST_SEEN 16

/* The ledger operation a hooked method is (the Python side's KINDS names them by role). */
enum {
    K_GENERIC = 0, /* dispatch only: the Python role does the rest */
    K_NOTE,        /* changes no slot: call through */
    K_ALLOC,       /* slots handed out: the result holds them (a paged alloc checks its last-loc first) */
    K_FREE,        /* slots (or pages) given back: the first argument holds them */
    K_TREE_IN,     /* slots moved into the tree: the part past the matched prefix of the inserted value */
    K_TREE_OUT,    /* slots leaving the tree: frees inside it leave the tree bit alone */
    K_TREE_UNLOCK, /* a tree node's lock count lowered: one already at 0 goes to the role */
    K_OWNER_WRITE, /* a request row's table written: the slots written belong to the row */
    K_ROW_ALLOC,   /* request rows handed to requests */
    K_ROW_FREE,    /* one request row given back */
    K_ROWS_FREE,   /* request rows given back as a list */
    K_LAST_LOC,    /* a module function computing last-loc: its result remembered with what it read */
    K_COUNT
};

#define MAX_ARGS 3           /* arguments an operation reads */
#define MAX_ATTRS 6          /* attributes and methods it reads on the host's objects */
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
 * (composite roles) any composite role on that object is: a free that frees through another, which frees through a
 * third, is recorded once, by the outermost. */
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
    /* its flight recorder (kvdoctor/probe/ledgers/history.py says the layout): NULL hist when off */
    Py_buffer b_hist, b_head, b_clock;
    int32_t *hist;
    uint8_t *head;
    int64_t *clock;
    long hist_n; /* entries a page: a power of two */
} Ledger;

/* ------------------------------------------------------------------ the flight recorder */

/* Operation codes (history.py's OP_*, schema.HISTORY_OPS). */
enum {
    OP_NONE,
    OP_ALLOC,
    OP_FREE,
    OP_EVICT,
    OP_OWNER,
    OP_TREE
};
#define REC_WORDS 5
#define REC_CLOCK_LEN 16

/* One call's stamp, taken at its first recorded page: the op and thread, its sequence number and
 * time. Returned by value, so the recorder below never has its address taken. */
typedef struct {
    int32_t word0, seq, ms;
} Stamp;

Stamp stamp_take(Ledger *l, int op); /* ledger.c: the sequence number, the thread and the time */

/* One call's recording: the ring's pointers copied out of the ledger once, so that the byte stores
 * of a page's state and ring head (which may alias anything) do not make every page read them
 * again, and the call's stamp (0 seq: not taken yet). */
typedef struct {
    Ledger *l;
    int32_t *hist;
    uint8_t *head;
    long mask, stride;
    int op, site;
    Stamp stamp;
} Recorder;

static inline Recorder
recorder_for(Ledger *l, int op, int site)
{
    Recorder r = {l, l->hist, l->head, l->hist_n - 1, l->hist_n * REC_WORDS, op, site, {0, 0, 0}};
    return r;
}

/* A page's transition in its ring, once a call: a call may name a page twice (pages of more than
 * one slot, a free list holding a page twice after a double free), and the Python ledger records
 * it once (`record_pages`). */
static inline void
record(Recorder *r, int64_t page, int32_t row)
{
    if (r->hist == NULL)
        return;
    uint8_t h = r->head[page];
    int32_t *ring = r->hist + page * r->stride;
    if (r->stamp.seq == 0)
        r->stamp = stamp_take(r->l, r->op);
    else if (ring[((h - 1) & r->mask) * REC_WORDS + 3] == r->stamp.seq)
        return;
    int32_t *e = ring + (h & r->mask) * REC_WORDS;
    e[0] = r->stamp.word0;
    e[1] = r->site;
    e[2] = row;
    e[3] = r->stamp.seq;
    e[4] = r->stamp.ms;
    r->head[page] = (uint8_t)(h + 1);
}

Ledger *ledger_of(PyObject *allocator);
/* Each update below checks its rule first and writes only where every element passes: 1 written,
 * 0 not healthy (nothing written: the Python ledger method records it), -1 an error (set). */
int ledger_alloc(Ledger *l, const Ints *v, int only_page_starts, int site);
int ledger_free(Ledger *l, const Ints *v, int as_pages, int evicting, int site);
int ledger_tree_insert(Ledger *l, const Ints *v, Py_ssize_t start, Py_ssize_t stop, int site);
int ledger_owner(Ledger *l, const Ints *v, int32_t row);
int last_loc_is_healthy(const Ledger *l, const Ints *last, const Ints *req);
/* Whether table[first:first+upto] names a page still owned by `row` (a release that would leak). */
int row_still_owns(const Ledger *l, const Ints *table, Py_ssize_t first, Py_ssize_t upto, long row);
int ledger_slow(Ledger *l, PyObject *method, PyObject *const *args, size_t nargs, PyObject *kwnames);
void ledgers_release(void);
PyObject *m_register_ledger(PyObject *m, PyObject *a, PyObject *kw);
PyObject *m_apply_op(PyObject *m, PyObject *a);

/* ------------------------------------------------------------------ call sites (callsites.c) */

/* The interned call site of the current call, as CallSites.at(sys._getframe(1)) gives it from the
 * Python wrapper; -1 with an error set. */
int current_site(void);
void sites_clear(void);
void call_site_stats(Py_ssize_t *keys, Py_ssize_t *slots, int *direct_frames);

/* ------------------------------------------------------------------ the process state */

/* What the fast paths call on the engine's state and its request table, by operation: set_context
 * is given the name each has there (context.c reads them from its `names` dict by these keys). */
enum {
    C_CENSUS,        /* state: census(), the idle census a release asked for, before an alloc */
    C_TREE_SEEN,     /* state: the attribute naming the tree the fast paths look at */
    C_ROW_WRITTEN,   /* state: row_written(pool, row, columns, values), a write whose slots C does not read */
    C_ROWS_RELEASED, /* state: rows_released(), after request rows were given back */
    C_ROW_ALLOCATED, /* table: row_allocated(row, id) */
    C_ROW_FREED,     /* table: row_freed(row) */
    C_ROWS_LIVE,     /* table: its dict of live rows (row -> id) */
    C_ROWS_FINISHED, /* table: its dict of finished rows, oldest first */
    C_ROWS_KEPT,     /* table: how many finished rows it keeps */
    C_ROWS_HOLDERS,  /* table: its dict of live rows' holders (row -> weak reference to the request) */
    C_ROWS_OWNERS,   /* table: its dict of rows' last owners (row -> list of (stamp, id), oldest first) */
    C_ROWS_OWNERS_KEPT, /* table: how many owners a row keeps */
    C_ROWS_CLOCK,    /* table: the recorders' clock (int64[16], history.py) whose [0] stamps an owner, or None */
    C_NAMES
};

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

    /* The engine's state as the fast paths call it (context.c): the state, its request table and
     * its last-loc sources, and the names of what they call there (C_* below); NULL: no context. */
    PyObject *state, *requests, *sources;
    PyObject *names[C_NAMES];
    PyObject *rows_live, *rows_finished, *rows_holders; /* the table's dicts, changed here as its methods change them */
    Py_ssize_t rows_kept; /* finished rows it remembers */
    PyObject *rows_owners; /* the table's dict of rows' last owners; NULL: it keeps none */
    Py_ssize_t rows_owners_kept;
    Py_buffer b_rows_clock;
    int64_t *rows_clock; /* [0]: the recorders' last sequence number */
    PyObject *tree_seen; /* strong: the tree the state was last told about */
    int divert; /* a census is pending: allocations take the Python path */
    Ledger ledgers[MAX_LEDGERS];
    int n_ledgers;
    Ledger *primary;
    struct DeviceLedger *primary_device; /* the same, where the first allocator's ledger is a GPU one */
    Py_buffer b_extent;
    int64_t *extent;
    Py_ssize_t extent_n;

    PyObject *tensor_type, *dtype_int64, *dtype_int32;
} NativeState;

extern NativeState H; /* one per process */

/* The names of torch's, the ledgers' and Triton's own methods, interned once (module.c). Nothing
 * of an engine's: those come from Python (NativeState.names, Hooked.attr). */
#define NATIVE_NAMES(X)                       \
    X(numel, "numel")                         \
    X(is_cpu, "is_cpu")                       \
    X(dtype, "dtype")                         \
    X(is_contiguous, "is_contiguous")         \
    X(data_ptr, "data_ptr")                   \
    X(dim, "dim")                             \
    X(acquire, "acquire")                     \
    X(release, "release")                     \
    X(on_alloc, "on_alloc")                   \
    X(on_free, "on_free")                     \
    X(on_tree_insert, "on_tree_insert")       \
    X(on_owner, "on_owner")                   \
    X(on_last_loc_alloc, "on_last_loc_alloc") \
    X(check_last_loc, "check_last_loc")       \
    X(only_page_starts, "only_page_starts")   \
    X(evicting, "evicting")                   \
    X(as_pages, "as_pages")                   \
    X(launch_enter_hook, "launch_enter_hook") \
    X(launch_exit_hook, "launch_exit_hook")   \
    X(hook_calls, "calls")                    \
    X(unknown_id, "?")

#define NATIVE_DECLARE_NAME(var, text) extern PyObject *S_##var;
NATIVE_NAMES(NATIVE_DECLARE_NAME)
#undef NATIVE_DECLARE_NAME

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
    int only_page_starts;
    int as_pages;
    PyObject *group_attr; /* NULL: no free groups */
    int group_open_when_false;
    /* What the operation reads, as its role declared it (`fast_names`, placed by the Python side's
     * READS): its arguments by position (-1: by keyword only) and by keyword (NULL: none), and the
     * attributes and methods it reads on the host's objects (NULL: none), in the slots below. */
    Py_ssize_t arg_pos[MAX_ARGS];
    PyObject *arg_name[MAX_ARGS];
    PyObject *attr[MAX_ATTRS];
    PyObject *index_path; /* row free: the attributes from the request to its row, a tuple */
    int function; /* a module-level function: no object first, `after` on the result only */
    Py_ssize_t sources_max; /* last-loc sources remembered */
} Hooked;

/* The argument slots (Hooked.arg_*) of each operation. */
#define A_LOC 0 /* alloc: the last-loc it checks */
#define A_CARRIER 0 /* tree-in: the inserted value, or what carries it (T_SLOTS) */
#define A_NODE 0 /* tree unlock: the node */
#define A_ROWS 0 /* owner write: (rows, columns); rows free: the rows */
#define A_SLOTS 1 /* owner write: the slots written */
#define A_REQUESTS 0 /* row alloc: the requests */
#define A_REQUEST 0 /* row free: the request, or its row */
#define A_TABLE 0 /* last-loc source: the table it read, the rows, their prefix lengths */
#define A_SOURCE_ROWS 1
#define A_PREFIX 2
/* The attribute slots (Hooked.attr). */
#define T_OWNER 0 /* tree-in, tree-out: the tree's allocator */
#define T_SIZE 1 /* tree-in: the tree's size is the sum of these two methods' results */
#define T_SIZE_ALSO 2
#define T_SLOTS 3 /* tree-in: the slots on the carrier (NULL: the carrier is the slots) */
#define T_PREFIX 4 /* tree-in: the matched prefix's length on the result (else the result is it) */
#define T_ASIDE 5 /* tree-in: a tree where this attribute is set (not None) goes to the Python role */
#define T_COUNT 0 /* tree unlock: the node's lock count, and the tree's root */
#define T_ROOT 1
#define T_ID 0 /* row alloc: the request's id */
#define T_TABLE 0 /* row free(s): the pool's table of rows */

/* An argument by keyword, else by position (args[0] is the object): borrowed, NULL if absent. */
static inline PyObject *
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

static inline PyObject *
hook_arg(Hooked *self, int slot, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    return arg_at(args, nargs, kwnames, self->arg_pos[slot], self->arg_name[slot]);
}

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

/* ------------------------------------------------------------------ the fast paths, by operation */

/* slot_ops.c */
PyObject *fast_alloc(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames);
PyObject *fast_free(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames);
/* tree_ops.c */
PyObject *fast_tree_in(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames);
PyObject *fast_tree_out(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames);
PyObject *fast_tree_unlock(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames);
/* row_ops.c */
PyObject *fast_owner_write(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames);
PyObject *fast_row_alloc(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames);
PyObject *fast_row_free(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames);
PyObject *fast_rows_free(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames);
/* A last-loc source function's result remembered with what it read (the K_LAST_LOC function path). */
int remember_source(Hooked *self, PyObject *result, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);

/* context.c: the engine's state, called by operation (each 0 done, -1 an error set) */
int context_census(void);
int context_note_tree(PyObject *tree);
int context_row_written(PyObject *const *pool_row_columns_values);
int context_rows_released(void);
int context_row_allocated(PyObject *row, PyObject *id, PyObject *holder);
int context_row_freed(PyObject *row);
/* The rows a last-loc was read from, where its source function's hook remembered them (`*rows`
 * borrowed, NULL for none): 1, or 0 where the lookup failed (the Python role takes the call). */
int context_source_rows(PyObject *last, PyObject **rows);
void context_forget(void);
PyObject *m_set_context(PyObject *m, PyObject *a, PyObject *kw);
PyObject *m_set_primary(PyObject *m, PyObject *allocator);
PyObject *m_set_row_extent(PyObject *m, PyObject *arr);
PyObject *m_set_divert(PyObject *m, PyObject *flag);

/* launch.c: a compiled Triton kernel launched through the CUDA driver (the ledgers' launch.py),
 * and the GPU slot ledgers whose healthy update is one such launch from the fast paths. */
PyObject *m_launch_kernel(PyObject *m, PyObject *const *args, Py_ssize_t nargs);

#define DEVICE_MAX_PARAMS 32
/* Which kernel a call takes: its rule (alloc, or free with as_pages/evicting), then the index
 * tensor's width and alignment, as ledgers/kernels.py's device_rule keys them. */
#define DEVICE_RULE_ALLOC(page_starts) ((page_starts) ? 1 : 0)
#define DEVICE_RULE_FREE(as_pages, evicting) (4 | ((as_pages) ? 2 : 0) | ((evicting) ? 1 : 0))
/* The owner kernel's plans (owner writes) come after the 32 alloc and free ones: 4 for a
 * row given as one integer (the slots' width and alignment), 16 for rows given as a tensor (the
 * slots', then the rows' width and alignment), as ledgers/kernels.py's owner_slot keys them. */
#define DEVICE_ROWS_SLOT(base, tensor, slots_bits, rows_bits) \
    ((base) + ((tensor) ? 4 + ((slots_bits) << 2 | (rows_bits)) : (slots_bits)))
#define DEVICE_OWNER_SLOT(tensor, slots_bits, rows_bits) DEVICE_ROWS_SLOT(32, tensor, slots_bits, rows_bits)
/* The last-loc check's (a paged alloc's): the same 20, for the last-loc and the rows it was read for. */
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
    int at_last, at_last_count; /* the fused last-loc check's: where the last-loc and its count go; else -1 */
} DevicePlan;

typedef struct DeviceLedger {
    PyObject *allocator; /* strong: the key, compared by identity */
    PyObject *ledger; /* the Python SlotLedger (its kernels' Python path, evidence) */
    PyObject *lock;
    PyObject *stream_of, *device_arg; /* stream_of(device_arg): the current stream's raw handle */
    PyObject *hooks; /* Triton's runtime knobs (launch hooks), or NULL */
    int device_type, device_id; /* DLPack's: the index tensors this ledger takes */
    long page_size, block_max; /* block_max: more indices take two kernels (the Python path) */
    int off; /* a launch was refused: the Python path from now on */
    DevicePlan plans[DEVICE_PLAN_SLOTS];
} DeviceLedger;

DeviceLedger *device_ledger_of(PyObject *allocator);
/* The healthy case of a hooked call on a device ledger: its rule's kernel launched on the current
 * stream. 1 launched, 0 not taken here (the Python ledger method takes it), -1 an error (set). */
int device_update(DeviceLedger *d, int rule, PyObject *index, int site);
/* An owner write's update: `values` the slots written, `rows` the rows' tensor or NULL
 * for one row `row`. Both are read before the host's call (`device_owner_reads`: 1 they are the
 * ledger's kind, 0 not, the Python role takes the call); `device_owner` after it, with the same
 * answers as device_update. A paged alloc's last-loc check reads the last-loc and the rows it was read
 * for the same way (rows of another length are dropped, as the Python check drops them), and
 * `device_last_loc` launches its check before the host's call. */
typedef struct {
    const void *slots, *rows;
    Py_ssize_t n;
    int slots_bits, rows_bits; /* width (8 bytes: 2) | 16-byte alignment (1) */
} OwnerCall;
int device_owner_reads(DeviceLedger *d, PyObject *values, PyObject *rows, OwnerCall *call);
int device_owner(DeviceLedger *d, const OwnerCall *call, long row);
int device_last_loc_reads(DeviceLedger *d, PyObject *last, PyObject *rows, OwnerCall *call);
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
