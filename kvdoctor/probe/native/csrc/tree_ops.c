/* Tree-in, tree-out and tree unlock: slots moved into a prefix tree (the part of an inserted value
 * past the prefix it matched), the frees inside an eviction (they leave the tree bit alone), and a
 * node's lock count lowered, in C. Which attributes of the tree, its nodes and the insert's result
 * hold what is the role's (Hooked.attr); slot_ops.c says how a fast path hands a call back.
 */
#include "native.h"

/* The tree's size: the sum of its two size methods' results (T_SIZE, T_SIZE_ALSO). */
static int
tree_size(Hooked *self, PyObject *tree, long *out)
{
    PyObject *a = call0(tree, self->attr[T_SIZE]);
    if (a == NULL)
        return -1;
    PyObject *b = call0(tree, self->attr[T_SIZE_ALSO]);
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
owner_ledger(Hooked *self, PyObject *tree, int *no_allocator)
{
    *no_allocator = 0;
    PyObject *allocator = PyObject_GetAttr(tree, self->attr[T_OWNER]);
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

/* --- tree-in: the slots of the inserted value past the prefix it matched, as far as the tree grew --- */
PyObject *
fast_tree_in(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *obj = args[0];
    int no_allocator;
    Ledger *l = owner_ledger(self, obj, &no_allocator);
    if (l == NULL) /* the Python role decides what a tree without our allocator means */
        return DIVERT;
    if (self->attr[T_ASIDE] != NULL) { /* e.g. HiCache: an insert can take slots inside the prefix */
        PyObject *aside = PyObject_GetAttr(obj, self->attr[T_ASIDE]);
        if (aside == NULL)
            PyErr_Clear();
        else {
            int set = aside != Py_None;
            Py_DECREF(aside);
            if (set)
                return DIVERT;
        }
    }
    if (context_note_tree(obj) < 0) {
        PyErr_Clear();
        return DIVERT;
    }
    long size_before;
    if (tree_size(self, obj, &size_before) < 0) {
        PyErr_Clear();
        return DIVERT;
    }
    int site = current_site();
    if (site < 0) {
        PyErr_Clear();
        return DIVERT;
    }
    PyObject *carrier = hook_arg(self, A_CARRIER, args, nargs, kwnames);
    Py_XINCREF(carrier);
    unsigned long gen = H.generation;
    PyObject *result = call_pushed(self, obj, args, nargsf, kwnames);
    if (result == NULL || gen != H.generation) {
        Py_XDECREF(carrier);
        return result;
    }
    PyObject *value = NULL;
    if (carrier != NULL) {
        if (self->attr[T_SLOTS] != NULL) {
            value = PyObject_GetAttr(carrier, self->attr[T_SLOTS]);
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
    if (maybe_test_failure(self) < 0 || tree_size(self, obj, &size_after) < 0)
        goto failed;
    long grown = size_after - size_before;
    long prefix;
    PyObject *pl = PyObject_GetAttr(result, self->attr[T_PREFIX]);
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
    prefix = PyLong_AsLong(pl);
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
    if (rc == 1 && prefix >= 0) {
        /* value[prefix : prefix + grown] of a 1-D tensor */
        PyObject *d = call0(value, S_dim);
        if (d == NULL)
            goto failed;
        long dim = PyLong_AsLong(d);
        Py_DECREF(d);
        if (dim == 1) {
            Py_ssize_t start = prefix < v.n ? prefix : v.n;
            Py_ssize_t stop = prefix + grown < v.n ? prefix + grown : v.n;
            healthy = ledger_tree_insert(l, &v, start, stop, site);
            if (healthy < 0)
                goto failed;
        }
    }
    if (!healthy) {
        PyObject *part = PySequence_GetSlice(value, prefix, prefix + grown);
        if (part == NULL)
            goto failed;
        PyObject *site_obj = PyLong_FromLong(site);
        if (site_obj == NULL) {
            Py_DECREF(part);
            goto failed;
        }
        PyObject *call_args[2] = {part, site_obj};
        H.n_slow[K_TREE_IN]++;
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

/* --- tree-out: an eviction, whose frees leave the tree bit alone --- */
PyObject *
fast_tree_out(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t Py_UNUSED(nargs), PyObject *kwnames)
{
    PyObject *obj = args[0];
    int no_allocator;
    Ledger *l = owner_ledger(self, obj, &no_allocator);
    if (l == NULL)
        return DIVERT;
    if (context_note_tree(obj) < 0) {
        PyErr_Clear();
        return DIVERT;
    }
    this_thread.evicting++;
    PyObject *result = call_pushed(self, obj, args, nargsf, kwnames);
    this_thread.evicting--;
    return result;
}

/* --- tree unlock: a node whose lock count is already 0 (not the root) goes to the Python role (violation) --- */
PyObject *
fast_tree_unlock(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *obj = args[0];
    PyObject *node = hook_arg(self, A_NODE, args, nargs, kwnames);
    if (node != NULL) {
        PyObject *count = PyObject_GetAttr(node, self->attr[T_COUNT]);
        if (count == NULL) {
            PyErr_Clear();
        }
        else {
            int underflow = 0;
            if (PyLong_Check(count)) {
                long value = PyLong_AsLong(count);
                if (PyErr_Occurred()) {
                    PyErr_Clear();
                    underflow = 1; /* let the Python role look */
                }
                else
                    underflow = value <= 0;
            }
            Py_DECREF(count);
            if (underflow) {
                PyObject *root = PyObject_GetAttr(obj, self->attr[T_ROOT]);
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
