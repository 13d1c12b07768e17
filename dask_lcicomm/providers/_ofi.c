/* The libfabric calls of the ofi provider (providers/ofi_fabric.py).
 *
 * libfabric's data-path calls (fi_tsend, fi_trecvmsg, fi_cq_read, ...) are
 * static inline functions over the provider's ops tables: no foreign-function
 * interface can call them, a compiled module must. This one is a plain C
 * extension, built like the shm provider's _atomics: an optional extension
 * of the package, compiled against the libfabric headers found at install
 * time, with no build or run-time dependency besides libfabric itself. The
 * compiler checks every call against the site's own headers.
 *
 * Endpoint   one FI_EP_RDM endpoint with tagged messages, an address vector
 *            (FI_AV_TABLE) for its peers and one completion queue whose
 *            wait object is a descriptor (FI_WAIT_FD), for sends and
 *            receives. Every operation carries a 64-bit id, which its
 *            completion returns. An operation owns its context and, until
 *            it completes, a buffer view of the memory it reads or writes,
 *            so that the memory cannot be freed under libfabric; close()
 *            frees the operations left. Where the provider has RMA (asked
 *            for with rma=True), memory registered for remote reads
 *            (register) lets peers read a large buffer in place (read), so
 *            that a NIC moves it without a copy; a registration holds a
 *            view of its buffer until unregister() or close().
 *
 * Calls are serialised by the caller (FI_THREAD_DOMAIN); none blocks.
 *
 * The process's signal handlers are the application's, but some libraries
 * that libfabric links take them as they load or initialise: Debian's
 * libfabric links libinfinipath (for its psm provider), whose constructor
 * installs handlers for SIGTERM, SIGINT, SIGSEGV, SIGBUS, SIGILL and
 * SIGABRT, whatever provider is asked for; Dask's graceful close on
 * SIGTERM, Python's KeyboardInterrupt and faulthandler would be gone. So
 * libfabric is not linked but loaded by this module's init (dlopen), and
 * loading it, opening and closing an endpoint put back every handler that
 * changed; restored_signals() says which. The few functions libfabric
 * exports (the rest are inline over ops tables) are looked up then.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_tagged.h>

#define POLL_BATCH 64
/* How long closing an endpoint waits for the operations in flight. */
#define DRAIN_NS (100 * 1000 * 1000L)
#define LIBFABRIC "libfabric.so.1"

/* libfabric's exported functions, looked up when the module loads. */
static struct {
    int (*getinfo)(uint32_t, const char *, const char *, uint64_t, const struct fi_info *,
                   struct fi_info **);
    void (*freeinfo)(struct fi_info *);
    struct fi_info *(*dupinfo)(const struct fi_info *);
    int (*fabric)(struct fi_fabric_attr *, struct fid_fabric **, void *);
    const char *(*strerror)(int);
    uint32_t (*version)(void);
} lib;

/* Bit s: signal s's handler was changed by libfabric and put back. */
static uint64_t restored;

typedef struct op {
    struct fi_context2 context; /* first: libfabric hands it back */
    struct op *prev, *next;
    uint64_t id;
    int peek;
    int has_view;
    Py_buffer view;
} op;

/* Memory registered for peers' reads. */
typedef struct reg {
    struct reg *prev, *next;
    struct fid_mr *mr;
    Py_buffer view;
} reg;

typedef struct {
    PyObject_HEAD
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_cq *cq;
    struct fid_av *av;
    struct fid_ep *ep;
    int fd;
    size_t addrlen; /* the length of an address: the endpoint's own */
    op ops;       /* sentinel of the operations in flight */
    op *claimed;  /* the message a peek claimed, until receive() takes it */
    reg regs;     /* sentinel of the registrations */
    int rma;      /* whether the endpoint reads peers' registered memory */
    uint64_t next_key; /* the key asked for next, where the provider takes ours */
} Endpoint;

typedef struct {
    struct sigaction action[NSIG];
    int known[NSIG];
} dispositions;

static void dispositions_save(dispositions *d) {
    for (int s = 1; s < NSIG; s++)
        d->known[s] = sigaction(s, NULL, &d->action[s]) == 0;
}

/* Put back each handler that differs from `d`. */
static void dispositions_restore(const dispositions *d) {
    for (int s = 1; s < NSIG && s < 64; s++) {
        struct sigaction now;
        if (!d->known[s] || sigaction(s, NULL, &now) != 0)
            continue;
        if ((void *)now.sa_handler == (void *)d->action[s].sa_handler &&
            now.sa_flags == d->action[s].sa_flags)
            continue;
        if (sigaction(s, &d->action[s], NULL) == 0)
            restored |= (uint64_t)1 << s;
    }
}

static PyObject *fi_error(int code, const char *what) {
    /* code: a negative FI_E* (libfabric's errno values are errno's) */
    PyObject *e = PyObject_CallFunction(PyExc_OSError, "is", -code, lib.strerror(-code));
    if (e) {
        PyObject *message = PyUnicode_FromFormat("%s: %s", what, lib.strerror(-code));
        if (message) {
            PyObject_SetAttrString(e, "strerror", message);
            Py_DECREF(message);
        }
        PyErr_SetObject(PyExc_OSError, e);
        Py_DECREF(e);
    }
    return NULL;
}

static op *op_new(Endpoint *self, uint64_t id) {
    op *o = PyMem_Calloc(1, sizeof *o);
    if (!o) {
        PyErr_NoMemory();
        return NULL;
    }
    o->id = id;
    o->next = self->ops.next;
    o->prev = &self->ops;
    self->ops.next->prev = o;
    self->ops.next = o;
    return o;
}

static void op_free(op *o) {
    o->prev->next = o->next;
    o->next->prev = o->prev;
    if (o->has_view)
        PyBuffer_Release(&o->view);
    PyMem_Free(o);
}

static int drained(const Endpoint *self) {
    const op *first = self->ops.next;
    return first == &self->ops || (first == self->claimed && first->next == &self->ops);
}

static void drain_free(Endpoint *self, op *o) {
    if (o == self->claimed)
        self->claimed = NULL;
    op_free(o);
}

/* Cancel what can be cancelled and give the rest a bounded time to finish:
   libfabric 1.17's tcp;ofi_rxm crashed in fi_close (SIGSEGV) when an
   endpoint closed under an 8 MiB send still in flight (11 of 25 runs of a
   test of tests/providers/test_base.py; none in 20 with this). */
static void endpoint_drain(Endpoint *self) {
    for (op *o = self->ops.next; o != &self->ops; o = o->next)
        if (o != self->claimed)
            fi_cancel(&self->ep->fid, &o->context);
    struct timespec start, now, pause = {0, 20 * 1000};
    clock_gettime(CLOCK_MONOTONIC, &start);
    struct fi_cq_tagged_entry entries[POLL_BATCH];
    while (!drained(self)) {
        ssize_t got = fi_cq_read(self->cq, entries, POLL_BATCH);
        for (ssize_t i = 0; i < got; i++)
            if (entries[i].op_context)
                drain_free(self, entries[i].op_context);
        if (got == -FI_EAVAIL) {
            struct fi_cq_err_entry err = {0};
            if (fi_cq_readerr(self->cq, &err, 0) == 1 && err.op_context)
                drain_free(self, err.op_context);
        }
        if (got > 0 || got == -FI_EAVAIL)
            continue;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if ((now.tv_sec - start.tv_sec) * 1000000000L + (now.tv_nsec - start.tv_nsec) > DRAIN_NS)
            return;
        nanosleep(&pause, NULL);
    }
}

static void reg_free(reg *r) {
    r->prev->next = r->next;
    r->next->prev = r->prev;
    fi_close(&r->mr->fid);
    PyBuffer_Release(&r->view);
    PyMem_Free(r);
}

static void endpoint_close_all(Endpoint *self) {
    /* Closing the endpoint cancels what it had posted; then no completion
       can name an operation any more, and they are freed. */
    dispositions saved;
    dispositions_save(&saved);
    if (self->ep && self->cq)
        endpoint_drain(self);
    while (self->regs.next && self->regs.next != &self->regs)
        reg_free(self->regs.next);
    if (self->ep) fi_close(&self->ep->fid);
    if (self->av) fi_close(&self->av->fid);
    if (self->cq) fi_close(&self->cq->fid);
    if (self->domain) fi_close(&self->domain->fid);
    if (self->fabric) fi_close(&self->fabric->fid);
    if (self->info) lib.freeinfo(self->info);
    self->ep = NULL;
    self->av = NULL;
    self->cq = NULL;
    self->domain = NULL;
    self->fabric = NULL;
    self->info = NULL;
    dispositions_restore(&saved);
    while (self->ops.next != &self->ops)
        op_free(self->ops.next);
    self->claimed = NULL;
}

static int check_open(Endpoint *self) {
    if (self->ep)
        return 1;
    PyErr_SetString(PyExc_ValueError, "the endpoint is closed");
    return 0;
}

static int endpoint_open(Endpoint *self, const char *provider, const char *node, int rma);

static int Endpoint_init(Endpoint *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"provider", "node", "rma", NULL};
    const char *provider = NULL, *node = NULL;
    int rma = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|zzp", kwlist, &provider, &node, &rma))
        return -1;
    if (self->ep) {
        PyErr_SetString(PyExc_ValueError, "the endpoint is open already");
        return -1;
    }
    dispositions saved;
    dispositions_save(&saved);
    int r = endpoint_open(self, provider, node, rma);
    dispositions_restore(&saved);
    return r;
}

/* fi_getinfo for a tagged RDM endpoint, with reads of peers' memory if
   `rma`; 0 or a negative FI_E*. */
static int endpoint_info(Endpoint *self, const char *provider, const char *node, int rma) {
    struct fi_info *hints = lib.dupinfo(NULL);
    if (!hints)
        return -FI_ENOMEM;
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_TAGGED | (rma ? FI_RMA | FI_READ | FI_REMOTE_READ : 0);
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->domain_attr->threading = FI_THREAD_SAFE;
    /* No local registration: sends, receives and reads name plain memory;
       only memory that peers read is registered, bound to the endpoint
       where the provider asks for it (cxi). */
    hints->domain_attr->mr_mode = FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
    if (provider && *provider)
        hints->fabric_attr->prov_name = strdup(provider);
    int r = lib.getinfo(FI_VERSION(1, 9), node, node ? "0" : NULL, node ? FI_SOURCE : 0, hints,
                       &self->info);
    lib.freeinfo(hints);
    if (r)
        self->info = NULL;
    return r;
}

static int endpoint_open(Endpoint *self, const char *provider, const char *node, int rma) {
    self->ops.next = self->ops.prev = &self->ops;
    self->regs.next = self->regs.prev = &self->regs;
    self->next_key = 1;
    /* A provider without RMA still serves, by sends alone. */
    int r = rma ? endpoint_info(self, provider, node, 1) : -FI_ENODATA;
    self->rma = !r;
    if (r)
        r = endpoint_info(self, provider, node, 0);
    if (r) {
        fi_error(r, "fi_getinfo: no libfabric provider for tagged messages on a reliable endpoint");
        return -1;
    }
    struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_TAGGED, .wait_obj = FI_WAIT_FD};
    struct fi_av_attr av_attr = {.type = FI_AV_TABLE};
    const char *what = "fi_fabric";
    if ((r = lib.fabric(self->info->fabric_attr, &self->fabric, NULL)))
        goto fail;
    what = "fi_domain";
    if ((r = fi_domain(self->fabric, self->info, &self->domain, NULL)))
        goto fail;
    what = "fi_cq_open (a completion queue with a descriptor to wait on)";
    if ((r = fi_cq_open(self->domain, &cq_attr, &self->cq, NULL)))
        goto fail;
    what = "fi_av_open";
    if ((r = fi_av_open(self->domain, &av_attr, &self->av, NULL)))
        goto fail;
    what = "fi_endpoint";
    if ((r = fi_endpoint(self->domain, self->info, &self->ep, NULL)))
        goto fail;
    what = "fi_ep_bind";
    if ((r = fi_ep_bind(self->ep, &self->cq->fid, FI_TRANSMIT | FI_RECV)))
        goto fail;
    if ((r = fi_ep_bind(self->ep, &self->av->fid, 0)))
        goto fail;
    what = "fi_enable";
    if ((r = fi_enable(self->ep)))
        goto fail;
    what = "FI_GETWAIT";
    if ((r = fi_control(&self->cq->fid, FI_GETWAIT, &self->fd)))
        goto fail;
    char name[1024];
    self->addrlen = sizeof name;
    what = "fi_getname";
    if ((r = fi_getname(&self->ep->fid, name, &self->addrlen)))
        goto fail;
    return 0;
fail:
    endpoint_close_all(self);
    fi_error(r, what);
    return -1;
}

static void Endpoint_dealloc(Endpoint *self) {
    if (self->ops.next)
        endpoint_close_all(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Endpoint_close(Endpoint *self, PyObject *unused) {
    if (self->ops.next)
        endpoint_close_all(self);
    Py_RETURN_NONE;
}

static PyObject *Endpoint_fileno(Endpoint *self, PyObject *unused) {
    if (!check_open(self))
        return NULL;
    return PyLong_FromLong(self->fd);
}

static PyObject *Endpoint_name(Endpoint *self, PyObject *unused) {
    if (!check_open(self))
        return NULL;
    char addr[1024];
    size_t len = sizeof addr;
    int r = fi_getname(&self->ep->fid, addr, &len);
    if (r)
        return fi_error(r, "fi_getname");
    return PyBytes_FromStringAndSize(addr, (Py_ssize_t)len);
}

static PyObject *Endpoint_provider(Endpoint *self, void *unused) {
    if (!check_open(self))
        return NULL;
    return PyUnicode_FromString(self->info->fabric_attr->prov_name);
}

static PyObject *Endpoint_rma(Endpoint *self, void *unused) {
    if (!check_open(self))
        return NULL;
    return PyBool_FromLong(self->rma);
}

static PyObject *Endpoint_max_message(Endpoint *self, void *unused) {
    if (!check_open(self))
        return NULL;
    return PyLong_FromSize_t(self->info->ep_attr->max_msg_size);
}

static PyObject *Endpoint_insert(Endpoint *self, PyObject *arg) {
    Py_buffer address;
    if (!check_open(self) || PyObject_GetBuffer(arg, &address, PyBUF_SIMPLE))
        return NULL;
    /* fi_av_insert reads an address of the fabric's format: check the
       length first (an address comes from a peer's hello). */
    if ((size_t)address.len != self->addrlen) {
        PyBuffer_Release(&address);
        return PyErr_Format(PyExc_ValueError, "a %zd-byte address; this fabric's have %zu",
                            address.len, self->addrlen);
    }
    fi_addr_t at = FI_ADDR_NOTAVAIL;
    int n = fi_av_insert(self->av, address.buf, 1, &at, 0, NULL);
    PyBuffer_Release(&address);
    if (n != 1)
        return fi_error(n < 0 ? n : -FI_EINVAL, "fi_av_insert");
    return PyLong_FromUnsignedLongLong(at);
}

static PyObject *Endpoint_remove(Endpoint *self, PyObject *arg) {
    fi_addr_t at = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred() || !check_open(self))
        return NULL;
    int r = fi_av_remove(self->av, &at, 1, 0);
    if (r)
        return fi_error(r, "fi_av_remove");
    Py_RETURN_NONE;
}

/* send(buffer, peer, tag, id) -> bool: False when the fabric answers
   -FI_EAGAIN (retry after progress). */
static PyObject *Endpoint_send(Endpoint *self, PyObject *args) {
    PyObject *buffer;
    unsigned long long peer, tag, id;
    if (!PyArg_ParseTuple(args, "OKKK", &buffer, &peer, &tag, &id) || !check_open(self))
        return NULL;
    op *o = op_new(self, id);
    if (!o)
        return NULL;
    if (PyObject_GetBuffer(buffer, &o->view, PyBUF_SIMPLE)) {
        op_free(o);
        return NULL;
    }
    o->has_view = 1;
    ssize_t r = fi_tsend(self->ep, o->view.buf, (size_t)o->view.len, NULL, peer, tag, o);
    if (r) {
        op_free(o);
        if (r == -FI_EAGAIN)
            Py_RETURN_FALSE;
        return fi_error((int)r, "fi_tsend");
    }
    Py_RETURN_TRUE;
}

static ssize_t post_claim(Endpoint *self, op *o, void *buf, size_t len, uint64_t flags) {
    struct iovec iov = {.iov_base = buf, .iov_len = len};
    struct fi_msg_tagged msg = {.msg_iov = len ? &iov : NULL, .iov_count = len ? 1 : 0,
                                .addr = FI_ADDR_UNSPEC, .tag = 0, .ignore = ~0ULL, .context = o};
    return fi_trecvmsg(self->ep, &msg, flags);
}

/* peek(id) -> bool: look for an unexpected message and claim it. Its
   completion (poll) carries the tag, the length and the claim for
   receive(); an FI_ENOMSG error completion when there is none. False when
   the fabric answers -FI_EAGAIN. */
static PyObject *Endpoint_peek(Endpoint *self, PyObject *arg) {
    uint64_t id = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred() || !check_open(self))
        return NULL;
    if (self->claimed)
        return PyErr_Format(PyExc_ValueError, "a claimed message waits for receive()");
    op *o = op_new(self, id);
    if (!o)
        return NULL;
    o->peek = 1;
    ssize_t r = post_claim(self, o, NULL, 0, FI_PEEK | FI_CLAIM);
    if (r) {
        op_free(o);
        if (r == -FI_EAGAIN)
            Py_RETURN_FALSE;
        return fi_error((int)r, "fi_trecvmsg (peek)");
    }
    Py_RETURN_TRUE;
}

/* receive(buffer, id, claim) -> bool: receive the message a peek claimed
   into ``buffer`` (writable); FI_CLAIM names it by the peek's context. */
static PyObject *Endpoint_receive(Endpoint *self, PyObject *args) {
    PyObject *buffer;
    unsigned long long id, claim;
    if (!PyArg_ParseTuple(args, "OKK", &buffer, &id, &claim) || !check_open(self))
        return NULL;
    op *o = self->claimed;
    if (!o || (uint64_t)(uintptr_t)o != claim)
        return PyErr_Format(PyExc_ValueError, "no claimed message %llu", claim);
    if (PyObject_GetBuffer(buffer, &o->view, PyBUF_WRITABLE))
        return NULL;
    o->has_view = 1;
    o->id = id;
    o->peek = 0;
    self->claimed = NULL;
    ssize_t r = post_claim(self, o, o->view.buf, (size_t)o->view.len, FI_CLAIM);
    if (r) {
        PyBuffer_Release(&o->view);
        o->has_view = 0;
        o->peek = 1;
        self->claimed = o;
        if (r == -FI_EAGAIN)
            Py_RETURN_FALSE;
        return fi_error((int)r, "fi_trecvmsg (claim)");
    }
    Py_RETURN_TRUE;
}

/* The key to ask for, where the provider takes ours: counted within the
   provider's key size (cxi's are 16 bits), never 0. */
static uint64_t next_key(Endpoint *self) {
    size_t size = self->info->domain_attr->mr_key_size;
    uint64_t mask = size && size < 8 ? ((uint64_t)1 << (8 * size)) - 1 : ~(uint64_t)0;
    uint64_t key = self->next_key++ & mask;
    if (!key)
        key = self->next_key++ & mask;
    return key;
}

/* register(buffer) -> (handle, address, key): let peers read ``buffer``
   (read(), on their side) until unregister(handle). */
static PyObject *Endpoint_register(Endpoint *self, PyObject *arg) {
    if (!check_open(self))
        return NULL;
    if (!self->rma)
        return PyErr_Format(PyExc_ValueError, "the endpoint has no RMA");
    reg *r = PyMem_Calloc(1, sizeof *r);
    if (!r)
        return PyErr_NoMemory();
    if (PyObject_GetBuffer(arg, &r->view, PyBUF_SIMPLE)) {
        PyMem_Free(r);
        return NULL;
    }
    uint64_t mode = self->info->domain_attr->mr_mode;
    const char *what = "fi_mr_reg";
    int e = fi_mr_reg(self->domain, r->view.buf, (size_t)r->view.len, FI_REMOTE_READ, 0,
                      mode & FI_MR_PROV_KEY ? 0 : next_key(self), 0, &r->mr, NULL);
    if (!e && mode & FI_MR_ENDPOINT) {
        what = "fi_mr_bind";
        if (!(e = fi_mr_bind(r->mr, &self->ep->fid, 0))) {
            what = "fi_mr_enable";
            e = fi_mr_enable(r->mr);
        }
        if (e)
            fi_close(&r->mr->fid);
    }
    if (e) {
        PyBuffer_Release(&r->view);
        PyMem_Free(r);
        return fi_error(e, what);
    }
    r->next = self->regs.next;
    r->prev = &self->regs;
    self->regs.next->prev = r;
    self->regs.next = r;
    /* Peers name the memory by its address, or by the offset in it. */
    uint64_t address = mode & FI_MR_VIRT_ADDR ? (uint64_t)(uintptr_t)r->view.buf : 0;
    return Py_BuildValue("(KKK)", (unsigned long long)(uintptr_t)r, (unsigned long long)address,
                         (unsigned long long)fi_mr_key(r->mr));
}

static PyObject *Endpoint_unregister(Endpoint *self, PyObject *arg) {
    uintptr_t handle = (uintptr_t)PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred() || !check_open(self))
        return NULL;
    for (reg *r = self->regs.next; r != &self->regs; r = r->next) {
        if ((uintptr_t)r == handle) {
            reg_free(r);
            Py_RETURN_NONE;
        }
    }
    return PyErr_Format(PyExc_ValueError, "no registration %llu", (unsigned long long)handle);
}

/* read(buffer, peer, address, key, id) -> bool: read what ``peer``
   registered at ``address`` with ``key`` into ``buffer`` (writable); False
   when the fabric answers -FI_EAGAIN. */
static PyObject *Endpoint_read(Endpoint *self, PyObject *args) {
    PyObject *buffer;
    unsigned long long peer, address, key, id;
    if (!PyArg_ParseTuple(args, "OKKKK", &buffer, &peer, &address, &key, &id) || !check_open(self))
        return NULL;
    if (!self->rma)
        return PyErr_Format(PyExc_ValueError, "the endpoint has no RMA");
    op *o = op_new(self, id);
    if (!o)
        return NULL;
    if (PyObject_GetBuffer(buffer, &o->view, PyBUF_WRITABLE)) {
        op_free(o);
        return NULL;
    }
    o->has_view = 1;
    ssize_t r = fi_read(self->ep, o->view.buf, (size_t)o->view.len, NULL, peer, address, key, o);
    if (r) {
        op_free(o);
        if (r == -FI_EAGAIN)
            Py_RETURN_FALSE;
        return fi_error((int)r, "fi_read");
    }
    Py_RETURN_TRUE;
}

/* poll() -> [(id, length, tag, error, claim)]: the completions queued, at
   most POLL_BATCH; ``error`` a positive FI_E* or 0, ``claim`` a successful
   peek's claim or 0. */
static PyObject *Endpoint_poll(Endpoint *self, PyObject *unused) {
    if (!check_open(self))
        return NULL;
    struct fi_cq_tagged_entry entries[POLL_BATCH];
    ssize_t got = fi_cq_read(self->cq, entries, POLL_BATCH);
    if (got == -FI_EAGAIN)
        return PyList_New(0);
    if (got == -FI_EAVAIL) {
        struct fi_cq_err_entry err = {0};
        if (fi_cq_readerr(self->cq, &err, 0) != 1)
            return PyList_New(0);
        op *o = err.op_context;
        unsigned long long id = o ? o->id : 0;
        if (o)
            op_free(o);
        return Py_BuildValue("[(KnKii)]", id, (Py_ssize_t)err.len, (unsigned long long)err.tag,
                             err.err ? err.err : FI_EOTHER, 0);
    }
    if (got < 0)
        return fi_error((int)got, "fi_cq_read");
    PyObject *list = PyList_New(got);
    if (!list)
        return NULL;
    for (ssize_t i = 0; i < got; i++) {
        op *o = entries[i].op_context;
        unsigned long long id = o ? o->id : 0, claim = 0;
        if (o && o->peek) {
            self->claimed = o; /* receive() takes it */
            claim = (uintptr_t)o;
        } else if (o) {
            op_free(o);
        }
        PyObject *item = Py_BuildValue("(KnKiK)", id, (Py_ssize_t)entries[i].len,
                                       (unsigned long long)entries[i].tag, 0, claim);
        if (!item) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, item);
    }
    return list;
}

/* trywait() -> bool: True when nothing is pending, so that the caller may
   sleep on fileno() (libfabric's condition for waiting on the descriptor). */
static PyObject *Endpoint_trywait(Endpoint *self, PyObject *unused) {
    if (!check_open(self))
        return NULL;
    struct fid *fids[1] = {&self->cq->fid};
    return PyBool_FromLong(fi_trywait(self->fabric, fids, 1) == FI_SUCCESS);
}

static PyObject *Endpoint_inflight(Endpoint *self, PyObject *unused) {
    Py_ssize_t n = 0;
    if (self->ops.next)
        for (op *p = self->ops.next; p != &self->ops; p = p->next)
            n++;
    return PyLong_FromSsize_t(n);
}

static PyMethodDef Endpoint_methods[] = {
    {"close", (PyCFunction)Endpoint_close, METH_NOARGS, "Close the endpoint; free what it had posted."},
    {"fileno", (PyCFunction)Endpoint_fileno, METH_NOARGS, "The completion queue's wait descriptor."},
    {"name", (PyCFunction)Endpoint_name, METH_NOARGS, "The endpoint's address, for peers' insert()."},
    {"insert", (PyCFunction)Endpoint_insert, METH_O, "A peer's address into the address vector."},
    {"remove", (PyCFunction)Endpoint_remove, METH_O, "A peer out of the address vector."},
    {"send", (PyCFunction)Endpoint_send, METH_VARARGS, "send(buffer, peer, tag, id) -> posted"},
    {"peek", (PyCFunction)Endpoint_peek, METH_O, "peek(id) -> posted"},
    {"receive", (PyCFunction)Endpoint_receive, METH_VARARGS, "receive(buffer, id, claim) -> posted"},
    {"register", (PyCFunction)Endpoint_register, METH_O, "register(buffer) -> (handle, address, key)"},
    {"unregister", (PyCFunction)Endpoint_unregister, METH_O, "unregister(handle)"},
    {"read", (PyCFunction)Endpoint_read, METH_VARARGS, "read(buffer, peer, address, key, id) -> posted"},
    {"poll", (PyCFunction)Endpoint_poll, METH_NOARGS, "The completions queued."},
    {"trywait", (PyCFunction)Endpoint_trywait, METH_NOARGS, "Whether the caller may sleep now."},
    {"inflight", (PyCFunction)Endpoint_inflight, METH_NOARGS, "Operations not yet completed."},
    {NULL},
};

static PyGetSetDef Endpoint_getset[] = {
    {"provider", (getter)Endpoint_provider, NULL, "The libfabric provider's name.", NULL},
    {"max_message", (getter)Endpoint_max_message, NULL, "The longest message.", NULL},
    {"rma", (getter)Endpoint_rma, NULL, "Whether peers' registered memory can be read.", NULL},
    {NULL},
};

static PyTypeObject EndpointType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dask_lcicomm.providers._ofi.Endpoint",
    .tp_basicsize = sizeof(Endpoint),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An FI_EP_RDM endpoint with tagged messages and a completion queue.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Endpoint_init,
    .tp_dealloc = (destructor)Endpoint_dealloc,
    .tp_methods = Endpoint_methods,
    .tp_getset = Endpoint_getset,
};

static PyObject *version(PyObject *module, PyObject *unused) {
    uint32_t v = lib.version();
    return Py_BuildValue("(ii)", FI_MAJOR(v), FI_MINOR(v));
}

static PyObject *restored_signals(PyObject *module, PyObject *unused) {
    PyObject *signals = PyList_New(0);
    for (int s = 1; signals && s < 64; s++) {
        if (!(restored & ((uint64_t)1 << s)))
            continue;
        PyObject *number = PyLong_FromLong(s);
        if (!number || PyList_Append(signals, number) < 0)
            Py_CLEAR(signals);
        Py_XDECREF(number);
    }
    if (!signals)
        return NULL;
    PyObject *result = PyList_AsTuple(signals);
    Py_DECREF(signals);
    return result;
}

static PyMethodDef module_methods[] = {
    {"version", version, METH_NOARGS, "The version of the libfabric loaded."},
    {"restored_signals", restored_signals, METH_NOARGS,
     "The signals whose handlers libfabric changed and that were put back."},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_ofi", "libfabric's calls for the ofi provider.", -1, module_methods,
};

/* Load libfabric and look up its functions (ImportError naming the cause). */
static int load_libfabric(void) {
    dispositions saved;
    dispositions_save(&saved);
    void *handle = dlopen(LIBFABRIC, RTLD_NOW | RTLD_GLOBAL);
    dispositions_restore(&saved);
    if (!handle) {
        PyErr_Format(PyExc_ImportError, "cannot load %s: %s", LIBFABRIC, dlerror());
        return -1;
    }
    struct { void **slot; const char *name; } symbols[] = {
        {(void **)&lib.getinfo, "fi_getinfo"}, {(void **)&lib.freeinfo, "fi_freeinfo"},
        {(void **)&lib.dupinfo, "fi_dupinfo"}, {(void **)&lib.fabric, "fi_fabric"},
        {(void **)&lib.strerror, "fi_strerror"}, {(void **)&lib.version, "fi_version"},
    };
    for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; i++) {
        if (!(*symbols[i].slot = dlsym(handle, symbols[i].name))) {
            PyErr_Format(PyExc_ImportError, "%s has no %s", LIBFABRIC, symbols[i].name);
            dlclose(handle);
            return -1;
        }
    }
    return 0;
}

PyMODINIT_FUNC PyInit__ofi(void) {
    if (!lib.getinfo && load_libfabric() < 0)
        return NULL;
    if (PyType_Ready(&EndpointType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&EndpointType);
    if (PyModule_AddObject(m, "Endpoint", (PyObject *)&EndpointType) < 0
        || PyModule_AddIntConstant(m, "ENOMSG", FI_ENOMSG) < 0
        || PyModule_AddIntConstant(m, "ECANCELED", FI_ECANCELED) < 0) {
        Py_DECREF(&EndpointType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
