/* The engine's state as the fast paths call it, by operation, and the module's setters for it.
 *
 * The fast paths know no engine: set_context hands over the engine's state object, its request
 * table and its last-loc sources, with the name each operation has there (the C_* keys), from the
 * engine's package. A fast path calls `context_census()`, never a method it names itself.
 */
#include "native.h"

static const char *const CONTEXT_KEYS[C_NAMES] = {
    [C_CENSUS] = "census",
    [C_TREE_SEEN] = "tree_seen",
    [C_ROW_WRITTEN] = "row_written",
    [C_ROWS_RELEASED] = "rows_released",
    [C_ROW_ALLOCATED] = "row_allocated",
    [C_ROW_FREED] = "row_freed",
    [C_ROWS_LIVE] = "rows_live",
    [C_ROWS_FINISHED] = "rows_finished",
    [C_ROWS_KEPT] = "rows_kept",
    [C_ROWS_HOLDERS] = "rows_holders",
    [C_ROWS_OWNERS] = "rows_owners",
    [C_ROWS_OWNERS_KEPT] = "rows_owners_kept",
    [C_ROWS_CLOCK] = "rows_clock",
};

static void context_clear(void);
static int holder_drop(PyObject *row);

static int
call_state(int what, PyObject *const *args, size_t nargs)
{
    if (H.state == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "no engine context");
        return -1;
    }
    PyObject *a[5] = {H.state};
    for (size_t i = 0; i < nargs && i < 4; i++)
        a[i + 1] = args[i];
    PyObject *r = PyObject_VectorcallMethod(H.names[what], a, nargs + 1, NULL);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

int
context_census(void)
{
    return call_state(C_CENSUS, NULL, 0);
}

/* Tells the state which tree the fast paths look at, once per tree. */
int
context_note_tree(PyObject *tree)
{
    if (H.tree_seen == tree)
        return 0;
    if (H.state == NULL || PyObject_SetAttr(H.state, H.names[C_TREE_SEEN], tree) < 0)
        return -1;
    Py_INCREF(tree);
    Py_XSETREF(H.tree_seen, tree);
    return 0;
}

int
context_row_written(PyObject *const *pool_row_columns_values)
{
    return call_state(C_ROW_WRITTEN, pool_row_columns_values, 4);
}

int
context_rows_released(void)
{
    return call_state(C_ROWS_RELEASED, NULL, 0);
}

/* The row's holder, as the table keeps it: a weak reference to the request (none for an object that
 * takes none, or no request passed). Its creation runs no Python code for a plain Python object. */
static int
holder_set(PyObject *row, PyObject *holder)
{
    PyObject *ref = holder != NULL && holder != Py_None ? PyWeakref_NewRef(holder, NULL) : NULL;
    if (ref == NULL) {
        if (PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError))
                return -1;
            PyErr_Clear(); /* a type without weak references: its row is not judged */
        }
        return holder_drop(row);
    }
    int rc = PyDict_SetItem(H.rows_holders, row, ref);
    Py_DECREF(ref);
    return rc;
}

static int
holder_drop(PyObject *row)
{
    if (PyDict_DelItem(H.rows_holders, row) == 0)
        return 0;
    if (!PyErr_ExceptionMatches(PyExc_KeyError))
        return -1;
    PyErr_Clear();
    return 0;
}

/* The row's new owner appended to its last owners, stamped with the recorders' sequence number
 * (requests.py's `allocated` twin); the oldest dropped past the number kept. */
static int
owner_logged(PyObject *row, PyObject *id)
{
    if (H.rows_owners == NULL)
        return 0;
    PyObject *log = PyDict_GetItemWithError(H.rows_owners, row); /* borrowed */
    if (log == NULL) {
        if (PyErr_Occurred())
            return -1;
        log = PyList_New(0);
        if (log == NULL)
            return -1;
        int rc = PyDict_SetItem(H.rows_owners, row, log);
        Py_DECREF(log); /* the dict holds it */
        if (rc < 0)
            return -1;
    }
    if (!PyList_Check(log))
        return 0;
    PyObject *entry = Py_BuildValue("(kO)", (unsigned long)((uint64_t)H.rows_clock[0] & 0xFFFFFFFFu), id);
    if (entry == NULL)
        return -1;
    int rc = PyList_Append(log, entry);
    Py_DECREF(entry);
    if (rc == 0 && PyList_GET_SIZE(log) > H.rows_owners_kept)
        rc = PyList_SetSlice(log, 0, PyList_GET_SIZE(log) - H.rows_owners_kept, NULL);
    return rc;
}

/* The table's row_allocated and row_freed, done on its three dicts where it has them, else through
 * its methods. Its lock orders its changes against the writer thread's reads; here the GIL is held
 * from the first change to the last and nothing between them runs Python code (the keys are ints,
 * the values strings), which gives those reads the same. */
int
context_row_allocated(PyObject *row, PyObject *id, PyObject *holder)
{
    if (H.rows_live == NULL) {
        PyObject *a[4] = {H.requests, row, id, holder != NULL ? holder : Py_None};
        PyObject *r = PyObject_VectorcallMethod(H.names[C_ROW_ALLOCATED], a, 4, NULL);
        Py_XDECREF(r);
        return r == NULL ? -1 : 0;
    }
    if (PyDict_SetItem(H.rows_live, row, id) < 0)
        return -1;
    int finished = PyDict_Contains(H.rows_finished, row);
    if (finished < 0 || (finished && PyDict_DelItem(H.rows_finished, row) < 0))
        return -1;
    if (holder_set(row, holder) < 0)
        return -1;
    return owner_logged(row, id);
}

int
context_row_freed(PyObject *row)
{
    if (H.rows_live == NULL) {
        PyObject *a[2] = {H.requests, row};
        PyObject *r = PyObject_VectorcallMethod(H.names[C_ROW_FREED], a, 2, NULL);
        Py_XDECREF(r);
        return r == NULL ? -1 : 0;
    }
    PyObject *id = PyDict_GetItemWithError(H.rows_live, row);
    if (id == NULL)
        return PyErr_Occurred() ? -1 : 0;
    if (holder_drop(row) < 0)
        return -1;
    Py_INCREF(id);
    int rc = PyDict_DelItem(H.rows_live, row);
    if (rc == 0)
        rc = PyDict_SetItem(H.rows_finished, row, id);
    Py_DECREF(id);
    if (rc == 0 && PyDict_GET_SIZE(H.rows_finished) > H.rows_kept) { /* forget the oldest */
        Py_ssize_t pos = 0;
        PyObject *oldest, *value;
        if (PyDict_Next(H.rows_finished, &pos, &oldest, &value)) {
            Py_INCREF(oldest);
            rc = PyDict_DelItem(H.rows_finished, oldest);
            Py_DECREF(oldest);
        }
    }
    return rc;
}

int
context_source_rows(PyObject *last, PyObject **rows)
{
    *rows = NULL;
    if (H.sources == NULL)
        return 1;
    PyObject *key = PyLong_FromVoidPtr(last);
    if (key == NULL) {
        PyErr_Clear();
        return 0;
    }
    PyObject *source = PyDict_GetItemWithError(H.sources, key); /* borrowed */
    Py_DECREF(key);
    if (source == NULL && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (source != NULL && PyTuple_Check(source) && PyTuple_GET_SIZE(source) >= 2 &&
        PyTuple_GET_ITEM(source, 0) == last && PyTuple_GET_ITEM(source, 1) != Py_None)
        *rows = PyTuple_GET_ITEM(source, 1);
    return 1;
}

/* The table's owner log and the clock that stamps it, where it keeps one (a clock of 16 int64s and
 * a dict); else no owner is logged here. */
static void
owners_adopted(PyObject *requests)
{
    PyObject *owners = PyObject_GetAttr(requests, H.names[C_ROWS_OWNERS]);
    PyObject *kept = owners == NULL ? NULL : PyObject_GetAttr(requests, H.names[C_ROWS_OWNERS_KEPT]);
    PyObject *clock = kept == NULL ? NULL : PyObject_GetAttr(requests, H.names[C_ROWS_CLOCK]);
    Py_ssize_t n = kept == NULL ? -1 : PyLong_AsSsize_t(kept);
    if (clock != NULL && clock != Py_None && owners != NULL && PyDict_CheckExact(owners) && n > 0 &&
        PyObject_GetBuffer(clock, &H.b_rows_clock, PyBUF_SIMPLE) == 0) {
        if (H.b_rows_clock.len == 16 * (Py_ssize_t)sizeof(int64_t)) {
            H.rows_clock = H.b_rows_clock.buf;
            H.rows_owners = Py_NewRef(owners);
            H.rows_owners_kept = n;
        }
        else {
            PyBuffer_Release(&H.b_rows_clock);
        }
    }
    PyErr_Clear();
    Py_XDECREF(owners);
    Py_XDECREF(kept);
    Py_XDECREF(clock);
}

/* set_context(state, requests, sources, names): `names` maps each operation (CONTEXT_KEYS) to its
 * name on the state or the table. */
PyObject *
m_set_context(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwargs)
{
    static char *kw[] = {"state", "requests", "sources", "names", NULL};
    PyObject *state, *requests, *sources, *names;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO!O!", kw, &state, &requests, &PyDict_Type, &sources,
                                     &PyDict_Type, &names))
        return NULL;
    PyObject *found[C_NAMES];
    for (int i = 0; i < C_NAMES; i++) {
        found[i] = PyDict_GetItemString(names, CONTEXT_KEYS[i]); /* borrowed */
        if (found[i] == NULL || !PyUnicode_CheckExact(found[i])) {
            PyErr_Format(PyExc_TypeError, "set_context: names[%s] must be a str", CONTEXT_KEYS[i]);
            return NULL;
        }
    }
    context_clear();
    for (int i = 0; i < C_NAMES; i++) {
        PyObject *name = Py_NewRef(found[i]);
        PyUnicode_InternInPlace(&name);
        H.names[i] = name;
    }
    H.state = Py_NewRef(state);
    H.requests = Py_NewRef(requests);
    H.sources = Py_NewRef(sources);
    PyObject *live = PyObject_GetAttr(requests, H.names[C_ROWS_LIVE]);
    PyObject *finished = live == NULL ? NULL : PyObject_GetAttr(requests, H.names[C_ROWS_FINISHED]);
    PyObject *holders = finished == NULL ? NULL : PyObject_GetAttr(requests, H.names[C_ROWS_HOLDERS]);
    PyObject *kept = holders == NULL ? NULL : PyObject_GetAttr(requests, H.names[C_ROWS_KEPT]);
    Py_ssize_t rows_kept = kept == NULL ? -1 : PyLong_AsSsize_t(kept);
    if (live != NULL && finished != NULL && holders != NULL && PyDict_CheckExact(live) && PyDict_CheckExact(finished) &&
        PyDict_CheckExact(holders) && rows_kept >= 0) {
        H.rows_live = Py_NewRef(live); /* else its methods are called */
        H.rows_finished = Py_NewRef(finished);
        H.rows_holders = Py_NewRef(holders);
        H.rows_kept = rows_kept;
        owners_adopted(requests);
    }
    PyErr_Clear();
    Py_XDECREF(live);
    Py_XDECREF(finished);
    Py_XDECREF(holders);
    Py_XDECREF(kept);
    Py_RETURN_NONE;
}

PyObject *
m_set_primary(PyObject *Py_UNUSED(module), PyObject *allocator)
{
    H.primary = ledger_of(allocator);
    H.primary_device = H.primary == NULL ? device_ledger_of(allocator) : NULL;
    return PyBool_FromLong(H.primary != NULL || H.primary_device != NULL);
}

PyObject *
m_set_row_extent(PyObject *Py_UNUSED(module), PyObject *arr)
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

PyObject *
m_set_divert(PyObject *Py_UNUSED(module), PyObject *flag)
{
    int v = PyObject_IsTrue(flag);
    if (v < 0)
        return NULL;
    H.divert = v;
    Py_RETURN_NONE;
}

static void
context_clear(void)
{
    Py_CLEAR(H.state);
    Py_CLEAR(H.requests);
    Py_CLEAR(H.rows_live);
    Py_CLEAR(H.rows_finished);
    Py_CLEAR(H.rows_holders);
    if (H.rows_owners != NULL) {
        Py_CLEAR(H.rows_owners);
        PyBuffer_Release(&H.b_rows_clock);
        H.rows_clock = NULL;
    }
    Py_CLEAR(H.sources);
    Py_CLEAR(H.tree_seen);
    for (int i = 0; i < C_NAMES; i++)
        Py_CLEAR(H.names[i]);
}

/* Forgets the engine's state, its request rows and the tree last seen (the probe was deactivated). */
void
context_forget(void)
{
    if (H.extent != NULL) {
        PyBuffer_Release(&H.b_extent);
        H.extent = NULL;
        H.extent_n = 0;
    }
    context_clear();
    H.divert = 0;
}
