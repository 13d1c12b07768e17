/* Shared-memory primitives for the shm provider, with C11 atomics.
 *
 * Python has no memory-ordering operations, and plain stores through a
 * memoryview may be reordered by the CPU on weakly ordered machines
 * (aarch64, POWER): a reader could see a ring's tail advance before the bytes
 * it covers. Every word that publishes data between processes is therefore
 * read and written here, with acquire/release ordering, and the sleep/wake
 * handshake uses sequentially consistent fences (see providers/shm_ring.py
 * for the protocol and why it is correct).
 *
 * Region   a writable buffer (an mmap of a memfd) with atomic 64-bit loads,
 *          stores and exchanges at 8-byte aligned offsets, and bulk copies
 *          that release the GIL. map_shared() maps a descriptor into a new
 *          Region that owns the mapping and holds no descriptor (Python's
 *          mmap keeps a duplicate of it open): the mapping goes when the
 *          Region and every Lease of it are freed. discard() gives whole
 *          pages back to the OS (MADV_REMOVE): the next touch finds zeros.
 * Lease    a slice of a Region exported through the buffer protocol. When
 *          the last object using it (memoryview, numpy array, ...) is freed,
 *          it stores 1 with release ordering into its flag word: the writer
 *          that owns the pool may then reuse the memory.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* Copies at least this large run without the GIL. */
#define NOGIL_COPY_BYTES (64 * 1024)

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int has_view;
    int owns_mapping;   /* view.buf came from map_shared(): munmap it */
} RegionObject;

typedef struct {
    PyObject_HEAD
    RegionObject *region;
    char *data;
    Py_ssize_t nbytes;
    _Atomic uint64_t *flag;
} LeaseObject;

static PyTypeObject RegionType;
static PyTypeObject LeaseType;

static int
region_check(RegionObject *self, Py_ssize_t offset, Py_ssize_t nbytes)
{
    if (!self->has_view) {
        PyErr_SetString(PyExc_ValueError, "region is not initialised");
        return -1;
    }
    if (offset < 0 || nbytes < 0 || offset > self->view.len - nbytes) {
        PyErr_Format(PyExc_IndexError,
                     "%zd bytes at offset %zd are outside a region of %zd bytes",
                     nbytes, offset, self->view.len);
        return -1;
    }
    return 0;
}

static _Atomic uint64_t *
region_word(RegionObject *self, Py_ssize_t offset)
{
    if (offset % 8) {
        PyErr_Format(PyExc_ValueError, "offset %zd is not 8-byte aligned", offset);
        return NULL;
    }
    if (region_check(self, offset, 8) < 0)
        return NULL;
    return (_Atomic uint64_t *)((char *)self->view.buf + offset);
}

static int
Region_init(RegionObject *self, PyObject *args, PyObject *kwds)
{
    PyObject *obj;
    static char *kwlist[] = {"buffer", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O", kwlist, &obj))
        return -1;
    if (self->has_view) {
        PyErr_SetString(PyExc_ValueError, "region is already initialised");
        return -1;
    }
    if (PyObject_GetBuffer(obj, &self->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    self->has_view = 1;
    if ((uintptr_t)self->view.buf % 8) {
        PyErr_SetString(PyExc_ValueError, "region buffer is not 8-byte aligned");
        return -1;
    }
    return 0;
}

static void
Region_dealloc(RegionObject *self)
{
    if (self->owns_mapping)
        munmap(self->view.buf, (size_t)self->view.len);
    else if (self->has_view)
        PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
Region_load(RegionObject *self, PyObject *arg)
{
    Py_ssize_t offset = PyLong_AsSsize_t(arg);
    if (offset == -1 && PyErr_Occurred())
        return NULL;
    _Atomic uint64_t *word = region_word(self, offset);
    if (word == NULL)
        return NULL;
    return PyLong_FromUnsignedLongLong(atomic_load_explicit(word, memory_order_acquire));
}

/* Parse (offset, value) and find the word; NULL with an exception set on error. */
static _Atomic uint64_t *
word_and_value(RegionObject *self, PyObject *args, uint64_t *value)
{
    Py_ssize_t offset;
    unsigned long long v;
    if (!PyArg_ParseTuple(args, "nK", &offset, &v))
        return NULL;
    *value = (uint64_t)v;
    return region_word(self, offset);
}

static PyObject *
Region_store(RegionObject *self, PyObject *args)
{
    uint64_t value;
    _Atomic uint64_t *word = word_and_value(self, args, &value);
    if (word == NULL)
        return NULL;
    atomic_store_explicit(word, value, memory_order_release);
    Py_RETURN_NONE;
}

static PyObject *
Region_exchange(RegionObject *self, PyObject *args)
{
    uint64_t value;
    _Atomic uint64_t *word = word_and_value(self, args, &value);
    if (word == NULL)
        return NULL;
    return PyLong_FromUnsignedLongLong(atomic_exchange_explicit(word, value, memory_order_seq_cst));
}

static void
copy_bytes(char *dst, const char *src, Py_ssize_t nbytes)
{
    if (nbytes >= NOGIL_COPY_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        memcpy(dst, src, (size_t)nbytes);
        Py_END_ALLOW_THREADS
    }
    else if (nbytes) {
        memcpy(dst, src, (size_t)nbytes);
    }
}

static PyObject *
Region_write(RegionObject *self, PyObject *args)
{
    Py_ssize_t offset;
    Py_buffer src;
    if (!PyArg_ParseTuple(args, "ny*", &offset, &src))
        return NULL;
    if (region_check(self, offset, src.len) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    copy_bytes((char *)self->view.buf + offset, src.buf, src.len);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

static PyObject *
Region_read_into(RegionObject *self, PyObject *args)
{
    Py_ssize_t offset;
    Py_buffer dst;
    if (!PyArg_ParseTuple(args, "nw*", &offset, &dst))
        return NULL;
    if (region_check(self, offset, dst.len) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    copy_bytes(dst.buf, (char *)self->view.buf + offset, dst.len);
    PyBuffer_Release(&dst);
    Py_RETURN_NONE;
}

static PyObject *
Region_lease(RegionObject *self, PyObject *args)
{
    Py_ssize_t offset, nbytes, flag_offset;
    if (!PyArg_ParseTuple(args, "nnn", &offset, &nbytes, &flag_offset))
        return NULL;
    if (region_check(self, offset, nbytes) < 0)
        return NULL;
    _Atomic uint64_t *flag = region_word(self, flag_offset);
    if (flag == NULL)
        return NULL;
    if (flag_offset < offset + nbytes && offset < flag_offset + 8) {
        PyErr_SetString(PyExc_ValueError, "a lease may not cover its own flag");
        return NULL;
    }
    LeaseObject *lease = PyObject_New(LeaseObject, &LeaseType);
    if (lease == NULL)
        return NULL;
    Py_INCREF(self);
    lease->region = self;
    lease->data = (char *)self->view.buf + offset;
    lease->nbytes = nbytes;
    lease->flag = flag;
    return (PyObject *)lease;
}

static PyObject *
Region_discard(RegionObject *self, PyObject *args)
{
    Py_ssize_t offset, nbytes;
    if (!PyArg_ParseTuple(args, "nn", &offset, &nbytes))
        return NULL;
    if (region_check(self, offset, nbytes) < 0)
        return NULL;
    char *start = (char *)self->view.buf + offset;
    long page = sysconf(_SC_PAGESIZE);
    if ((uintptr_t)start % page || nbytes % page) {
        PyErr_Format(PyExc_ValueError,
                     "%zd bytes at offset %zd are not whole pages", nbytes, offset);
        return NULL;
    }
    int rc = 0;
    if (nbytes) {
        Py_BEGIN_ALLOW_THREADS
        rc = madvise(start, (size_t)nbytes, MADV_REMOVE);
        Py_END_ALLOW_THREADS
    }
    if (rc)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyObject *
Region_len(RegionObject *self, void *closure)
{
    return PyLong_FromSsize_t(self->has_view ? self->view.len : 0);
}

static PyMethodDef Region_methods[] = {
    {"load", (PyCFunction)Region_load, METH_O,
     "load(offset) -> int: the 64-bit word at offset, with acquire ordering."},
    {"store", (PyCFunction)Region_store, METH_VARARGS,
     "store(offset, value): write the 64-bit word at offset, with release ordering."},
    {"exchange", (PyCFunction)Region_exchange, METH_VARARGS,
     "exchange(offset, value) -> int: swap the word, sequentially consistent."},
    {"write", (PyCFunction)Region_write, METH_VARARGS,
     "write(offset, data): copy a contiguous buffer in (without the GIL when large)."},
    {"read_into", (PyCFunction)Region_read_into, METH_VARARGS,
     "read_into(offset, buffer): fill a writable buffer from the region."},
    {"lease", (PyCFunction)Region_lease, METH_VARARGS,
     "lease(offset, nbytes, flag_offset) -> Lease: the bytes as a buffer; when the"
     " lease is freed, 1 is stored (release) at flag_offset."},
    {"discard", (PyCFunction)Region_discard, METH_VARARGS,
     "discard(offset, nbytes): give these whole pages back to the OS; they read as"
     " zeros until written again."},
    {NULL}
};

static PyGetSetDef Region_getset[] = {
    {"nbytes", (getter)Region_len, NULL, "size of the region in bytes", NULL},
    {NULL}
};

static PyTypeObject RegionType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dask_lcicomm.providers._atomics.Region",
    .tp_doc = "Region(buffer): atomic words and copies over a writable shared buffer.",
    .tp_basicsize = sizeof(RegionObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Region_init,
    .tp_dealloc = (destructor)Region_dealloc,
    .tp_methods = Region_methods,
    .tp_getset = Region_getset,
};

static int
Lease_getbuffer(LeaseObject *self, Py_buffer *view, int flags)
{
    return PyBuffer_FillInfo(view, (PyObject *)self, self->data, self->nbytes, 0, flags);
}

static PyBufferProcs Lease_as_buffer = {
    .bf_getbuffer = (getbufferproc)Lease_getbuffer,
};

static void
Lease_dealloc(LeaseObject *self)
{
    /* Every access to the leased bytes happened before this point; the
     * release store makes them visible before the owner sees the flag. */
    atomic_store_explicit(self->flag, 1, memory_order_release);
    Py_DECREF(self->region);
    PyObject_Free(self);
}

static Py_ssize_t
Lease_length(LeaseObject *self)
{
    return self->nbytes;
}

static PySequenceMethods Lease_as_sequence = {
    .sq_length = (lenfunc)Lease_length,
};

static PyTypeObject LeaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dask_lcicomm.providers._atomics.Lease",
    .tp_doc = "Bytes of a Region lent to a reader; freeing the lease returns them.",
    .tp_basicsize = sizeof(LeaseObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Lease_dealloc,
    .tp_as_buffer = &Lease_as_buffer,
    .tp_as_sequence = &Lease_as_sequence,
};

static PyObject *
atomics_fence(PyObject *module, PyObject *unused)
{
    atomic_thread_fence(memory_order_seq_cst);
    Py_RETURN_NONE;
}

static PyObject *
atomics_map_shared(PyObject *module, PyObject *args)
{
    int fd;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(args, "in", &fd, &nbytes))
        return NULL;
    if (nbytes <= 0) {
        PyErr_Format(PyExc_ValueError, "cannot map %zd bytes", nbytes);
        return NULL;
    }
    RegionObject *region = (RegionObject *)PyType_GenericNew(&RegionType, NULL, NULL);
    if (region == NULL)
        return NULL;
    void *data;
    Py_BEGIN_ALLOW_THREADS
    data = mmap(NULL, (size_t)nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    Py_END_ALLOW_THREADS
    if (data == MAP_FAILED) {
        Py_DECREF(region);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    region->view.buf = data;
    region->view.len = nbytes;
    region->view.readonly = 0;
    region->view.itemsize = 1;
    region->has_view = 1;
    region->owns_mapping = 1;
    return (PyObject *)region;
}

static PyMethodDef module_methods[] = {
    {"fence", atomics_fence, METH_NOARGS, "fence(): a sequentially consistent memory fence."},
    {"map_shared", atomics_map_shared, METH_VARARGS,
     "map_shared(fd, nbytes) -> Region: map the first nbytes of fd shared and writable;"
     " the Region keeps no descriptor and unmaps when it and its leases are freed."},
    {NULL}
};

static struct PyModuleDef atomics_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "dask_lcicomm.providers._atomics",
    .m_doc = "Atomic words, fences and leased buffers over shared memory.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__atomics(void)
{
    if (PyType_Ready(&RegionType) < 0 || PyType_Ready(&LeaseType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&atomics_module);
    if (module == NULL)
        return NULL;
    Py_INCREF(&RegionType);
    if (PyModule_AddObject(module, "Region", (PyObject *)&RegionType) < 0) {
        Py_DECREF(&RegionType);
        Py_DECREF(module);
        return NULL;
    }
    Py_INCREF(&LeaseType);
    if (PyModule_AddObject(module, "Lease", (PyObject *)&LeaseType) < 0) {
        Py_DECREF(&LeaseType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
