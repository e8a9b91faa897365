/* Owner write, request row alloc and free, and the last-loc source, in C: the slots a request
 * row's table now points at belong to that row; rows handed to requests and given back (a release
 * that would leave slots owned by the row goes to the role, which names the leak); and a last-loc
 * source function's result remembered with what it read. Which arguments and attributes hold what
 * is the role's (Hooked.arg_*, Hooked.attr); slot_ops.c says how a fast path hands a call back.
 */
#include "native.h"

/* --- owner write ((rows, columns), slots) on a GPU ledger ---
 * The Python role's update, one owner kernel launched from C (launch.c): the slots written now
 * belong to their row, for one row (an integer) or a row per slot (a tensor, a decode step's
 * batched write). How far a row was written is kept for host tables only: a GPU table's releases
 * are left to the rolling census, so nothing else is noted. */
static PyObject *
device_owner_write(Hooked *self, DeviceLedger *d, PyObject *const *args, size_t nargsf, PyObject *kwnames,
                   PyObject *indices, PyObject *values)
{
    PyObject *row = PyTuple_GET_ITEM(indices, 0);
    int tensor_rows = Py_TYPE(row) == (PyTypeObject *)H.tensor_type;
    if (H.extent != NULL || (!tensor_rows && !PyLong_CheckExact(row)))
        return DIVERT; /* a host table's extents (the Python role), or rows of another kind */
    long r = 0;
    if (!tensor_rows) {
        r = PyLong_AsLong(row);
        if (r == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return DIVERT;
        }
    }
    OwnerCall call;
    if (!device_owner_reads(d, values, tensor_rows ? row : NULL, &call))
        return DIVERT;
    Py_INCREF(values);
    Py_INCREF(indices);
    unsigned long gen = H.generation;
    PyObject *result = call_pushed(self, args[0], args, nargsf, kwnames);
    if (result == NULL || gen != H.generation)
        goto done;
    int launched = device_owner(d, &call, r);
    if (launched == 1 && maybe_test_failure(self) < 0)
        launched = -1;
    if (launched == 0) {
        /* no plan yet, a launch hook, a row past 32 bits: the ledger's own method, as the role calls it */
        H.n_slow[K_OWNER_WRITE]++;
        PyObject *b[2] = {values, row};
        launched = slow_call(d->ledger, d->lock, S_on_owner, b, 2, NULL) < 0 ? -1 : 1;
    }
    if (launched < 0)
        result = kept_after_failure(self->name, result);
done:
    Py_DECREF(values);
    Py_DECREF(indices);
    return result;
}

/* --- owner write ((row, columns), slots): the slots written belong to the row --- */
PyObject *
fast_owner_write(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *obj = args[0];
    Ledger *l = H.primary;
    DeviceLedger *d = H.primary_device;
    if ((l == NULL || H.extent == NULL) && d == NULL)
        return DIVERT; /* the Python role sets both up on its first call */
    PyObject *indices = hook_arg(self, A_ROWS, args, nargs, kwnames);
    PyObject *values = hook_arg(self, A_SLOTS, args, nargs, kwnames);
    if (indices == NULL || values == NULL || !PyTuple_CheckExact(indices) || PyTuple_GET_SIZE(indices) != 2 ||
        H.tensor_type == NULL || Py_TYPE(values) != (PyTypeObject *)H.tensor_type)
        return DIVERT;
    if (l == NULL)
        return device_owner_write(self, d, args, nargsf, kwnames, indices, values);
    PyObject *row = PyTuple_GET_ITEM(indices, 0);
    PyObject *columns = PyTuple_GET_ITEM(indices, 1);
    if (!PyLong_CheckExact(row) || !PySlice_Check(columns))
        return DIVERT; /* batched rows or column tensors: the Python role */
    PySliceObject *sl = (PySliceObject *)columns;
    if ((sl->stop != Py_None && !PyLong_CheckExact(sl->stop)) ||
        (sl->start != Py_None && !PyLong_CheckExact(sl->start)))
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
        H.n_slow[K_OWNER_WRITE]++;
        PyObject *a[4] = {obj, row, columns, values};
        if (context_row_written(a) < 0)
            goto failed;
        PyObject *b[2] = {values, row};
        if (ledger_slow(l, S_on_owner, b, 2, NULL) < 0)
            goto failed;
        goto done;
    }
    {
        /* the row written: how far (the state's row extent) */
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
        if (ledger_owner(l, &v, (int32_t)r) < 0)
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

/* --- row alloc (requests): rows handed to requests --- */
PyObject *
fast_row_alloc(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *obj = args[0];
    if (H.requests == NULL)
        return DIVERT;
    PyObject *reqs = hook_arg(self, A_REQUESTS, args, nargs, kwnames);
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
        PyObject *id_obj = NULL, *req = NULL;
        if (listed) {
            req = PySequence_GetItem(reqs, i);
            if (req == NULL) {
                Py_DECREF(index);
                goto failed;
            }
            id_obj = PyObject_GetAttr(req, self->attr[T_ID]);
            if (id_obj == NULL) {
                if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
                    Py_DECREF(req);
                    Py_DECREF(index);
                    goto failed;
                }
                PyErr_Clear();
            }
        }
        PyObject *id = id_obj != NULL ? PyObject_Str(id_obj) : Py_NewRef(S_unknown_id);
        Py_XDECREF(id_obj);
        if (id == NULL) {
            Py_XDECREF(req);
            Py_DECREF(index);
            goto failed;
        }
        int rc = context_row_allocated(index, id, req); /* the request, held weakly: a row it leaves is named */
        Py_XDECREF(req);
        Py_DECREF(index);
        Py_DECREF(id);
        if (rc < 0)
            goto failed;
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

/* The state's release check for a host ledger, as a test: 1 the row's release is healthy (nothing it
 * pointed at is still its own, no free group open), 0 the Python check must look (a leak to name, a
 * group to wait for, a table we do not read), -1 an error. Changes nothing. */
static int
release_is_healthy(Hooked *self, PyObject *pool, long row)
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
    PyObject *table = PyObject_GetAttr(pool, self->attr[T_TABLE]);
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
    int healthy = !row_still_owns(l, &t, (Py_ssize_t)row * cols, upto, row);
    Py_DECREF(table);
    return healthy;
}

static void
release_done(long row)
{
    if (H.extent != NULL && row >= 0 && row < H.extent_n)
        H.extent[row] = 0;
}

/* After a release: the request table's bookkeeping, then the state's idle-census check. */
static int
rows_freed(PyObject *const *rows, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        if (context_row_freed(rows[i]) < 0)
            return -1;
    }
    return context_rows_released();
}

/* --- row free (request): the request's row given back (the request may be its row) --- */
PyObject *
fast_row_free(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *obj = args[0];
    if (H.requests == NULL || H.state == NULL || self->index_path == NULL)
        return DIVERT;
    PyObject *req = hook_arg(self, A_REQUEST, args, nargs, kwnames);
    PyObject *index = NULL;
    if (req != NULL) {
        index = Py_NewRef(req);
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(self->index_path) && index != Py_None; i++) {
            PyObject *next = PyObject_GetAttr(index, PyTuple_GET_ITEM(self->index_path, i));
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
        int healthy = release_is_healthy(self, obj, row);
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

/* --- rows free (rows): a list of rows given back --- */
PyObject *
fast_rows_free(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *obj = args[0];
    if (H.requests == NULL || H.state == NULL)
        return DIVERT;
    PyObject *indices = hook_arg(self, A_ROWS, args, nargs, kwnames);
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
        int healthy = release_is_healthy(self, obj, row);
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

/* A last-loc source function's result remembered with what it read (the role's `after`, here
 * without a Python call): keyed by the result's id, the oldest dropped past sources_max. */
int
remember_source(Hooked *self, PyObject *result, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *sources = H.sources;
    if (sources == NULL || !PyDict_CheckExact(sources))
        return 0;
    PyObject *table = fn_arg(args, nargs, kwnames, self->arg_pos[A_TABLE], self->arg_name[A_TABLE]);
    PyObject *rows = fn_arg(args, nargs, kwnames, self->arg_pos[A_SOURCE_ROWS], self->arg_name[A_SOURCE_ROWS]);
    PyObject *prefix = fn_arg(args, nargs, kwnames, self->arg_pos[A_PREFIX], self->arg_name[A_PREFIX]);
    PyObject *entry =
        PyTuple_Pack(4, result, rows ? rows : Py_None, table ? table : Py_None, prefix ? prefix : Py_None);
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
