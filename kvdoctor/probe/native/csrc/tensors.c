/* Index tensors read without a copy: the element count, width and address of a plain CPU integer
 * tensor, from three readers that must agree.
 *
 * - torch's own fields (read_ints_direct): the TensorImpl's sizes, strides, offset, dtype, device
 *   and dispatch keys, and the StorageImpl's data pointer, at places learned at start on sample
 *   tensors (learn_direct), each by what the DLPack reader says of the same sample;
 * - torch's DLPack C exchange table (`Tensor.__dlpack_c_exchange_api__`): one C call, no Python
 *   attribute reads; trusted only where it reads every sample as the getters do;
 * - torch's Python getters (is_cpu, dtype, numel(), is_contiguous(), data_ptr()), the fallback.
 *
 * Layouts learned at run time live here and nowhere else; every 1024th in-place read is compared
 * with DLPack's, and one difference turns the in-place reader off for good.
 */
#include "native.h"

/* ------------------------------------------------------------------ DLPack (the open standard's C ABI) */

/* The part of DLPack 1.x's C ABI the probe reads (dlpack.h, `DLTensor` and `DLPackExchangeAPI`):
 * torch publishes the table as a capsule on its tensor type, and its `dltensor_from_py_object_no_sync`
 * fills a DLTensor that views the tensor's own metadata, without a copy, a sync or a Python call. */
typedef struct {
    int32_t device_type; /* kDLCPU = 1 */
    int32_t device_id;
} DlDevice;
typedef struct {
    uint8_t code; /* kDLInt = 0 */
    uint8_t bits;
    uint16_t lanes;
} DlDataType;
typedef struct {
    void *data;
    DlDevice device;
    int32_t ndim;
    DlDataType dtype;
    int64_t *shape;
    int64_t *strides; /* NULL: compact row-major */
    uint64_t byte_offset;
} DlTensor;
typedef int (*DLTensorFromPy)(void *py_object, DlTensor *out);
typedef struct DlExchangeHeader {
    struct {
        uint32_t major, minor;
    } version;
    struct DlExchangeHeader *prev_api;
} DlExchangeHeader;
typedef struct {
    DlExchangeHeader header;
    void *managed_tensor_allocator;
    void *managed_tensor_from_py_object_no_sync;
    void *managed_tensor_to_py_object_no_sync;
    DLTensorFromPy dltensor_from_py_object_no_sync; /* may be NULL */
    void *current_work_stream;
} DlExchangeAPI;
#define DL_CPU 1
#define DL_CUDA_HOST 3 /* page-locked host memory: a CPU tensor to torch (is_cpu), if a producer says so */
#define DL_ROCM_HOST 11
#define DL_INT 0

static DLTensorFromPy dl_read; /* torch's DLPack reader; NULL: torch's Python getters */

/* ------------------------------------------------------------------ DLPack and the getters */

/* Both readers' last step: the elements (n and itemsize set) are at `ptr`; one is read now. */
static int
ints_found(Ints *out, const void *ptr)
{
    out->data = ptr;
    if (out->n == 1) {
        out->one = out->itemsize == 8 ? *(const int64_t *)ptr : *(const int32_t *)ptr;
        out->data = NULL;
    }
    return 1;
}

/* The element count of a tensor of this shape, and whether its strides are torch's is_contiguous
 * (size-1 dimensions' strides do not count; NULL strides: compact). Both readers ask it. */
static inline int
contiguous_count(const int64_t *shape, const int64_t *strides, int64_t ndim, Py_ssize_t *n)
{
    Py_ssize_t count = 1;
    for (int64_t i = 0; i < ndim; i++)
        count *= (Py_ssize_t)shape[i];
    *n = count;
    if (count <= 1 || strides == NULL)
        return 1;
    int64_t expected = 1;
    for (int64_t i = ndim - 1; i >= 0; i--) {
        if (shape[i] != 1) {
            if (strides[i] != expected)
                return 0;
            expected *= shape[i];
        }
    }
    return 1;
}

static int
is_index_dtype(const DlTensor *d, int bits)
{
    return d->dtype.code == DL_INT && d->dtype.lanes == 1 && d->dtype.bits == bits;
}

/* What DLPack says of an index tensor, on any device: 1 contiguous 32- or 64-bit integers (`d`, `n`
 * set), 0 not that, -1 with an error set where torch declines the tensor. No value is read. */
static int
dl_index(PyObject *t, DlTensor *d, Py_ssize_t *n)
{
    if (dl_read(t, d) != 0)
        return -1;
    if (!(is_index_dtype(d, 64) || is_index_dtype(d, 32)) || d->ndim < 0)
        return 0;
    return contiguous_count(d->shape, d->strides, d->ndim, n);
}

/* read_ints through DLPack: the same answers as torch's getters below (the tests compare them),
 * -1 with an error set where torch declines the tensor. */
static int
read_ints_dlpack(PyObject *t, Ints *out)
{
    DlTensor d;
    Py_ssize_t n;
    int rc = dl_index(t, &d, &n);
    if (rc <= 0)
        return rc;
    if (d.device.device_type != DL_CPU && d.device.device_type != DL_CUDA_HOST && d.device.device_type != DL_ROCM_HOST)
        return 0;
    out->n = n;
    out->itemsize = d.dtype.bits / 8;
    if (n == 0)
        return 1;
    const char *ptr = (const char *)d.data + d.byte_offset;
    if (ptr == NULL)
        return 0;
    return ints_found(out, ptr);
}

/* read_ints through torch's Python getters (is_cpu, dtype, numel(), is_contiguous(), data_ptr()). */
static int
read_ints_getters(PyObject *t, Ints *out)
{
    PyObject *cpu = PyObject_GetAttr(t, S_is_cpu);
    if (cpu == NULL)
        return -1;
    int on_cpu = (cpu == Py_True);
    Py_DECREF(cpu);
    if (!on_cpu)
        return 0;
    PyObject *dtype = PyObject_GetAttr(t, S_dtype);
    if (dtype == NULL)
        return -1;
    int itemsize = dtype == H.dtype_int64 ? 8 : dtype == H.dtype_int32 ? 4 : 0;
    Py_DECREF(dtype);
    if (!itemsize)
        return 0;
    PyObject *n_obj = call0(t, S_numel);
    if (n_obj == NULL)
        return -1;
    Py_ssize_t n = PyLong_AsSsize_t(n_obj);
    Py_DECREF(n_obj);
    if (n < 0)
        return PyErr_Occurred() ? -1 : 0;
    out->n = n;
    out->itemsize = itemsize;
    if (n == 0)
        return 1;
    if (n > 1) { /* one element is contiguous whatever its strides */
        PyObject *c = call0(t, S_is_contiguous);
        if (c == NULL)
            return -1;
        int contiguous = (c == Py_True);
        Py_DECREF(c);
        if (!contiguous)
            return 0;
    }
    /* data_ptr(), not item(): item() goes through the dispatcher and lets go of the GIL */
    PyObject *p = call0(t, S_data_ptr);
    if (p == NULL)
        return -1;
    void *ptr = PyLong_AsVoidPtr(p);
    Py_DECREF(p);
    if (ptr == NULL)
        return PyErr_Occurred() ? -1 : 0;
    return ints_found(out, ptr);
}

void
ints_clear(Ints *out)
{
    out->n = 0;
    out->data = NULL;
    out->itemsize = 0;
    out->one = 0;
}

/* ------------------------------------------------------------------ torch's own tensor fields

torch's DLPack call costs about 600 instructions, most of them pybind11's (a GIL check, a type
caster, two reference counts), and from cold caches more than the rest of a hooked call. Where a
tensor is torch's plain CPU tensor, the same facts lie at fixed places: the TensorImpl pointer in the
Python object, its sizes and strides (inline up to 5 dimensions), storage offset, dtype, device and
dispatch keys, and the data pointer in its StorageImpl. Those places are not guessed: at start they
are found on sample tensors, each by the DLPack call's own answer, and taken only where every
sample agrees on one place (a pointer is followed only where it points where DLPack's shape array
or data are). A tensor is then read this way only if its TensorImpl and StorageImpl are of the very
classes the samples had, on the CPU, of an index dtype, with dispatch keys a sample had; anything
else is asked of DLPack. One read in CHECK_EVERY is also read through DLPack and compared: a
difference turns this reader off for good. KVDOCTOR_NATIVE_DIRECT=0 never uses it. */

#define DIRECT_CHECK_EVERY 1024
#define DIRECT_MAX_KEYSETS 4
/* How far past the sizes and strides the learning reads: the storage offset, numel, dtype, device
 * and dispatch keys fill these 32 bytes in torch's TensorImpl, and the object may end right after
 * them (a plain CPU tensor's is 176 bytes on torch 2.14, its keys the last 8): a wider scan reads
 * past the object, as AddressSanitizer showed. */
#define FIELDS_SPAN 32

typedef struct {
    int on;
    Py_ssize_t impl;          /* in the Python object: the TensorImpl pointer */
    const void *impl_class;   /* the plain TensorImpl's vtable */
    Py_ssize_t ndim, sizes, strides, inline_dims, storage_offset, dtype, device, keys;
    uint16_t dtype_i64, dtype_i32;
    uint64_t keysets[DIRECT_MAX_KEYSETS];
    int n_keysets;
    Py_ssize_t storage;       /* in the TensorImpl: the StorageImpl pointer */
    const void *storage_class;
    Py_ssize_t data;          /* in the StorageImpl: the data pointer */
    unsigned long reads, checked, check_every, until_check, mismatches;
} DirectLayout;

static DirectLayout DIRECT = {.check_every = DIRECT_CHECK_EVERY, .until_check = DIRECT_CHECK_EVERY};

#define AT(base, off, type) (*(const type *)((const char *)(base) + (off)))

static inline int
plausible_pointer(uintptr_t p)
{
    return p >= 65536 && (p & 7) == 0;
}

/* 1 read, -2 not a tensor this reader knows (DLPack is asked). Reads nothing it has not checked. */
static int
read_ints_direct(PyObject *t, Ints *out)
{
    const DirectLayout *L = &DIRECT;
    const char *impl = AT(t, L->impl, const char *);
    if (impl == NULL || AT(impl, 0, const void *) != L->impl_class)
        return -2;
    if (AT(impl, L->device, uint8_t) != 0 || AT(impl, L->device + 2, uint8_t) != 1) /* CPU, and set */
        return -2;
    uint64_t keys = AT(impl, L->keys, uint64_t);
    int known = 0;
    for (int i = 0; i < L->n_keysets; i++)
        known |= keys == L->keysets[i];
    if (!known)
        return -2;
    uint16_t dtype = AT(impl, L->dtype, uint16_t);
    int itemsize = dtype == L->dtype_i64 ? 8 : dtype == L->dtype_i32 ? 4 : 0;
    uint64_t ndim = AT(impl, L->ndim, uint64_t);
    if (itemsize == 0 || ndim > (uint64_t)L->inline_dims)
        return -2;
    const int64_t *shape = (const int64_t *)(impl + L->sizes), *strides = (const int64_t *)(impl + L->strides);
    Py_ssize_t n;
    if (!contiguous_count(shape, strides, (int64_t)ndim, &n) || n < 0)
        return -2;
    out->n = n;
    out->itemsize = itemsize;
    if (n == 0)
        return 1;
    const char *storage = AT(impl, L->storage, const char *);
    if (storage == NULL || AT(storage, 0, const void *) != L->storage_class)
        return -2;
    const char *data = AT(storage, L->data, const char *);
    int64_t offset = AT(impl, L->storage_offset, int64_t);
    if (data == NULL || offset < 0)
        return -2;
    return ints_found(out, data + offset * itemsize);
}

static int
same_ints(const Ints *a, const Ints *b)
{
    return a->n == b->n && a->itemsize == b->itemsize && a->data == b->data && a->one == b->one;
}

/* One sample as DLPack and torch's getters describe it, for learning the places. */
typedef struct {
    PyObject *t;
    DlTensor d;
    int dl_ok;
    int meta;
    int64_t storage_offset;
    const char *impl;
} Sample;

/* The one offset in [lo, hi) (step `step`) where `fits` holds for every sample; -1: none, or more
 * than one (a place two fields could be is no place). */
typedef int (*Fits)(const Sample *s, int n, Py_ssize_t off);

static Py_ssize_t
only_offset(const Sample *s, int n, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t step, Fits fits)
{
    Py_ssize_t found = -1;
    for (Py_ssize_t off = lo; off < hi; off += step) {
        if (fits(s, n, off)) {
            if (found >= 0)
                return -1;
            found = off;
        }
    }
    return found;
}

static int
fits_storage_offset(const Sample *s, int n, Py_ssize_t off)
{
    int varied = 0;
    for (int i = 0; i < n; i++) {
        if (s[i].meta)
            continue;
        if (AT(s[i].impl, off, int64_t) != s[i].storage_offset)
            return 0;
        varied |= s[i].storage_offset != 0;
    }
    return varied;
}

/* the dtype: one value per DLPack dtype, different dtypes different values */
static int
fits_dtype(const Sample *s, int n, Py_ssize_t off)
{
    for (int i = 0; i < n; i++) {
        if (s[i].meta || !s[i].dl_ok)
            continue;
        for (int j = 0; j < i; j++) {
            if (s[j].meta || !s[j].dl_ok)
                continue;
            int same_type = s[i].d.dtype.code == s[j].d.dtype.code && s[i].d.dtype.bits == s[j].d.dtype.bits &&
                            s[i].d.dtype.lanes == s[j].d.dtype.lanes;
            int same_value = AT(s[i].impl, off, uint16_t) == AT(s[j].impl, off, uint16_t);
            if (same_type != same_value)
                return 0;
        }
    }
    return 1;
}

/* the device: c10's Device {type, index} and its optional's flag: CPU (0), index -1, set; the meta
 * sample's type is not CPU */
static int
fits_device(const Sample *s, int n, Py_ssize_t off)
{
    int saw_meta = 0;
    for (int i = 0; i < n; i++) {
        uint8_t type = AT(s[i].impl, off, uint8_t), index = AT(s[i].impl, off + 1, uint8_t);
        uint8_t set = AT(s[i].impl, off + 2, uint8_t);
        if (index != 0xff || set != 1)
            return 0;
        if (s[i].meta) {
            if (type == 0)
                return 0;
            saw_meta = 1;
        }
        else if (type != 0)
            return 0;
    }
    return saw_meta;
}

static int
learn_direct(PyObject *samples)
{
    DirectLayout L = {.check_every = DIRECT_CHECK_EVERY, .until_check = DIRECT_CHECK_EVERY};
    int n = (int)PyList_GET_SIZE(samples);
    if (n < 4 || n > 64 || dl_read == NULL)
        return 0;
    Sample s[64];
    memset(s, 0, sizeof(s));
    Py_ssize_t basic = ((PyTypeObject *)H.tensor_type)->tp_basicsize;
    /* what DLPack and the getters say of each sample */
    for (int i = 0; i < n; i++) {
        PyObject *t = PyList_GET_ITEM(samples, i);
        if (Py_TYPE(t) != (PyTypeObject *)H.tensor_type)
            return 0;
        s[i].t = t;
        PyObject *meta = PyObject_GetAttrString(t, "is_meta");
        PyObject *offset = meta ? PyObject_CallMethod(t, "storage_offset", NULL) : NULL;
        s[i].meta = meta == Py_True;
        s[i].storage_offset = offset ? PyLong_AsLongLong(offset) : -1;
        Py_XDECREF(meta);
        Py_XDECREF(offset);
        if (PyErr_Occurred())
            return -1;
        if (!s[i].meta) {
            s[i].dl_ok = dl_read(t, &s[i].d) == 0 && s[i].d.device.device_type == DL_CPU;
            PyErr_Clear();
            if (!s[i].dl_ok)
                return 0;
        }
    }
    /* the TensorImpl pointer: where DLPack's shape array lies a little past it, in every sample */
    for (Py_ssize_t off = 16; off <= 24 && L.impl == 0; off += 8) {
        if (off + 8 > basic)
            break;
        Py_ssize_t sizes = -1;
        int ok = 1;
        for (int i = 0; i < n && ok; i++) {
            uintptr_t p = AT(s[i].t, off, uintptr_t);
            if (!plausible_pointer(p)) {
                ok = 0;
                break;
            }
            if (s[i].meta || s[i].d.ndim < 1)
                continue;
            intptr_t d = (intptr_t)s[i].d.shape - (intptr_t)p;
            if (d < 16 || d >= 512 || d % 8 || (sizes >= 0 && d != sizes))
                ok = 0;
            sizes = d;
        }
        if (ok && sizes > 0) {
            L.impl = off;
            L.sizes = sizes;
        }
    }
    if (L.impl == 0)
        return 0;
    for (int i = 0; i < n; i++)
        s[i].impl = AT(s[i].t, L.impl, const char *);
    L.impl_class = AT(s[0].impl, 0, const void *);
    L.strides = -1;
    for (int i = 0; i < n; i++) {
        if (AT(s[i].impl, 0, const void *) != L.impl_class)
            return 0;
        if (s[i].meta || s[i].d.ndim < 1)
            continue;
        if (s[i].d.strides == NULL)
            return 0;
        Py_ssize_t d = (const char *)s[i].d.strides - s[i].impl;
        if (d <= L.sizes || (L.strides >= 0 && d != L.strides))
            return 0;
        L.strides = d;
    }
    L.inline_dims = (L.strides - L.sizes) / 8;
    L.ndim = L.sizes - 8;
    if (L.strides < 0 || L.inline_dims < 2 || L.inline_dims > 8)
        return 0;
    int max_ndim = 0;
    for (int i = 0; i < n; i++) {
        if (!s[i].meta && AT(s[i].impl, L.ndim, uint64_t) != (uint64_t)s[i].d.ndim)
            return 0;
        if (!s[i].meta && s[i].d.ndim > max_ndim)
            max_ndim = s[i].d.ndim;
    }
    if (max_ndim < 2)
        return 0;
    /* past the sizes and strides: storage offset, then dtype, device and dispatch keys, all read
     * inside the FIELDS_SPAN bytes there (the object may end soon after them) */
    Py_ssize_t past = L.strides + 8 * L.inline_dims, end = past + FIELDS_SPAN;
    L.storage_offset = only_offset(s, n, past, past + 32, 8, fits_storage_offset);
    if (L.storage_offset < 0)
        return 0;
    L.dtype = only_offset(s, n, L.storage_offset + 8, end - 2 + 1, 2, fits_dtype);
    L.device = only_offset(s, n, L.storage_offset + 8, end - 3 + 1, 1, fits_device);
    if (L.dtype < 0 || L.device < 0)
        return 0;
    L.keys = (L.device + 3 + 7) / 8 * 8;
    if (L.keys + 8 > end)
        return 0;
    int have64 = 0, have32 = 0;
    for (int i = 0; i < n; i++) {
        if (s[i].meta)
            continue;
        if (is_index_dtype(&s[i].d, 64)) {
            L.dtype_i64 = AT(s[i].impl, L.dtype, uint16_t);
            have64 = 1;
        }
        if (is_index_dtype(&s[i].d, 32)) {
            L.dtype_i32 = AT(s[i].impl, L.dtype, uint16_t);
            have32 = 1;
        }
        if (is_index_dtype(&s[i].d, 64) || is_index_dtype(&s[i].d, 32)) {
            uint64_t keys = AT(s[i].impl, L.keys, uint64_t);
            int known = 0;
            for (int k = 0; k < L.n_keysets; k++)
                known |= L.keysets[k] == keys;
            if (!known) {
                if (L.n_keysets == DIRECT_MAX_KEYSETS)
                    return 0;
                L.keysets[L.n_keysets++] = keys;
            }
        }
    }
    if (!have64 || !have32 || L.dtype_i64 == L.dtype_i32)
        return 0;
    /* the data: the StorageImpl pointer, and the data pointer in it, where DLPack's data is */
    for (Py_ssize_t st = 16; st <= 24 && L.storage == 0; st += 8) {
        for (Py_ssize_t dp = 16; dp <= 24 && L.storage == 0; dp += 8) {
            int ok = 1, seen = 0;
            const void *storage_class = NULL;
            for (int i = 0; i < n && ok; i++) {
                if (s[i].meta)
                    continue;
                Py_ssize_t item = s[i].d.dtype.bits / 8;
                Py_ssize_t numel;
                contiguous_count(s[i].d.shape, s[i].d.strides, s[i].d.ndim, &numel);
                if (numel == 0 || item == 0)
                    continue;
                uintptr_t storage = AT(s[i].impl, st, uintptr_t);
                if (!plausible_pointer(storage)) {
                    ok = 0;
                    break;
                }
                const char *want = (const char *)s[i].d.data + s[i].d.byte_offset - s[i].storage_offset * item;
                const void *cls = AT(storage, 0, const void *);
                ok = AT(storage, dp, const char *) == want && (storage_class == NULL || cls == storage_class);
                storage_class = cls;
                seen++;
            }
            if (ok && seen >= 3) {
                L.storage = st;
                L.data = dp;
                L.storage_class = storage_class;
            }
        }
    }
    if (L.storage == 0)
        return 0;
    /* every sample, read both ways: what DLPack reads, this reads the same; what DLPack declines
     * (another dtype, not contiguous) or cannot describe (meta), this leaves to it */
    L.on = 1;
    DirectLayout saved = DIRECT;
    DIRECT = L;
    for (int i = 0; i < n; i++) {
        Ints a, b;
        ints_clear(&a);
        ints_clear(&b);
        int ra = read_ints_direct(s[i].t, &a);
        int rb = s[i].meta ? -1 : read_ints_dlpack(s[i].t, &b);
        PyErr_Clear();
        if (rb == 1 ? !(ra == 1 && same_ints(&a, &b)) : ra != -2) {
            DIRECT = saved;
            return 0;
        }
    }
    return 1;
}

int
read_ints(PyObject *t, Ints *out)
{
    ints_clear(out);
    if (H.tensor_type == NULL || Py_TYPE(t) != (PyTypeObject *)H.tensor_type)
        return 0;
    int rc = -1;
    if (DIRECT.on) {
        rc = read_ints_direct(t, out);
        if (rc == 1)
            DIRECT.reads++;
        if (rc == 1 && --DIRECT.until_check == 0) {
            DIRECT.until_check = DIRECT.check_every;
            Ints check;
            ints_clear(&check);
            DIRECT.checked++;
            if (read_ints_dlpack(t, &check) != 1 || !same_ints(out, &check)) {
                PyErr_Clear();
                DIRECT.mismatches++;
                DIRECT.on = 0; /* a layout we misread: DLPack from now on */
                rc = -1;
            }
        }
        if (rc != 1) {
            rc = -1;
            ints_clear(out);
        }
    }
    if (rc < 0 && dl_read != NULL) {
        rc = read_ints_dlpack(t, out);
        if (rc < 0) {
            PyErr_Clear(); /* a tensor DLPack cannot describe (a meta tensor): torch's own getters say */
            ints_clear(out);
        }
    }
    if (rc < 0)
        rc = read_ints_getters(t, out);
    if (rc == 1 && out->n == 1) { /* one element: read like the others (EACH_INT), from `one` */
        out->data = &out->one;
        out->itemsize = 8;
    }
    return rc;
}

int
read_device_ints(PyObject *t, int device_type, int device_id, const void **data, Py_ssize_t *n, int *itemsize)
{
    if (dl_read == NULL || H.tensor_type == NULL || Py_TYPE(t) != (PyTypeObject *)H.tensor_type)
        return 0;
    DlTensor d;
    int rc = dl_index(t, &d, n);
    if (rc < 0)
        PyErr_Clear();
    if (rc <= 0 || d.device.device_type != device_type || d.device.device_id != device_id)
        return 0;
    *itemsize = d.dtype.bits / 8;
    *data = (const char *)d.data + d.byte_offset;
    return 1;
}

/* ------------------------------------------------------------------ the readers compared, and set up */

/* Both readers on one tensor: whether they agree (a result, or both declining). */
static int
readers_agree(PyObject *t)
{
    Ints a, b;
    ints_clear(&a);
    ints_clear(&b);
    int ra = read_ints_dlpack(t, &a);
    if (ra < 0) {
        PyErr_Clear();
        ints_clear(&b);
        return !DIRECT.on || read_ints_direct(t, &b) == -2; /* declined: read_ints asks the getters */
    }
    if (DIRECT.on) {
        int rd = read_ints_direct(t, &b);
        if (rd != -2 && !(ra == 1 && rd == 1 && same_ints(&a, &b))) /* -2: it asks DLPack */
            return 0;
        ints_clear(&b);
    }
    int rb = read_ints_getters(t, &b);
    if (rb < 0) {
        PyErr_Clear();
        return 0;
    }
    if (ra != rb)
        return 0;
    if (ra == 0)
        return 1;
    return a.n == b.n && a.itemsize == b.itemsize && a.data == b.data && a.one == b.one;
}

/* torch's DLPack reader, if its table is one this file knows and it reads every sample as the
 * getters do; NULL otherwise (the getters then read every tensor). */
static DLTensorFromPy
dlpack_reader(PyObject *tensor_type, PyObject *samples)
{
    PyObject *capsule = PyObject_GetAttrString(tensor_type, "__dlpack_c_exchange_api__");
    if (capsule == NULL) {
        PyErr_Clear();
        return NULL;
    }
    DlExchangeAPI *api = PyCapsule_IsValid(capsule, "dlpack_exchange_api")
                             ? (DlExchangeAPI *)PyCapsule_GetPointer(capsule, "dlpack_exchange_api")
                             : NULL;
    Py_DECREF(capsule);
    if (api == NULL || api->header.version.major != 1 || api->dltensor_from_py_object_no_sync == NULL) {
        PyErr_Clear();
        return NULL;
    }
    DLTensorFromPy saved = dl_read;
    dl_read = api->dltensor_from_py_object_no_sync;
    int agree = samples != NULL && PyList_Check(samples) && PyList_GET_SIZE(samples) > 0;
    for (Py_ssize_t i = 0; agree && i < PyList_GET_SIZE(samples); i++) {
        PyObject *t = PyList_GET_ITEM(samples, i);
        agree = Py_TYPE(t) == (PyTypeObject *)tensor_type && readers_agree(t);
    }
    dl_read = saved;
    return agree ? api->dltensor_from_py_object_no_sync : NULL;
}

PyObject *
m_readers_agree(PyObject *Py_UNUSED(module), PyObject *t)
{
    if (dl_read == NULL || H.tensor_type == NULL || Py_TYPE(t) != (PyTypeObject *)H.tensor_type) {
        PyErr_SetString(PyExc_ValueError, "the DLPack reader is not in use, or not a tensor");
        return NULL;
    }
    return PyBool_FromLong(readers_agree(t));
}

/* Tests: the learned layout misreads from now on (int64 taken for int32 and back: the same bytes,
 * in bounds, the wrong element size), as a torch we misunderstood would; the next compared read
 * must turn the in-place reader off. */
PyObject *
m_direct_misread(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    uint16_t i64 = DIRECT.dtype_i64;
    DIRECT.dtype_i64 = DIRECT.dtype_i32;
    DIRECT.dtype_i32 = i64;
    Py_RETURN_NONE;
}

PyObject *
m_read_in_place(PyObject *Py_UNUSED(module), PyObject *t)
{
    Ints v;
    ints_clear(&v);
    int tensor = H.tensor_type != NULL && Py_TYPE(t) == (PyTypeObject *)H.tensor_type;
    return PyBool_FromLong(DIRECT.on && tensor && read_ints_direct(t, &v) == 1);
}

/* torch.Tensor, torch.int64 and torch.int32; the samples every reader is checked on before use. */
PyObject *
m_set_torch(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *t, *i64, *i32, *samples = NULL;
    int use_dlpack = 1, use_direct = 1;
    if (!PyArg_ParseTuple(args, "OOO|Opp", &t, &i64, &i32, &samples, &use_dlpack, &use_direct))
        return NULL;
    if (!PyType_Check(t)) {
        PyErr_SetString(PyExc_TypeError, "tensor type expected");
        return NULL;
    }
    Py_XSETREF(H.tensor_type, Py_NewRef(t));
    Py_XSETREF(H.dtype_int64, Py_NewRef(i64));
    Py_XSETREF(H.dtype_int32, Py_NewRef(i32));
    dl_read = use_dlpack ? dlpack_reader(t, samples) : NULL;
    DIRECT.on = 0;
    if (dl_read != NULL && use_direct && samples != NULL && PyList_Check(samples) && learn_direct(samples) < 0)
        return NULL;
    return PyBool_FromLong(dl_read != NULL);
}

PyObject *
m_direct_check_every(PyObject *Py_UNUSED(module), PyObject *every)
{
    long n = PyLong_AsLong(every);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    DIRECT.check_every = n >= 1 ? (unsigned long)n : DIRECT_CHECK_EVERY;
    DIRECT.until_check = DIRECT.check_every;
    Py_RETURN_NONE;
}

TensorReaderStats
tensor_reader_stats(void)
{
    TensorReaderStats s = {dl_read != NULL, DIRECT.on, DIRECT.reads, DIRECT.checked, DIRECT.mismatches};
    return s;
}
