/* SGLang's fast paths: the healthy case of each role that changes a ledger, in C.
 *
 * Kept in step with kvdoctor/probe/sglang/roles.py and requests.py (the roles with a `fast_kind`,
 * and the SglangState methods they call): each function here is that role's `before`/`after` for
 * the case where every rule holds, reading the same arguments and writing what the Python role
 * would write. What it does not take (a violation, a tensor it cannot read, a free group open, a
 * census due) goes to the Python role, either before the host's call (DIVERT: the generic path
 * runs the role) or after it (ledger_slow, or the state's own method). A change to a role's rules
 * is a change here too; tests/integration/test_hotpath.py compares the two paths' ledgers, events
 * and results on the real SGLang classes.
 */
#include "hotpath.h"

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

/* The Python ledger method given a call the fast path did not take: a host ledger's, or a device
 * ledger's (its kernels' Python path). */
static int
ledger_method(Ledger *l, DeviceLedger *d, PyObject *method, PyObject *const *args, size_t nargs, PyObject *kwnames)
{
    if (l != NULL)
        return ledger_slow(l, method, args, nargs, kwnames);
    return slow_call(d->ledger, d->lock, method, args, nargs, kwnames);
}

/* The rows a last_loc was read for, where get_last_loc's hook remembered them (`*rows` borrowed,
 * NULL for none): 1, or 0 where the lookup failed (the Python role takes the call). */
static int
last_loc_rows(PyObject *last_loc, PyObject **rows)
{
    *rows = NULL;
    if (H.last_loc_sources == NULL)
        return 1;
    PyObject *key = PyLong_FromVoidPtr(last_loc);
    if (key == NULL) {
        PyErr_Clear();
        return 0;
    }
    PyObject *source = PyDict_GetItemWithError(H.last_loc_sources, key); /* borrowed */
    Py_DECREF(key);
    if (source == NULL && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (source != NULL && PyTuple_Check(source) && PyTuple_GET_SIZE(source) >= 2 &&
        PyTuple_GET_ITEM(source, 0) == last_loc && PyTuple_GET_ITEM(source, 1) != Py_None)
        *rows = PyTuple_GET_ITEM(source, 1);
    return 1;
}

/* A paged alloc's last_loc check on a device ledger and the alloc's update, after the host's call:
 * one launch (the check reads the states the Python role's check reads before the call: the call
 * changes none of this ledger's), else the ledger's own method for both. With no slots (None, or
 * the host raised) the check alone, as the role made it; the host's exception is kept. Takes the
 * references to `last` and `rows`. */
static PyObject *
alloc_with_last_loc(Hooked *self, DeviceLedger *d, const OwnerCall *call, PyObject *last, PyObject *rows,
                    PyObject *result, int site, unsigned long gen)
{
    if (gen != H.generation)
        goto done;
    PyObject *rows_arg = rows != NULL ? rows : Py_None;
    if (result == NULL || result == Py_None) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        int rc = device_last_loc(d, call, site);
        if (rc == 0) {
            PyObject *site_obj = PyLong_FromLong(site);
            PyObject *a[3] = {last, site_obj, rows_arg};
            rc = site_obj == NULL ? -1 : slow_call(d->ledger, d->lock, S_check_last_loc, a, 3, NULL);
            Py_XDECREF(site_obj);
        }
        if (rc < 0 && report_failure(self->name, "fail") < 0)
            PyErr_Clear(); /* not an Exception of the probe's: the host's own error comes first */
        PyErr_Restore(type, value, tb);
        goto done;
    }
    int rc = device_last_loc_alloc(d, call, result, site);
    if (rc == 1 && maybe_test_failure(self) < 0)
        rc = -1;
    if (rc == 0) {
        H.n_slow[K_ALLOC]++;
        PyObject *site_obj = PyLong_FromLong(site);
        PyObject *a[5] = {last, rows_arg, result, site_obj, self->only_page_starts ? Py_True : Py_False};
        rc = site_obj == NULL ? -1 : slow_call(d->ledger, d->lock, S_on_last_loc_alloc, a, 5, NULL);
        Py_XDECREF(site_obj);
    }
    if (rc < 0)
        result = kept_after_failure(self->name, result);
done:
    Py_DECREF(last);
    Py_XDECREF(rows);
    return result;
}

/* --- alloc / alloc_extend / alloc_decode --- */
PyObject *
fast_alloc(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *obj = args[0];
    Ledger *l = ledger_of(obj);
    DeviceLedger *d = l == NULL ? device_ledger_of(obj) : NULL;
    if (l == NULL && d == NULL)
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
    int site = -1;
    PyObject *last_held = NULL, *rows_held = NULL; /* a device ledger's last_loc, and the rows it was read for */
    OwnerCall last_call;
    if (self->last_loc_pos >= 0) {
        PyObject *last_loc = arg_at(args, nargs, kwnames, self->last_loc_pos, self->last_loc_name);
        PyObject *req_indices = NULL;
        if (last_loc != NULL && last_loc != Py_None) {
            if (!last_loc_rows(last_loc, &req_indices))
                return DIVERT;
            if (d != NULL) {
                /* read now, checked after the host's call with the alloc (alloc_with_last_loc) */
                if (!device_last_loc_reads(d, last_loc, req_indices, &last_call)) {
                    PyErr_Clear();
                    return DIVERT;
                }
                last_held = Py_NewRef(last_loc);
                rows_held = Py_XNewRef(req_indices);
            }
            else {
                Ints last, req;
                if (read_ints(last_loc, &last) != 1 || (req_indices != NULL && read_ints(req_indices, &req) != 1)) {
                    PyErr_Clear();
                    return DIVERT;
                }
                /* the Python check ignores rows of another shape */
                Ints *reqp = req_indices != NULL && req.n == last.n ? &req : NULL;
                if (!last_loc_is_healthy(l, &last, reqp))
                    return DIVERT;
            }
        }
    }
    site = current_site();
    if (site < 0) {
        PyErr_Clear();
        Py_XDECREF(last_held);
        Py_XDECREF(rows_held);
        return DIVERT;
    }
    unsigned long gen = H.generation;
    PyObject *result = call_pushed(self, obj, args, nargsf, kwnames);
    if (last_held != NULL)
        return alloc_with_last_loc(self, d, &last_call, last_held, rows_held, result, site, gen);
    if (result == NULL || result == Py_None || gen != H.generation)
        return result;
    int healthy;
    if (d != NULL) {
        healthy = device_update(d, DEVICE_RULE_ALLOC(self->only_page_starts && d->page_size > 1), result, site);
        if (healthy == 1 && maybe_test_failure(self) < 0)
            healthy = -1;
    }
    else {
        Ints v;
        int rc = read_ints(result, &v);
        if (rc == 1 && maybe_test_failure(self) < 0)
            rc = -1;
        if (rc < 0)
            goto failed;
        healthy = rc == 1 ? ledger_alloc(l, &v, self->only_page_starts, site) : 0;
    }
    if (healthy < 0)
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
        int src = ledger_method(l, d, S_on_alloc, call_args, 2, kw);
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

PyObject *
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
    DeviceLedger *d = l == NULL ? device_ledger_of(obj) : NULL;
    if (l == NULL && d == NULL)
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
    int evicting = this_thread.evicting > 0;
    int site = -1; /* the call site: a device ledger's kernel records it; else only a violation needs it */
    if (d != NULL) {
        site = current_site();
        if (site < 0)
            goto failed;
        int launched = device_update(d, DEVICE_RULE_FREE(self->as_pages, evicting), index, site);
        if (launched == 1 && maybe_test_failure(self) < 0)
            launched = -1;
        if (launched < 0)
            goto failed;
        if (launched)
            goto done;
    }
    Ints v;
    int rc = d != NULL ? 0 : read_ints(index, &v);
    if (rc == 1 && maybe_test_failure(self) < 0)
        rc = -1;
    if (rc < 0)
        goto failed;
    if (rc == 1 && v.n == 0)
        goto done;
    if (rc == 1) {
        int healthy = ledger_free(l, &v, self->as_pages, evicting);
        if (healthy < 0)
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
        if (site < 0 && (site = current_site()) < 0)
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
        int src = ledger_method(l, d, S_on_free, call_args, 2, kw);
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

PyObject *
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
            healthy = ledger_tree_insert(l, &v, start, stop);
            if (healthy < 0)
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
PyObject *
fast_tree_evict(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t Py_UNUSED(nargs), PyObject *kwnames)
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
    this_thread.evicting++;
    PyObject *result = call_pushed(self, obj, args, nargsf, kwnames);
    this_thread.evicting--;
    return result;
}

/* --- RadixCache.dec_lock_ref: a node already at lock_ref 0 goes to the Python role (violation) --- */
PyObject *
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

/* --- ReqToTokenPool.write((rows, columns), values) on a GPU ledger ---
 * The Python role's update, one owner kernel launched from C (launch.c): the slots written now
 * belong to their row, for one row (an integer) or a row per slot (a tensor, a decode step's
 * batched write). How far a row was written is kept for host tables only: a GPU table's releases
 * are left to the rolling census, so nothing else is noted. */
static PyObject *
device_req_write(Hooked *self, DeviceLedger *d, PyObject *const *args, size_t nargsf, PyObject *kwnames,
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
        H.n_slow[K_REQ_WRITE]++;
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

/* --- ReqToTokenPool.write((row, columns), values) --- */
PyObject *
fast_req_write(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *obj = args[0];
    Ledger *l = H.primary;
    DeviceLedger *d = H.primary_device;
    if ((l == NULL || H.extent == NULL) && d == NULL)
        return DIVERT; /* the Python role sets both up on its first call */
    PyObject *indices = arg_at(args, nargs, kwnames, self->indices_pos, self->indices_name);
    PyObject *values = arg_at(args, nargs, kwnames, self->values_pos, self->values_name);
    if (indices == NULL || values == NULL || !PyTuple_CheckExact(indices) || PyTuple_GET_SIZE(indices) != 2 ||
        H.tensor_type == NULL || Py_TYPE(values) != (PyTypeObject *)H.tensor_type)
        return DIVERT;
    if (l == NULL)
        return device_req_write(self, d, args, nargsf, kwnames, indices, values);
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

/* RequestTable.allocated and .freed, done on its two dicts where the table gave them
 * (sglang_context), else through its methods. Its lock orders its changes against the writer
 * thread's reads; here the GIL is held from the first change to the last and nothing between them
 * runs Python code (the keys are ints, the values strings), which gives those reads the same. */
static int
table_allocated(PyObject *index, PyObject *rid)
{
    if (H.req_live == NULL) {
        PyObject *a[3] = {H.requests, index, rid};
        PyObject *r = PyObject_VectorcallMethod(S_allocated, a, 3, NULL);
        Py_XDECREF(r);
        return r == NULL ? -1 : 0;
    }
    if (PyDict_SetItem(H.req_live, index, rid) < 0)
        return -1;
    int finished = PyDict_Contains(H.req_finished, index);
    return finished < 0 ? -1 : finished ? PyDict_DelItem(H.req_finished, index) : 0;
}

static int
table_freed(PyObject *index)
{
    if (H.req_live == NULL) {
        PyObject *a[2] = {H.requests, index};
        PyObject *r = PyObject_VectorcallMethod(S_freed, a, 2, NULL);
        Py_XDECREF(r);
        return r == NULL ? -1 : 0;
    }
    PyObject *rid = PyDict_GetItemWithError(H.req_live, index);
    if (rid == NULL)
        return PyErr_Occurred() ? -1 : 0;
    Py_INCREF(rid);
    int rc = PyDict_DelItem(H.req_live, index);
    if (rc == 0)
        rc = PyDict_SetItem(H.req_finished, index, rid);
    Py_DECREF(rid);
    if (rc == 0 && PyDict_GET_SIZE(H.req_finished) > H.req_max_finished) { /* forget the oldest */
        Py_ssize_t pos = 0;
        PyObject *oldest, *value;
        if (PyDict_Next(H.req_finished, &pos, &oldest, &value)) {
            Py_INCREF(oldest);
            rc = PyDict_DelItem(H.req_finished, oldest);
            Py_DECREF(oldest);
        }
    }
    return rc;
}

/* --- ReqToTokenPool.alloc(reqs): rows handed to requests --- */
PyObject *
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
        int rc = table_allocated(index, rid);
        Py_DECREF(index);
        Py_DECREF(rid);
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
        if (table_freed(rows[i]) < 0)
            return -1;
    }
    PyObject *r = call0(H.sg_state, S_request_rows_freed);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* --- ReqToTokenPool.free(req) --- */
PyObject *
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
PyObject *
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
int
remember_last_loc(Hooked *self, PyObject *result, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *sources = H.last_loc_sources;
    if (sources == NULL || !PyDict_CheckExact(sources))
        return 0;
    PyObject *table = fn_arg(args, nargs, kwnames, self->table_pos, self->table_name);
    PyObject *rows = fn_arg(args, nargs, kwnames, self->rows_pos, self->rows_name);
    PyObject *prefix = fn_arg(args, nargs, kwnames, self->prefix_pos, self->prefix_name);
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

PyObject *
m_sglang_context(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *state, *sources, *requests;
    if (!PyArg_ParseTuple(args, "OO!O", &state, &PyDict_Type, &sources, &requests))
        return NULL;
    Py_XSETREF(H.sg_state, Py_NewRef(state));
    Py_XSETREF(H.requests, Py_NewRef(requests));
    Py_CLEAR(H.req_live);
    Py_CLEAR(H.req_finished);
    PyObject *live = PyObject_GetAttrString(requests, "live");
    PyObject *finished = live == NULL ? NULL : PyObject_GetAttrString(requests, "finished");
    PyObject *most = finished == NULL ? NULL : PyObject_GetAttrString(requests, "max_finished");
    Py_ssize_t max_finished = most == NULL ? -1 : PyLong_AsSsize_t(most);
    if (live != NULL && finished != NULL && PyDict_CheckExact(live) && PyDict_CheckExact(finished) &&
        max_finished >= 0) {
        H.req_live = Py_NewRef(live); /* else its methods are called */
        H.req_finished = Py_NewRef(finished);
        H.req_max_finished = max_finished;
    }
    PyErr_Clear();
    Py_XDECREF(live);
    Py_XDECREF(finished);
    Py_XDECREF(most);
    Py_XSETREF(H.last_loc_sources, Py_NewRef(sources));
    Py_CLEAR(H.tree_seen);
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

/* Forgets the SGLang state, its request rows and the tree last seen (the probe was deactivated). */
void
sglang_forget(void)
{
    if (H.extent != NULL) {
        PyBuffer_Release(&H.b_extent);
        H.extent = NULL;
        H.extent_n = 0;
    }
    Py_CLEAR(H.sg_state);
    Py_CLEAR(H.requests);
    Py_CLEAR(H.req_live);
    Py_CLEAR(H.req_finished);
    Py_CLEAR(H.last_loc_sources);
    Py_CLEAR(H.tree_seen);
    H.divert = 0;
}
