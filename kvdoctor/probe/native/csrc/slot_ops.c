/* Alloc and free: the healthy case of a role that hands slots out or takes them back, in C.
 *
 * Each function is its role's `before`/`after` where every rule holds, reading the same arguments
 * and writing what the role would write. What it does not take (a violation, a tensor it cannot
 * read, a free group open, a census due) goes to the role, either before the host's call (DIVERT:
 * the generic path runs the role) or after it (the ledger's own method). A change to such a role's
 * rules is a change here too; the native path's integration tests compare the two paths' ledgers,
 * events and results on the engine's real classes.
 */
#include "native.h"

/* The Python ledger method given a call the fast path did not take: a host ledger's, or a device
 * ledger's (its kernels' Python path). */
static int
ledger_method(Ledger *l, DeviceLedger *d, PyObject *method, PyObject *const *args, size_t nargs, PyObject *kwnames)
{
    if (l != NULL)
        return ledger_slow(l, method, args, nargs, kwnames);
    return slow_call(d->ledger, d->lock, method, args, nargs, kwnames);
}

/* A paged alloc's last-loc check on a device ledger and the alloc's update, after the host's call:
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

/* --- alloc: the result holds the slots handed out; a paged one's last-loc is checked first --- */
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
        if (H.state == NULL)
            return DIVERT;
        if (context_census() < 0) {
            if (report_failure(self->name, "fail") < 0)
                return NULL;
            return call_original(self, args, nargsf, kwnames); /* the probe is off now */
        }
        if (!H.active)
            return call_original(self, args, nargsf, kwnames);
    }
    int site = -1;
    PyObject *last_held = NULL, *rows_held = NULL; /* a device ledger's last-loc, and the rows it was read from */
    OwnerCall checked;
    if (self->arg_pos[A_LOC] >= 0) {
        PyObject *loc = hook_arg(self, A_LOC, args, nargs, kwnames);
        PyObject *source_rows = NULL;
        if (loc != NULL && loc != Py_None) {
            if (!context_source_rows(loc, &source_rows))
                return DIVERT;
            if (d != NULL) {
                /* read now, checked after the host's call with the alloc (alloc_with_last_loc) */
                if (!device_last_loc_reads(d, loc, source_rows, &checked)) {
                    PyErr_Clear();
                    return DIVERT;
                }
                last_held = Py_NewRef(loc);
                rows_held = Py_XNewRef(source_rows);
            }
            else {
                Ints last, req;
                if (read_ints(loc, &last) != 1 || (source_rows != NULL && read_ints(source_rows, &req) != 1)) {
                    PyErr_Clear();
                    return DIVERT;
                }
                /* the Python check ignores rows of another shape */
                Ints *reqp = source_rows != NULL && req.n == last.n ? &req : NULL;
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
        return alloc_with_last_loc(self, d, &checked, last_held, rows_held, result, site, gen);
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

/* --- free: the first argument holds the slots (or pages) given back --- */
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
    int site = -1; /* the call site: a device ledger's kernel and a host ledger's recorder keep it; else only a
                      violation needs it */
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
        if (site < 0 && l->hist != NULL && (site = current_site()) < 0)
            PyErr_Clear(); /* the recorder names no site; the free is judged as ever */
        int healthy = ledger_free(l, &v, self->as_pages, evicting, site < 0 ? 0 : site);
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
