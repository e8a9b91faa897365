/* The ledger's lock: a reentrant lock, like threading.RLock, that C takes without a method call.
 *
 * Its state is only read and written with the GIL held (every caller holds it), so an uncontended
 * acquire is a thread-id compare and two stores: no lock of the system's. A thread that finds it
 * held by another (one that let go of the GIL inside its locked section, as a census in the writer
 * thread can) waits without the GIL, looking again every 50 us. Python uses it as
 * `with ledger.lock:`; the native side's new_lock() makes one per ledger and resets them in a forked child.
 */
#include "native.h"

#include <time.h>

int
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

int
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
fastlock_new(PyTypeObject *type, PyObject *Py_UNUSED(args), PyObject *Py_UNUSED(kwargs))
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
fastlock_acquire(FastLock *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"blocking", "timeout", NULL};
    int blocking = 1;
    double timeout = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|pd", names, &blocking, &timeout))
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
fastlock_enter(FastLock *self, PyObject *Py_UNUSED(ignored))
{
    if (fastlock_take(self, 1) < 0)
        return NULL;
    Py_RETURN_TRUE;
}

static PyObject *
fastlock_release(FastLock *self, PyObject *Py_UNUSED(ignored))
{
    if (fastlock_give(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
fastlock_exit(FastLock *self, PyObject *Py_UNUSED(args))
{
    if (fastlock_give(self) < 0)
        return NULL;
    Py_RETURN_FALSE;
}

static PyObject *
fastlock_is_owned(FastLock *self, PyObject *Py_UNUSED(ignored))
{
    return PyBool_FromLong(self->count > 0 && self->owner == PyThread_get_thread_ident());
}

static PyObject *
fastlock_at_fork_reinit(FastLock *self, PyObject *Py_UNUSED(ignored))
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
    {NULL, NULL, 0, NULL}};

PyTypeObject FastLockType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvdoctor.probe.native._native.FastLock",
    .tp_basicsize = sizeof(FastLock),
    .tp_dealloc = (destructor)fastlock_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A reentrant lock the native path takes without a method call (see threading.RLock).",
    .tp_weaklistoffset = offsetof(FastLock, weakrefs),
    .tp_methods = fastlock_methods,
    .tp_new = fastlock_new,
};
