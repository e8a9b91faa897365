/* The slot ledger's rules, on the numpy arrays the Python `SlotLedger` owns (state byte, owner row
 * and allocation site per page), read and written through their buffers.
 *
 * The rules are those of kvdoctor/probe/ledgers/slots.py: each update below checks first that every
 * element is healthy (a free page handed out, a held page freed, ...) and writes only then;
 * anything else is left to the Python ledger method (ledger_slow), which records the violation and
 * its evidence exactly as without this extension.
 */
#include "native.h"

#include <time.h>

/* The stamp of a call's first recorded page: the ledger's next sequence number, this thread's index
 * in the ledger's table of threads (history.py's `_find_thread` twin) and the coarse clock's time
 * since the ledger started, in ms. */
Stamp
stamp_take(Ledger *l, int op)
{
    Stamp s;
    int64_t *clock = l->clock;
    uint32_t seq = (uint32_t)clock[0] + 1;
    if (seq == 0)
        seq = 1;
    clock[0] = seq;
    s.seq = (int32_t)seq;
    struct timespec ts;
#ifdef CLOCK_MONOTONIC_COARSE
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
#else
    clock_gettime(CLOCK_MONOTONIC, &ts);
#endif
    int64_t now = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
    s.ms = (int32_t)(((now - clock[1]) / 1000000) & 0x7FFFFFFF);
    int64_t ident = (int64_t)PyThread_get_thread_ident();
    int index = REC_CLOCK_LEN - 1;
    for (int i = 2; i < REC_CLOCK_LEN; i++) {
        if (clock[i] == ident) {
            index = i - 1;
            break;
        }
        if (clock[i] == 0) {
            clock[i] = ident;
            index = i - 1;
            break;
        }
    }
    s.word0 = op | (index << 8);
    return s;
}

Ledger *
ledger_of(PyObject *allocator)
{
    for (int i = 0; i < H.n_ledgers; i++)
        if (H.ledgers[i].allocator == allocator)
            return &H.ledgers[i];
    return NULL;
}

int
lock_take(PyObject *lock)
{
    if (Py_TYPE(lock) == &FastLockType)
        return fastlock_take((FastLock *)lock, 1) < 0 ? -1 : 0;
    PyObject *r = call0(lock, S_acquire);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

int
lock_give(PyObject *lock)
{
    if (Py_TYPE(lock) == &FastLockType)
        return fastlock_give((FastLock *)lock);
    PyObject *r = call0(lock, S_release);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static inline int
ledger_enter(Ledger *l)
{
    return lock_enter(l->lock);
}

static inline int
ledger_leave(Ledger *l, int taken)
{
    return lock_leave(l->lock, taken);
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
#define EACH_INT(v, start, stop, x, ...)                       \
    do {                                                       \
        if ((v)->itemsize == 8) {                              \
            const int64_t *each_ = (const int64_t *)(v)->data; \
            for (Py_ssize_t i_ = (start); i_ < (stop); i_++) { \
                const int64_t x = each_[i_];                   \
                __VA_ARGS__                                    \
            }                                                  \
        }                                                      \
        else {                                                 \
            const int32_t *each_ = (const int32_t *)(v)->data; \
            for (Py_ssize_t i_ = (start); i_ < (stop); i_++) { \
                const int64_t x = each_[i_];                   \
                __VA_ARGS__                                    \
            }                                                  \
        }                                                      \
    } while (0)

/* Clears the marks a check left on the pages of its first `stop` entries (all inside the pool). */
static void
unmark(Ledger *l, const Ints *v, Py_ssize_t stop, int as_pages)
{
    const Shape s = shape_of(l);
    int8_t *state = l->state;
    EACH_INT(v, 0, stop, x, { state[as_pages ? x : page_at(&s, x)] &= (int8_t)~ST_SEEN; });
}

/* alloc: every page handed out (page starts only, with `only_page_starts`) must be free, and named
 * once. The check marks each page it passes (ST_SEEN); its apply overwrites the mark. */
static int
alloc_is_healthy(Ledger *l, const Ints *v, int only_page_starts)
{
    const Shape s = shape_of(l);
    int8_t *state = l->state;
    const int8_t mark = (s.page_size == 1 || only_page_starts) ? ST_SEEN : 0;
    Py_ssize_t passed = 0;
    EACH_INT(v, 0, v->n, slot, {
        passed++;
        if (slot < 0 || slot >= s.rows)
            goto unhealthy;
        if (only_page_starts && !starts_page(&s, slot))
            continue;
        int64_t page = page_at(&s, slot);
        if (!in_body(&s, page) || state[page] != ST_FREE)
            goto unhealthy; /* a page marked here is not ST_FREE: named twice */
        state[page] |= mark;
    });
    return 1;
unhealthy:
    if (mark)
        unmark(l, v, passed - 1, 0);
    return 0;
}

static void
alloc_apply(Ledger *l, const Ints *v, int only_page_starts, int site)
{
    const Shape s = shape_of(l);
    int8_t *state = l->state;
    int32_t *owner = l->owner, *alloc_site = l->alloc_site;
    Recorder rec = recorder_for(l, OP_ALLOC, site);
    EACH_INT(v, 0, v->n, slot, {
        if (only_page_starts && !starts_page(&s, slot))
            continue;
        int64_t page = page_at(&s, slot);
        state[page] = ST_OWNED;
        owner[page] = -1;
        alloc_site[page] = site;
        record(&rec, page, -1);
    });
}

/* free: every page named must be held (not free), inside the pool, and, where each entry is a page
 * of its own (page ids, one-slot pages), named once (a paged free of slots may name a page once a slot). */
static int
free_is_healthy(Ledger *l, const Ints *v, int as_pages)
{
    const Shape s = shape_of(l);
    int8_t *state = l->state;
    const int8_t mark = (as_pages || s.page_size == 1) ? ST_SEEN : 0;
    Py_ssize_t passed = 0;
    EACH_INT(v, 0, v->n, x, {
        int64_t page;
        passed++;
        if (as_pages)
            page = x;
        else {
            if (x < 0 || x >= s.rows)
                goto unhealthy;
            page = page_at(&s, x);
        }
        if (!in_body(&s, page) || (state[page] & (ST_FREE | mark)))
            goto unhealthy;
        state[page] |= mark;
    });
    return 1;
unhealthy:
    if (mark)
        unmark(l, v, passed - 1, as_pages);
    return 0;
}

static void
free_apply(Ledger *l, const Ints *v, int as_pages, int evicting, int site)
{
    const Shape s = shape_of(l);
    int8_t *state = l->state;
    const int32_t *owner = l->owner;
    Recorder rec = recorder_for(l, evicting ? OP_EVICT : OP_FREE, site);
    EACH_INT(v, 0, v->n, x, {
        int64_t page = as_pages ? x : page_at(&s, x);
        state[page] = evicting ? ST_FREE : (int8_t)((state[page] & ST_TREE) | ST_FREE);
        record(&rec, page, owner[page]);
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
tree_insert_apply(Ledger *l, const Ints *v, Py_ssize_t start, Py_ssize_t stop, int site)
{
    const Shape s = shape_of(l);
    int8_t *state = l->state;
    int32_t *owner = l->owner;
    Recorder rec = recorder_for(l, OP_TREE, site);
    EACH_INT(v, start, stop, slot, {
        int64_t page = page_at(&s, slot);
        record(&rec, page, owner[page]);
        state[page] = ST_TREE;
        owner[page] = -1;
    });
}

/* ------------------------------------------------------------------ checked updates */

int
ledger_alloc(Ledger *l, const Ints *v, int only_page_starts, int site)
{
    int taken = ledger_enter(l);
    if (taken < 0)
        return -1;
    int healthy = alloc_is_healthy(l, v, only_page_starts);
    if (healthy)
        alloc_apply(l, v, only_page_starts, site);
    return ledger_leave(l, taken) < 0 ? -1 : healthy;
}

int
ledger_free(Ledger *l, const Ints *v, int as_pages, int evicting, int site)
{
    int taken = ledger_enter(l);
    if (taken < 0)
        return -1;
    int healthy = free_is_healthy(l, v, as_pages);
    if (healthy)
        free_apply(l, v, as_pages, evicting, site);
    return ledger_leave(l, taken) < 0 ? -1 : healthy;
}

int
ledger_tree_insert(Ledger *l, const Ints *v, Py_ssize_t start, Py_ssize_t stop, int site)
{
    int taken = ledger_enter(l);
    if (taken < 0)
        return -1;
    int healthy = tree_insert_is_healthy(l, v, start, stop);
    if (healthy)
        tree_insert_apply(l, v, start, stop, site);
    return ledger_leave(l, taken) < 0 ? -1 : healthy;
}

/* A request row now points at these slots: those handed out (owned) are the row's. Always healthy:
 * slots outside the pool or not owned are left as they are. */
int
ledger_owner(Ledger *l, const Ints *v, int32_t row)
{
    int taken = ledger_enter(l);
    if (taken < 0)
        return -1;
    const Shape shape = shape_of(l);
    const int8_t *state = l->state;
    int32_t *owner = l->owner;
    Recorder rec = recorder_for(l, OP_OWNER, 0);
    EACH_INT(v, 0, v->n, slot, {
        if (slot < 0 || slot >= shape.rows)
            continue;
        int64_t page = page_at(&shape, slot);
        if (state[page] == ST_OWNED && owner[page] != row) {
            record(&rec, page, row);
            owner[page] = row;
        }
    });
    return ledger_leave(l, taken) < 0 ? -1 : 1;
}

int
row_still_owns(const Ledger *l, const Ints *table, Py_ssize_t first, Py_ssize_t upto, long row)
{
    const Shape shape = shape_of(l);
    const int8_t *state = l->state;
    const int32_t *owner = l->owner;
    EACH_INT(table, first, first + upto, slot, {
        if (slot < 0)
            continue;
        int64_t page = page_at(&shape, slot);
        if (in_body(&shape, page) && state[page] == ST_OWNED && owner[page] == row)
            return 1;
    });
    return 0;
}

/* A last-loc must point into a page its request still holds (-1: no prefix). */
int
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

/* The Python ledger method, under the ledger's lock, for what the fast path does not record itself
 * (a violation: its evidence is made there, exactly as without this module). */
/* The Python ledger method, under the ledger's lock, for what the fast path does not record itself
 * (a violation: its evidence is made there, exactly as without this module). */
COLD int
slow_call(PyObject *ledger, PyObject *lock, PyObject *method, PyObject *const *args, size_t nargs, PyObject *kwnames)
{
    if (lock_take(lock) < 0)
        return -1;
    PyObject *m = PyObject_GetAttr(ledger, method);
    PyObject *r = m ? PyObject_Vectorcall(m, args, nargs, kwnames) : NULL;
    Py_XDECREF(m);
    int rc = r ? 0 : -1;
    Py_XDECREF(r);
    if (rc < 0) {
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        if (lock_give(lock) < 0)
            PyErr_Clear();
        PyErr_Restore(t, v, tb);
        return -1;
    }
    return lock_give(lock);
}

int
ledger_slow(Ledger *l, PyObject *method, PyObject *const *args, size_t nargs, PyObject *kwnames)
{
    return slow_call(l->ledger, l->lock, method, args, nargs, kwnames);
}

static void
ledger_release(Ledger *l)
{
    PyBuffer_Release(&l->b_state);
    PyBuffer_Release(&l->b_owner);
    PyBuffer_Release(&l->b_site);
    if (l->hist != NULL) {
        PyBuffer_Release(&l->b_hist);
        PyBuffer_Release(&l->b_head);
        PyBuffer_Release(&l->b_clock);
        l->hist = NULL;
    }
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

/* A host slot ledger the fast paths may update: its arrays, shape and lock (False: a shape not
 * known here, it stays on the Python path). */
PyObject *
m_register_ledger(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"allocator", "ledger",    "state", "owner",  "alloc_site", "rows",
                            "page_size", "num_pages", "sink",  "lock",   "group_attr", "group_open_when_false",
                            "hist",      "head",      "clock", "hist_n", NULL};
    PyObject *allocator, *ledger, *state, *owner, *site, *lock, *group_attr = Py_None;
    PyObject *hist = Py_None, *head = Py_None, *clock = Py_None;
    long rows, page_size, num_pages, sink, hist_n = 0;
    int group_open_when_false = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOllllO|OpOOOl", names, &allocator, &ledger, &state, &owner,
                                     &site, &rows, &page_size, &num_pages, &sink, &lock, &group_attr,
                                     &group_open_when_false, &hist, &head, &clock, &hist_n))
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
    if (hist != Py_None && hist_n > 0 && (hist_n & (hist_n - 1)) == 0 && hist_n <= 64) {
        if (get_array(hist, &l->b_hist, 4, "hist", n * hist_n * REC_WORDS) < 0)
            goto failed;
        if (get_array(head, &l->b_head, 1, "head", n) < 0) {
            PyBuffer_Release(&l->b_hist);
            goto failed;
        }
        if (get_array(clock, &l->b_clock, 8, "clock", REC_CLOCK_LEN) < 0) {
            PyBuffer_Release(&l->b_hist);
            PyBuffer_Release(&l->b_head);
            goto failed;
        }
        l->hist = l->b_hist.buf;
        l->head = l->b_head.buf;
        l->clock = l->b_clock.buf;
        l->hist_n = hist_n;
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
failed:
    PyBuffer_Release(&l->b_state);
    PyBuffer_Release(&l->b_owner);
    PyBuffer_Release(&l->b_site);
    return NULL;
}

/* Every ledger let go of (the probe was deactivated). */
void
ledgers_release(void)
{
    for (int i = 0; i < H.n_ledgers; i++)
        ledger_release(&H.ledgers[i]);
    H.n_ledgers = 0;
    H.primary = NULL;
    device_ledgers_release();
}

/* Tests: one ledger operation on a registered host ledger, as the fast paths apply it (checked,
 * then written only where every element passes), so that one table of cases runs against the C,
 * the numpy ledger and the torch ledger alike (tests/unit/test_ledger_operations.py).
 * apply_op(allocator, op, indices, flag=0, value=0): op is alloc (flag: only page starts; value:
 * the site), free (flag: as pages; value: evicting), tree_in, owner (value: the row) or last_loc
 * (a check: nothing written). True: healthy and written; False: not healthy, nothing written. */
PyObject *
m_apply_op(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *allocator, *index;
    const char *op;
    int flag = 0;
    long value = 0;
    if (!PyArg_ParseTuple(args, "OsO|il", &allocator, &op, &index, &flag, &value))
        return NULL;
    Ledger *l = ledger_of(allocator);
    if (l == NULL) {
        PyErr_SetString(PyExc_KeyError, "apply_op: no host ledger is registered for that allocator");
        return NULL;
    }
    Ints v;
    int rc = read_ints(index, &v);
    if (rc != 1) {
        if (rc == 0)
            PyErr_SetString(PyExc_TypeError, "apply_op: the indices must be a CPU int32 or int64 tensor");
        return NULL;
    }
    if (strcmp(op, "alloc") == 0)
        rc = ledger_alloc(l, &v, flag, (int)value);
    else if (strcmp(op, "free") == 0)
        rc = ledger_free(l, &v, flag, value != 0, 0);
    else if (strcmp(op, "tree_in") == 0)
        rc = ledger_tree_insert(l, &v, 0, v.n, 0);
    else if (strcmp(op, "owner") == 0)
        rc = ledger_owner(l, &v, (int32_t)value);
    else if (strcmp(op, "last_loc") == 0)
        rc = last_loc_is_healthy(l, &v, NULL);
    else {
        PyErr_Format(PyExc_ValueError, "apply_op: no ledger operation %s", op);
        rc = -1;
    }
    ints_clear(&v);
    return rc < 0 ? NULL : PyBool_FromLong(rc);
}
