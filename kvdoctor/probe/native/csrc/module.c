/* The probe's native path: the wrapper every hooked method gets, and the slot ledger's
 * healthy-case updates, without a Python frame.
 *
 * Why: an engine's scheduler is CPU-bound at small batches, and a Python wrapper that reads index
 * tensors through torch's Python API and updates the ledger with numpy costs 9-21 us per hooked
 * call there. This extension does the same work as `kvdoctor.probe.core.hooks.wrap_method` plus the
 * ledger operations it knows (`kind`), in C:
 *
 * - dispatch (here): the probe's switches, re-entry (composite roles), the hooked-call count, and
 *   the fast path of the hook's kind (FAST_PATHS), else the generic path (generic.c);
 * - the call site (callsites.c): looked up by (code object, offset) of the caller and its caller;
 * - index tensors (tensors.c): read in place, through torch's DLPack C table, or its getters;
 * - the ledger (ledger.c): the numpy arrays the Python `SlotLedger` owns, through their buffers,
 *   under a lock whose uncontended acquire is two stores (lock.c);
 * - the ledger operations (slot_ops.c, tree_ops.c, row_ops.c), each the healthy case of the roles
 *   that declare it, reading what those roles name (native.h says how), and the engine's state
 *   called by operation (context.c).
 *
 * It only ever takes the healthy case: every rule is checked first, and anything else (a
 * violation, an index it cannot read, a census due, a fix on, a fault injected) goes to the
 * Python role or ledger method, which records it exactly as it always has. What it writes is
 * what the Python path would have written; the tests compare the two on the same workloads.
 * Never raises into the host: its own failures go to `probe.fail`, like the Python wrapper's.
 */
#include "native.h"

#include <structmember.h>

NativeState H;
_Thread_local ThreadState this_thread;

#define NATIVE_DEFINE_NAME(var, text) PyObject *S_##var;
NATIVE_NAMES(NATIVE_DEFINE_NAME)
#undef NATIVE_DEFINE_NAME

/* ------------------------------------------------------------------ dispatch */

/* K_NOTE: a role that changes no slot: the call goes through with its entry pushed. */
static PyObject *
fast_note(Hooked *self, PyObject *const *args, size_t nargsf, Py_ssize_t Py_UNUSED(nargs), PyObject *kwnames)
{
    return call_pushed(self, args[0], args, nargsf, kwnames);
}

/* The fast path of each kind; NULL: none (the generic path takes every call). */
static const FastPath FAST_PATHS[K_COUNT] = {
    [K_NOTE] = fast_note,
    [K_ALLOC] = fast_alloc,
    [K_FREE] = fast_free,
    [K_TREE_IN] = fast_tree_in,
    [K_TREE_OUT] = fast_tree_out,
    [K_TREE_UNLOCK] = fast_tree_unlock,
    [K_OWNER_WRITE] = fast_owner_write,
    [K_ROW_ALLOC] = fast_row_alloc,
    [K_ROW_FREE] = fast_row_free,
    [K_ROWS_FREE] = fast_rows_free,
};

static PyObject *
hooked_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Hooked *self = (Hooked *)callable;
    if (self->function)
        return function_call(self, args, nargsf, kwnames);
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 1 || H.probe == NULL || !H.active || (H.ledgers_off & self->ledger_mask))
        return call_original(self, args, nargsf, kwnames);
    PyObject *obj = args[0];
    if (blocked(obj, self->role_id, self->composite))
        return call_original(self, args, nargsf, kwnames);
    H.calls++;
    if (self->kind > K_GENERIC && !H.fixes_on && !(H.inject & self->role_bit)) {
        FastPath fast = FAST_PATHS[self->kind];
        PyObject *r = fast != NULL ? fast(self, args, nargsf, nargs, kwnames) : DIVERT;
        if (r != DIVERT) {
            H.n_fast[self->kind]++;
            return r;
        }
        H.n_diverted[self->kind]++;
    }
    return generic(self, args, nargsf, nargs, kwnames);
}

/* ------------------------------------------------------------------ the Hooked type */

/* The attributes each operation cannot go without (T_SLOTS is optional: without it the carrier
 * argument is the slots). */
static const unsigned REQUIRED_ATTRS[K_COUNT] = {
    [K_TREE_IN] = 1u << T_OWNER | 1u << T_SIZE | 1u << T_SIZE_ALSO | 1u << T_PREFIX,
    [K_TREE_OUT] = 1u << T_OWNER,
    [K_TREE_UNLOCK] = 1u << T_COUNT | 1u << T_ROOT,
    [K_ROW_ALLOC] = 1u << T_ID,
    [K_ROW_FREE] = 1u << T_TABLE,
    [K_ROWS_FREE] = 1u << T_TABLE,
};

/* `args`: up to MAX_ARGS (position, keyword) pairs, by slot (A_*); `attrs`: up to MAX_ATTRS names or
 * None, by slot (T_*). */
static int
hooked_reads(Hooked *self, PyObject *args, PyObject *attrs)
{
    for (int i = 0; i < MAX_ARGS; i++) {
        self->arg_pos[i] = -1;
        Py_CLEAR(self->arg_name[i]);
    }
    for (int i = 0; i < MAX_ATTRS; i++)
        Py_CLEAR(self->attr[i]);
    if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) > MAX_ARGS || !PyTuple_CheckExact(attrs) ||
        PyTuple_GET_SIZE(attrs) > MAX_ATTRS) {
        PyErr_SetString(PyExc_TypeError, "args: a tuple of (position, name) pairs; attrs: a tuple of names or None");
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); i++) {
        PyObject *pair = PyTuple_GET_ITEM(args, i), *name = NULL;
        Py_ssize_t pos;
        if (!PyTuple_Check(pair) || !PyArg_ParseTuple(pair, "nO", &pos, &name))
            return PyErr_Occurred() ? -1 : (PyErr_SetString(PyExc_TypeError, "args: (position, name) pairs"), -1);
        if (name != Py_None && !PyUnicode_Check(name)) {
            PyErr_SetString(PyExc_TypeError, "args: an argument's name is a str or None");
            return -1;
        }
        self->arg_pos[i] = pos;
        self->arg_name[i] = name == Py_None ? NULL : Py_NewRef(name);
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(attrs); i++) {
        PyObject *name = PyTuple_GET_ITEM(attrs, i);
        if (name == Py_None)
            continue;
        if (!PyUnicode_Check(name)) {
            PyErr_SetString(PyExc_TypeError, "attrs: names or None");
            return -1;
        }
        self->attr[i] = Py_NewRef(name);
        PyUnicode_InternInPlace(&self->attr[i]);
    }
    for (int i = 0; i < MAX_ATTRS; i++) {
        if ((REQUIRED_ATTRS[self->kind] >> i & 1u) && self->attr[i] == NULL) {
            PyErr_Format(PyExc_ValueError, "fast-path kind %d needs attrs[%d]", self->kind, i);
            return -1;
        }
    }
    return 0;
}

static int
hooked_init(Hooked *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"original",
                            "role",
                            "hook",
                            "name",
                            "role_id",
                            "ledger_mask",
                            "role_bit",
                            "composite",
                            "wants_site",
                            "kind",
                            "before",
                            "after",
                            "rewrite",
                            "finally_",
                            "prepare",
                            "rewrite_result",
                            "only_page_starts",
                            "as_pages",
                            "group_attr",
                            "group_open_when_false",
                            "args",
                            "attrs",
                            "index_path",
                            "function",
                            "sources_max",
                            NULL};
    PyObject *original, *role, *hook, *name, *before = Py_None, *after = Py_None, *rewrite = Py_None,
                                             *finally_ = Py_None, *prepare = Py_None, *rewrite_result = Py_None,
                                             *group_attr = Py_None, *index_path = Py_None;
    PyObject *empty = PyTuple_New(0);
    if (empty == NULL)
        return -1;
    PyObject *reads = empty, *attrs = empty;
    int function = 0;
    Py_ssize_t sources_max = 64;
    int role_id, composite = 0, wants_site = 0, kind = K_GENERIC, only_page_starts = 0, as_pages = 0,
                 group_open_when_false = 0;
    unsigned int ledger_mask = 0;
    unsigned long long role_bit = 0;
    int ok = PyArg_ParseTupleAndKeywords(args, kwargs, "OOOUiIK|ppiOOOOOOppOpOOOpn", names, &original, &role, &hook,
                                         &name, &role_id, &ledger_mask, &role_bit, &composite, &wants_site, &kind,
                                         &before, &after, &rewrite, &finally_, &prepare, &rewrite_result,
                                         &only_page_starts, &as_pages, &group_attr, &group_open_when_false, &reads,
                                         &attrs, &index_path, &function, &sources_max);
    if (ok && (kind < 0 || kind >= K_COUNT)) {
        PyErr_SetString(PyExc_ValueError, "unknown fast-path kind");
        ok = 0;
    }
    if (ok && index_path != Py_None && !PyTuple_CheckExact(index_path)) {
        PyErr_SetString(PyExc_TypeError, "index_path must be a tuple of attribute names");
        ok = 0;
    }
    if (ok) {
        self->kind = kind;
        ok = hooked_reads(self, reads, attrs) == 0;
    }
    Py_DECREF(empty);
    if (!ok)
        return -1;
#define SET(field, value) Py_XSETREF(self->field, (value) == Py_None ? NULL : Py_NewRef(value))
    Py_XSETREF(self->original, Py_NewRef(original));
    Py_XSETREF(self->role, Py_NewRef(role));
    Py_XSETREF(self->hook, Py_NewRef(hook));
    Py_XSETREF(self->name, Py_NewRef(name));
    SET(before, before);
    SET(after, after);
    SET(rewrite, rewrite);
    SET(finally_, finally_);
    SET(prepare, prepare);
    SET(rewrite_result, rewrite_result);
    SET(group_attr, group_attr);
    SET(index_path, index_path);
#undef SET
    self->function = function;
    self->sources_max = sources_max;
    self->role_id = role_id;
    self->ledger_mask = ledger_mask;
    self->role_bit = role_bit;
    self->composite = composite;
    self->wants_site = wants_site;
    self->only_page_starts = only_page_starts;
    self->as_pages = as_pages;
    self->group_open_when_false = group_open_when_false;
    self->vectorcall = hooked_vectorcall;
    return 0;
}

static PyObject *
hooked_new(PyTypeObject *type, PyObject *Py_UNUSED(args), PyObject *Py_UNUSED(kwargs))
{
    Hooked *self = (Hooked *)type->tp_alloc(type, 0);
    if (self != NULL) {
        self->vectorcall = hooked_vectorcall;
        for (int i = 0; i < MAX_ARGS; i++)
            self->arg_pos[i] = -1;
    }
    return (PyObject *)self;
}

static int
hooked_traverse(Hooked *self, visitproc visit, void *arg)
{
    Py_VISIT(self->dict);
    Py_VISIT(self->original);
    Py_VISIT(self->role);
    Py_VISIT(self->hook);
    Py_VISIT(self->before);
    Py_VISIT(self->after);
    Py_VISIT(self->rewrite);
    Py_VISIT(self->finally_);
    Py_VISIT(self->prepare);
    Py_VISIT(self->rewrite_result);
    return 0;
}

static int
hooked_clear(Hooked *self)
{
    Py_CLEAR(self->dict);
    Py_CLEAR(self->original);
    Py_CLEAR(self->role);
    Py_CLEAR(self->hook);
    Py_CLEAR(self->name);
    Py_CLEAR(self->before);
    Py_CLEAR(self->after);
    Py_CLEAR(self->rewrite);
    Py_CLEAR(self->finally_);
    Py_CLEAR(self->prepare);
    Py_CLEAR(self->rewrite_result);
    Py_CLEAR(self->group_attr);
    Py_CLEAR(self->index_path);
    for (int i = 0; i < MAX_ARGS; i++)
        Py_CLEAR(self->arg_name[i]);
    for (int i = 0; i < MAX_ATTRS; i++)
        Py_CLEAR(self->attr[i]);
    return 0;
}

static void
hooked_dealloc(Hooked *self)
{
    PyObject_GC_UnTrack(self);
    hooked_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
hooked_descr_get(PyObject *self, PyObject *obj, PyObject *Py_UNUSED(type))
{
    if (obj == NULL || obj == Py_None)
        return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static PyObject *
hooked_repr(Hooked *self)
{
    return PyUnicode_FromFormat("<kvdoctor hook %U of %R>", self->name ? self->name : Py_None,
                                self->original ? self->original : Py_None);
}

static PyMemberDef hooked_members[] = {
    {"__dictoffset__", T_PYSSIZET, offsetof(Hooked, dict), READONLY, NULL},
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(Hooked, vectorcall), READONLY, NULL},
    {"kind", T_INT, offsetof(Hooked, kind), READONLY, "the fast path this hook takes (0: generic)"},
    {NULL}};

static PyGetSetDef hooked_getset[] = {{"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
                                      {NULL}};

static PyTypeObject HookedType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvdoctor.probe.native._native.Hooked",
    .tp_basicsize = sizeof(Hooked),
    .tp_dealloc = (destructor)hooked_dealloc,
    .tp_vectorcall_offset = offsetof(Hooked, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_repr = (reprfunc)hooked_repr,
    .tp_getattro = PyObject_GenericGetAttr,
    .tp_setattro = PyObject_GenericSetAttr,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_doc = "A hooked engine method: the probe's wrapper, with native fast paths for the slot ledger.",
    .tp_traverse = (traverseproc)hooked_traverse,
    .tp_clear = (inquiry)hooked_clear,
    .tp_members = hooked_members,
    .tp_getset = hooked_getset,
    .tp_descr_get = hooked_descr_get,
    .tp_dictoffset = offsetof(Hooked, dict),
    .tp_init = (initproc)hooked_init,
    .tp_new = hooked_new,
};

/* ------------------------------------------------------------------ the module's functions */

static PyObject *
m_configure(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"probe", "active", "ledgers_off", "fixes_on", "inject", "site_at", NULL};
    PyObject *probe, *site_at = Py_None;
    int active, fixes_on;
    unsigned int ledgers_off;
    unsigned long long inject;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OpIpK|O", names, &probe, &active, &ledgers_off, &fixes_on, &inject,
                                     &site_at))
        return NULL;
    Py_XSETREF(H.probe, probe == Py_None ? NULL : Py_NewRef(probe));
    if (site_at != Py_None)
        Py_XSETREF(H.site_at, Py_NewRef(site_at));
    H.active = active && H.probe != NULL;
    H.ledgers_off = ledgers_off;
    H.fixes_on = fixes_on;
    H.inject = inject;
    Py_RETURN_NONE;
}

static PyObject *
m_reset(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    ledgers_release();
    context_forget();
    Py_CLEAR(H.site_at);
    Py_CLEAR(H.probe);
    H.active = 0;
    H.fail_after_kind = -1;
    H.generation++;
    sites_clear();
    Py_RETURN_NONE;
}

static PyObject *
m_calls(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromUnsignedLongLong(H.calls);
}

static PyObject *
m_evicting(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromLong(this_thread.evicting);
}

static PyObject *
m_evict_add(PyObject *Py_UNUSED(module), PyObject *delta)
{
    long d = PyLong_AsLong(delta);
    if (d == -1 && PyErr_Occurred())
        return NULL;
    this_thread.evicting += (int)d;
    Py_RETURN_NONE;
}

static PyObject *
m_fail_after(PyObject *Py_UNUSED(module), PyObject *kind)
{
    long k = PyLong_AsLong(kind);
    if (k == -1 && PyErr_Occurred())
        return NULL;
    H.fail_after_kind = (int)k;
    Py_RETURN_NONE;
}

static PyObject *
m_stats(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    PyObject *fast = PyList_New(K_COUNT), *diverted = PyList_New(K_COUNT), *slow = PyList_New(K_COUNT);
    if (fast == NULL || diverted == NULL || slow == NULL) {
        Py_XDECREF(fast);
        Py_XDECREF(diverted);
        Py_XDECREF(slow);
        return NULL;
    }
    for (int k = 0; k < K_COUNT; k++) {
        PyList_SET_ITEM(fast, k, PyLong_FromUnsignedLongLong(H.n_fast[k]));
        PyList_SET_ITEM(diverted, k, PyLong_FromUnsignedLongLong(H.n_diverted[k]));
        PyList_SET_ITEM(slow, k, PyLong_FromUnsignedLongLong(H.n_slow[k]));
    }
    Py_ssize_t site_keys, site_slots;
    int direct_frames;
    call_site_stats(&site_keys, &site_slots, &direct_frames);
    TensorReaderStats t = tensor_reader_stats();
    return Py_BuildValue(
        "{s:n,s:n,s:i,s:i,s:N,s:N,s:N,s:O,s:O,s:O,s:k,s:k,s:k,s:K}", "site_keys", site_keys, "site_slots", site_slots,
        "ledgers", H.n_ledgers, "depth", this_thread.depth, "fast", fast, "diverted", diverted, "slow", slow,
        "direct_frames", direct_frames ? Py_True : Py_False, "dlpack_reader", t.dlpack_reader ? Py_True : Py_False,
        "direct_reader", t.direct_reader ? Py_True : Py_False, "direct_reads", t.direct_reads, "direct_checked",
        t.direct_checked, "direct_mismatches", t.direct_mismatches, "device_launches", device_launch_count());
}

static PyMethodDef module_methods[] = {
    {"configure", (PyCFunction)(void (*)(void))m_configure, METH_VARARGS | METH_KEYWORDS,
     "The probe's switches: which probe, on or off, ledgers off (bit mask), fixes on, roles with a fault injected."},
    {"set_torch", m_set_torch, METH_VARARGS,
     "torch.Tensor, torch.int64 and torch.int32: what index tensors are; sample tensors on which torch's DLPack "
     "reader must agree with its getters before it is used (False: not used); use_dlpack=False keeps the getters."},
    {"readers_agree", m_readers_agree, METH_O,
     "Tests: whether the readers (in place, DLPack, getters) read a tensor alike."},
    {"apply_op", m_apply_op, METH_VARARGS,
     "Tests: one ledger operation on a registered host ledger, as the fast paths apply it (True: healthy, written)."},
    {"register_ledger", (PyCFunction)(void (*)(void))m_register_ledger, METH_VARARGS | METH_KEYWORDS,
     "A host slot ledger the fast paths may update (its numpy arrays, shape, lock)."},
    {"set_context", (PyCFunction)(void (*)(void))m_set_context, METH_VARARGS | METH_KEYWORDS,
     "The engine's state, its request table and last-loc sources, and what each operation is called there."},
    {"set_primary", m_set_primary, METH_O, "The allocator whose slots request rows point at."},
    {"set_row_extent", m_set_row_extent, METH_O, "How far each request row was written (int64 array)."},
    {"set_divert", m_set_divert, METH_O, "True: a census is due; allocations take the Python path."},
    {"reset", m_reset, METH_NOARGS, "Forget every ledger, the state and the call-site keys."},
    {"calls", m_calls, METH_NOARGS, "Hooked calls dispatched here since the process started."},
    {"evicting", m_evicting, METH_NOARGS, "Tree evictions in progress on this thread."},
    {"evict_add", m_evict_add, METH_O, "Adds to this thread's evictions in progress."},
    {"direct_misread", m_direct_misread, METH_NOARGS, "Tests: the in-place reader swaps the index dtypes."},
    {"read_in_place", m_read_in_place, METH_O, "Tests: whether this tensor is read from torch's own fields."},
    {"direct_check_every", m_direct_check_every, METH_O,
     "Tests: compare every n-th direct tensor read with DLPack's (0: the default, 1024)."},
    {"fail_after", m_fail_after, METH_O, "Tests: a fast path of this kind fails after the host's call (-1: none)."},
    {"stats", m_stats, METH_NOARGS, "Sizes of what this module holds."},
    {"launch_kernel", (PyCFunction)(void (*)(void))m_launch_kernel, METH_FASTCALL,
     "A compiled Triton kernel launched through the CUDA driver (launch.c)."},
    {"register_device_ledger", (PyCFunction)(void (*)(void))m_register_device_ledger, METH_VARARGS | METH_KEYWORDS,
     "A GPU slot ledger whose healthy updates the fast paths launch (its lock, stream, device, page size)."},
    {"device_plan", (PyCFunction)(void (*)(void))m_device_plan, METH_VARARGS | METH_KEYWORDS,
     "One compiled kernel of a GPU slot ledger, with its fixed parameters."},
    {"launch_record", m_launch_record, METH_O,
     "Tests: device ledgers' launches appended to this list instead of going to the driver (None: the driver)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_native",
    .m_doc = "The probe's native path: the hooked methods' wrapper and the ledger operations (see csrc/module.c).",
    .m_size = -1,
    .m_methods = module_methods,
};

/* The vocabulary Python reads back: the ledger's states (checked against base/vocabulary.py) and the
 * fast-path kinds (the Python side's KINDS). */
static const struct {
    const char *name;
    int value;
} CONSTANTS[] = {
    {"FREE", ST_FREE},
    {"OWNED", ST_OWNED},
    {"TREE", ST_TREE},
    {"RESERVED", ST_RESERVED},
    {"K_GENERIC", K_GENERIC},
    {"K_NOTE", K_NOTE},
    {"K_ALLOC", K_ALLOC},
    {"K_FREE", K_FREE},
    {"K_TREE_IN", K_TREE_IN},
    {"K_TREE_OUT", K_TREE_OUT},
    {"K_TREE_UNLOCK", K_TREE_UNLOCK},
    {"K_OWNER_WRITE", K_OWNER_WRITE},
    {"K_ROW_ALLOC", K_ROW_ALLOC},
    {"K_ROW_FREE", K_ROW_FREE},
    {"K_ROWS_FREE", K_ROWS_FREE},
    {"K_LAST_LOC", K_LAST_LOC},
    {"MAX_SITE_KEYS", MAX_SITE_KEYS},
};

PyMODINIT_FUNC
PyInit__native(void)
{
#define NATIVE_INTERN_NAME(var, text)                         \
    if ((S_##var = PyUnicode_InternFromString(text)) == NULL) \
        return NULL;
    NATIVE_NAMES(NATIVE_INTERN_NAME)
#undef NATIVE_INTERN_NAME
    H.fail_after_kind = -1;
    if (PyType_Ready(&HookedType) < 0 || PyType_Ready(&FastLockType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Hooked", (PyObject *)&HookedType) < 0 ||
        PyModule_AddObjectRef(m, "FastLock", (PyObject *)&FastLockType) < 0)
        goto failed;
    for (size_t i = 0; i < sizeof(CONSTANTS) / sizeof(CONSTANTS[0]); i++)
        if (PyModule_AddIntConstant(m, CONSTANTS[i].name, CONSTANTS[i].value) < 0)
            goto failed;
    return m;
failed:
    Py_DECREF(m);
    return NULL;
}
