/* The native pieces of the shared-memory channel, callable from Python.
 *
 * full(): a sequentially consistent memory fence. CPython exposes no fence. Kalos orders its
 * shared-memory channel with one: see kalos/ipc/sync.py for the argument. The compiler builtin
 * emits MFENCE (or a locked instruction) on x86-64 and DMB ISH on aarch64, and also stops the C
 * compiler from moving memory accesses across the call.
 *
 * spin_pending(): the sweep's wait for the next request, without the GIL. A sweep that spins
 * in Python holds the interpreter lock between its looks; a control thread (a client's hello,
 * an add, a get) that wants it then waits for the interpreter's switch interval (5 ms), since
 * the sweep takes the lock back before the waiting thread wakes. Here the looks run with the
 * lock released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sched.h>
#include <stdint.h>
#include <time.h>

static PyObject *
fence_full(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static int64_t
monotonic_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
}

/* A 1-d buffer of ``n`` items of ``itemsize`` bytes (any stride), or an error naming ``what``. */
static int
get_column(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_STRIDES) < 0)
        return -1;
    if (view->ndim != 1 || view->itemsize != itemsize) {
        PyErr_Format(PyExc_ValueError, "%s must be a 1-d array of %zd-byte items", what, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *
fence_spin_pending(PyObject *self, PyObject *args)
{
    PyObject *req_obj, *answered_obj, *active_obj, *busy_obj;
    long long timeout_ns;
    Py_buffer req, answered, active, busy;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOL", &req_obj, &answered_obj, &active_obj, &busy_obj, &timeout_ns))
        return NULL;
    if (get_column(req_obj, &req, 8, "req_seq") < 0)
        return NULL;
    if (get_column(answered_obj, &answered, 8, "answered") < 0) {
        PyBuffer_Release(&req);
        return NULL;
    }
    if (get_column(active_obj, &active, 1, "active") < 0) {
        PyBuffer_Release(&req);
        PyBuffer_Release(&answered);
        return NULL;
    }
    if (get_column(busy_obj, &busy, 1, "busy") < 0) {
        PyBuffer_Release(&req);
        PyBuffer_Release(&answered);
        PyBuffer_Release(&active);
        return NULL;
    }
    int found = 0;
    if (req.shape[0] != answered.shape[0] || req.shape[0] != active.shape[0] || req.shape[0] != busy.shape[0]) {
        PyErr_SetString(PyExc_ValueError, "req_seq, answered, active and busy must have one item per slot");
        found = -1;
    } else {
        const Py_ssize_t n = req.shape[0];
        const char *req_at = req.buf, *answered_at = answered.buf, *active_at = active.buf, *busy_at = busy.buf;
        const Py_ssize_t req_step = req.strides[0], answered_step = answered.strides[0],
                         active_step = active.strides[0], busy_step = busy.strides[0];
        Py_BEGIN_ALLOW_THREADS
        const int64_t until = monotonic_ns() + timeout_ns;
        for (;;) {
            for (Py_ssize_t i = 0; i < n && !found; i++) {
                /* req_seq is another process's word: one atomic 8-byte load. The buffers stay
                 * mapped while held here (an mmap with exports cannot be closed). */
                if (active_at[i * active_step] && !busy_at[i * busy_step]
                    && __atomic_load_n((const uint64_t *)(req_at + i * req_step), __ATOMIC_RELAXED)
                           != *(const uint64_t *)(answered_at + i * answered_step))
                    found = 1;
            }
            if (found || monotonic_ns() >= until)
                break;
            sched_yield(); /* the core to the clients meanwhile, as the sweep's own spin did */
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&req);
    PyBuffer_Release(&answered);
    PyBuffer_Release(&active);
    PyBuffer_Release(&busy);
    if (found < 0)
        return NULL;
    return PyBool_FromLong(found);
}

static PyMethodDef fence_methods[] = {
    {"full", fence_full, METH_NOARGS,
     "full()\n--\n\nA sequentially consistent fence: no load or store moves across it."},
    {"spin_pending", fence_spin_pending, METH_VARARGS,
     "spin_pending(req_seq, answered, active, busy, timeout_ns)\n--\n\n"
     "Looks at the slots' words, the GIL released, until a slot that is active and not busy has\n"
     "a req_seq other than what was answered (True) or timeout_ns have passed (False); yields\n"
     "the core between looks."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fence_module = {
    PyModuleDef_HEAD_INIT, "kalos.ipc._fence",
    "The native pieces of the shared-memory channel: a memory fence, the sweep's spin.", -1, fence_methods,
};

PyMODINIT_FUNC
PyInit__fence(void)
{
    return PyModule_Create(&fence_module);
}
