/* The call site of a hooked call: the hooked method's caller and its caller, keyed by (code object,
 * offset) of each and interned by the same `CallSites` table the Python path uses (asked once per
 * new key, then remembered here).
 *
 * On 3.11 and 3.12 the key is read from the interpreter's own frame records, without making frame
 * objects: the one place the native path needs CPython's internal headers (Py_BUILD_CORE), kept to
 * this unit. Every new key it makes is checked against the public API first, and one disagreement
 * turns it off for good.
 */
#include "native.h"

#if PY_VERSION_HEX < 0x030B0000
#include <frameobject.h>
#endif
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030D0000
#ifndef Py_BUILD_CORE
#define Py_BUILD_CORE 1
#define KVD_UNDEF_BUILD_CORE 1
#endif
#include <internal/pycore_frame.h>
#ifdef KVD_UNDEF_BUILD_CORE
#undef Py_BUILD_CORE
#endif
#define KVD_DIRECT_FRAMES 1
#endif

typedef struct {
    PyCodeObject *code, *back;
    int lasti, back_lasti;
    int site;
} SiteKey;

/* (caller, caller's caller) -> site: open addressing, a power-of-two capacity, at most half full */
static SiteKey *sites;
static Py_ssize_t sites_cap, sites_len;

static inline Py_ssize_t
site_hash(void *a, int b, void *c, int d, Py_ssize_t mask)
{
    uint64_t h = (uint64_t)(uintptr_t)a * 0x9E3779B97F4A7C15ULL;
    h ^= ((uint64_t)(uint32_t)b + 0x632BE59BD9B4E019ULL) * 0xBF58476D1CE4E5B9ULL;
    h ^= (uint64_t)(uintptr_t)c * 0x94D049BB133111EBULL;
    h ^= (uint64_t)(uint32_t)d * 0xD6E8FEB86659FD93ULL;
    h ^= h >> 31;
    return (Py_ssize_t)(h & (uint64_t)mask);
}

COLD static int
sites_grow(void)
{
    Py_ssize_t cap = sites_cap ? sites_cap * 2 : 256;
    SiteKey *fresh = PyMem_Calloc((size_t)cap, sizeof(SiteKey));
    if (fresh == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < sites_cap; i++) {
        SiteKey *k = &sites[i];
        if (k->code == NULL)
            continue;
        Py_ssize_t j = site_hash(k->code, k->lasti, k->back, k->back_lasti, cap - 1);
        while (fresh[j].code != NULL)
            j = (j + 1) & (cap - 1);
        fresh[j] = *k;
    }
    PyMem_Free(sites);
    sites = fresh;
    sites_cap = cap;
    return 0;
}

void
sites_clear(void)
{
    for (Py_ssize_t i = 0; i < sites_cap; i++) {
        Py_XDECREF(sites[i].code);
        Py_XDECREF(sites[i].back);
    }
    PyMem_Free(sites);
    sites = NULL;
    sites_cap = sites_len = 0;
}

/* The site already interned for this key, or -1. */
static int
site_lookup(PyCodeObject *code, int lasti, PyCodeObject *back_code, int back_lasti)
{
    if (!sites_cap)
        return -1;
    Py_ssize_t mask = sites_cap - 1;
    Py_ssize_t j = site_hash(code, lasti, back_code, back_lasti, mask);
    while (sites[j].code != NULL) {
        SiteKey *k = &sites[j];
        if (k->code == code && k->lasti == lasti && k->back == back_code && k->back_lasti == back_lasti)
            return k->site;
        j = (j + 1) & mask;
    }
    return -1;
}

#ifdef KVD_DIRECT_FRAMES
static int direct_frames = 1; /* off for good after one disagreement with the public API */

static inline _PyInterpreterFrame *
first_complete(_PyInterpreterFrame *f)
{
    while (f != NULL && _PyFrame_IsIncomplete(f))
        f = f->previous;
    return f;
}

static inline int
frame_lasti(_PyInterpreterFrame *f)
{
    int lasti = _PyInterpreterFrame_LASTI(f);
    return lasti < 0 ? -1 : lasti * (int)sizeof(_Py_CODEUNIT); /* PyFrame_GetLasti's units */
}

/* The key of the current call site from the interpreter's frame records: what the public API below
 * gives, without PyEval_GetFrame/PyFrame_GetBack making (and later freeing) two frame objects per
 * caller. Borrowed code objects. */
static int
site_key_direct(PyCodeObject **code, int *lasti, PyCodeObject **back_code, int *back_lasti)
{
    PyThreadState *ts = PyThreadState_GET();
    _PyInterpreterFrame *f = first_complete(ts->cframe->current_frame);
    if (f == NULL)
        return 0;
    *code = f->f_code;
    *lasti = frame_lasti(f);
    _PyInterpreterFrame *b = first_complete(f->previous);
    *back_code = b != NULL ? b->f_code : NULL;
    *back_lasti = b != NULL ? frame_lasti(b) : -1;
    return 1;
}
#endif

int
current_site(void)
{
    if (H.site_at == NULL)
        return 0;
#ifdef KVD_DIRECT_FRAMES
    PyCodeObject *d_code = NULL, *d_back = NULL;
    int d_lasti = -1, d_back_lasti = -1;
    int direct = direct_frames && site_key_direct(&d_code, &d_lasti, &d_back, &d_back_lasti);
    if (direct) {
        int found = site_lookup(d_code, d_lasti, d_back, d_back_lasti);
        if (found >= 0)
            return found;
    }
#endif
    PyFrameObject *frame = PyEval_GetFrame(); /* borrowed: the caller of the hooked method */
    if (frame == NULL)
        return 0;
    PyCodeObject *code = PyFrame_GetCode(frame);
#if PY_VERSION_HEX >= 0x030B0000
    int lasti = PyFrame_GetLasti(frame);
#else
    int lasti = frame->f_lasti;
#endif
    PyFrameObject *back = PyFrame_GetBack(frame);
    PyCodeObject *back_code = NULL;
    int back_lasti = -1;
    if (back != NULL) {
        back_code = PyFrame_GetCode(back);
#if PY_VERSION_HEX >= 0x030B0000
        back_lasti = PyFrame_GetLasti(back);
#else
        back_lasti = back->f_lasti;
#endif
        Py_DECREF(back);
    }
#ifdef KVD_DIRECT_FRAMES
    /* a new key: the direct read must name the same frames, or it is not used again */
    if (direct && (d_code != code || d_lasti != lasti || d_back != back_code || d_back_lasti != back_lasti))
        direct_frames = 0;
#endif
    int site = site_lookup(code, lasti, back_code, back_lasti);
    if (site >= 0) {
        Py_DECREF(code);
        Py_XDECREF(back_code);
        return site;
    }
    PyObject *r = PyObject_CallOneArg(H.site_at, (PyObject *)frame);
    if (r == NULL) {
        Py_DECREF(code);
        Py_XDECREF(back_code);
        return -1;
    }
    site = (int)PyLong_AsLong(r);
    Py_DECREF(r);
    if (site < 0 || PyErr_Occurred()) {
        Py_DECREF(code);
        Py_XDECREF(back_code);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "negative call site id");
        return -1;
    }
    if (sites_len < MAX_SITE_KEYS) {
        if ((sites_len + 1) * 2 > sites_cap && sites_grow() < 0) {
            PyErr_Clear(); /* not remembered: the next call asks CallSites again */
        }
        else {
            Py_ssize_t mask = sites_cap - 1;
            Py_ssize_t j = site_hash(code, lasti, back_code, back_lasti, mask);
            while (sites[j].code != NULL)
                j = (j + 1) & mask;
            sites[j].code = code; /* the references are kept: an id is never reused while keyed */
            sites[j].back = back_code;
            sites[j].lasti = lasti;
            sites[j].back_lasti = back_lasti;
            sites[j].site = site;
            sites_len++;
            return site;
        }
    }
    Py_DECREF(code);
    Py_XDECREF(back_code);
    return site;
}

void
call_site_stats(Py_ssize_t *keys, Py_ssize_t *slots, int *direct)
{
    *keys = sites_len;
    *slots = sites_cap;
#ifdef KVD_DIRECT_FRAMES
    *direct = direct_frames;
#else
    *direct = 0;
#endif
}
