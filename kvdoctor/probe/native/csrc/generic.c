/* The generic path: `hooks.wrap_method`'s wrapper, step for step, for every hooked call no fast
 * path takes (a role that prepares or rewrites its arguments, a fix on, a fault injected, a case a
 * fast path declined); hooked module-level functions; and where the native path's own failures go.
 *
 * Never raises into the host: a failure of ours goes to `probe.fail` (or `fix_failed` for a fix),
 * which turns the probe off and says why, as the Python wrapper does. A BaseException that is not
 * an Exception (KeyboardInterrupt) propagates, as it does through the Python wrapper.
 */
#include "native.h"

/* ------------------------------------------------------------------ failures */

COLD int
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

COLD PyObject *
kept_after_failure(PyObject *name, PyObject *result)
{
    if (report_failure(name, "fail") < 0) {
        Py_DECREF(result);
        return NULL;
    }
    return result;
}

int
maybe_test_failure(Hooked *self)
{
    if (H.fail_after_kind == self->kind && self->kind != K_GENERIC) {
        PyErr_Format(PyExc_RuntimeError, "fault injected into the %U fast path", self->name);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ the generic path */

/* `wrap_method`'s wrapper, step for step. */
PyObject *
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

/* ------------------------------------------------------------------ hooked module-level functions */

/* A hooked module-level function: the host's call, then the role's `after` on its result (the
 * K_LAST_LOC kind remembers a last-loc source's result in C). */
PyObject *
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
            rc = remember_source(self, result, args, nargs, kwnames);
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
