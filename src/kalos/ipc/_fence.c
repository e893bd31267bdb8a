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
 *
 * spin_changed(): the same for the sweep while a GPU kernel serves the slots: it waits, without
 * the GIL, until one of the words the kernel writes for the host changes (a round began, took,
 * handed over, answered, stopped).
 *
 * same_rows(), pending_slots(), publish_slots(): the sweep's per-pass reads and writes of the
 * slots' words, which in NumPy are a dozen calls on arrays of a few dozen items, each costing
 * more in the call than in the work (issue 18: the sweep's share of a crowd's pass). The
 * layout stays kalos.ipc.protocol's: every word is reached through the strided views it
 * declares (SlotColumns), passed in by the caller.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
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
get_column_for(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *what, int writable)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_STRIDES | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (view->ndim != 1 || view->itemsize != itemsize) {
        PyErr_Format(PyExc_ValueError, "%s must be a 1-d array of %zd-byte items", what, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    /* Items are read (some atomically) in one access each: they must sit at their size's alignment. */
    if ((uintptr_t)view->buf % (uintptr_t)itemsize != 0 || view->strides[0] % itemsize != 0) {
        PyErr_Format(PyExc_ValueError, "%s must be aligned to its %zd-byte items", what, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int
get_column(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *what)
{
    return get_column_for(obj, view, itemsize, what, 0);
}

/* Whether a buffer's items are 8-byte integers, signed or not, by its struct format code
 * ('q'/'Q'; NumPy's 'l'/'L' on LP64 are the same), a byte-order prefix aside. */
static int
is_int64_format(const Py_buffer *view, int is_signed)
{
    const char *format = view->format ? view->format : "B";
    char code = format[0] == '<' || format[0] == '=' || format[0] == '@' ? format[1] : format[0];
    return view->itemsize == 8 && (is_signed ? (code == 'l' || code == 'q') : (code == 'L' || code == 'Q'));
}

/* ``view`` of ``obj``: a writable contiguous 1-d buffer of at least ``n`` 8-byte integers. */
static int
get_out(PyObject *obj, Py_buffer *view, Py_ssize_t n, int is_signed, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
        return -1;
    int ok_code = is_int64_format(view, is_signed);
    if (view->ndim != 1 || view->itemsize != 8 || !ok_code || view->shape[0] < n) {
        PyErr_Format(PyExc_ValueError, "%s must be a writable 1-d %s array of at least %zd items", what,
                     is_signed ? "int64" : "uint64", n);
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
        /* (clamped: a timeout past a century would overflow the deadline) */
        const int64_t until = monotonic_ns() + (timeout_ns < 0 ? 0 : timeout_ns > 3155760000000000000LL
                                                                   ? 3155760000000000000LL : timeout_ns);
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

static PyObject *
fence_spin_changed(PyObject *self, PyObject *args)
{
    PyObject *words_obj, *seen_obj;
    long long timeout_ns;
    Py_buffer words, seen;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOL", &words_obj, &seen_obj, &timeout_ns))
        return NULL;
    if (get_column(words_obj, &words, 8, "words") < 0)
        return NULL;
    if (get_column(seen_obj, &seen, 8, "seen") < 0) {
        PyBuffer_Release(&words);
        return NULL;
    }
    int changed = 0;
    if (words.shape[0] != seen.shape[0]) {
        PyErr_SetString(PyExc_ValueError, "words and seen must have as many items");
        changed = -1;
    } else {
        const Py_ssize_t n = words.shape[0], words_step = words.strides[0], seen_step = seen.strides[0];
        const char *words_at = words.buf, *seen_at = seen.buf;
        Py_BEGIN_ALLOW_THREADS
        const int64_t until = monotonic_ns() + (timeout_ns < 0 ? 0 : timeout_ns > 3155760000000000000LL
                                                                   ? 3155760000000000000LL : timeout_ns);
        for (;;) {
            /* words: written by another agent (a GPU kernel over the bus): one atomic 8-byte load each,
             * acquire, so that what the caller reads next is not older than the change it saw. */
            for (Py_ssize_t i = 0; i < n && !changed; i++)
                if (__atomic_load_n((const uint64_t *)(words_at + i * words_step), __ATOMIC_ACQUIRE)
                    != *(const uint64_t *)(seen_at + i * seen_step))
                    changed = 1;
            if (changed || monotonic_ns() >= until)
                break;
            sched_yield();
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&words);
    PyBuffer_Release(&seen);
    if (changed < 0)
        return NULL;
    return PyBool_FromLong(changed);
}

/* ``view`` of ``obj``: a 1-d buffer of ``itemsize``-byte items, or a 2-d one whose rows are
 * contiguous items (a column of SlotColumns); ``row_bytes`` is set to the bytes of one row. */
static int
get_rows(PyObject *obj, Py_buffer *view, Py_ssize_t *row_bytes, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_STRIDES) < 0)
        return -1;
    if (view->ndim == 1) {
        *row_bytes = view->itemsize;
        return 0;
    }
    if (view->ndim == 2 && view->strides[1] == view->itemsize) {
        *row_bytes = view->shape[1] * view->itemsize;
        return 0;
    }
    PyErr_Format(PyExc_ValueError, "%s must be a 1-d array or a 2-d array of contiguous rows", what);
    PyBuffer_Release(view);
    return -1;
}

/* ``view`` of ``obj``: a contiguous 1-d int64 array of slot indices, each in [0, rows). */
static int
get_slots(PyObject *obj, Py_buffer *view, Py_ssize_t rows, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (view->ndim != 1 || !is_int64_format(view, 1)) {
        PyErr_Format(PyExc_ValueError, "%s must be a 1-d int64 array", what);
        PyBuffer_Release(view);
        return -1;
    }
    const int64_t *at = view->buf;
    for (Py_ssize_t i = 0; i < view->shape[0]; i++) {
        if (at[i] < 0 || at[i] >= rows) {
            PyErr_Format(PyExc_ValueError, "%s holds slot %lld, outside [0, %zd)", what, (long long)at[i], rows);
            PyBuffer_Release(view);
            return -1;
        }
    }
    return 0;
}

#define ROW(view, i) ((char *)(view).buf + (Py_ssize_t)(i) * (view).strides[0])

/* The most bytes of a row same_rows compares (a slot's namespace, the widest, is 256). */
#define MAX_ROW_BYTES 1024

static PyObject *
fence_same_rows(PyObject *self, PyObject *args)
{
    PyObject *column_obj, *slots_obj, *out_obj = Py_None;
    Py_buffer column, slots, out;
    Py_ssize_t row_bytes;
    (void)self;
    if (!PyArg_ParseTuple(args, "OO|O", &column_obj, &slots_obj, &out_obj))
        return NULL;
    if (get_rows(column_obj, &column, &row_bytes, "column") < 0)
        return NULL;
    if (row_bytes > MAX_ROW_BYTES) {
        PyErr_Format(PyExc_ValueError, "column rows of %zd bytes: same_rows compares at most %d", row_bytes,
                     MAX_ROW_BYTES);
        PyBuffer_Release(&column);
        return NULL;
    }
    if (get_slots(slots_obj, &slots, column.shape[0], "slots") < 0) {
        PyBuffer_Release(&column);
        return NULL;
    }
    if (out_obj != Py_None) {
        if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
            PyBuffer_Release(&column);
            PyBuffer_Release(&slots);
            return NULL;
        }
        if (out.len < row_bytes) {
            PyErr_Format(PyExc_ValueError, "out must hold a row's %zd bytes", row_bytes);
            PyBuffer_Release(&out);
            PyBuffer_Release(&column);
            PyBuffer_Release(&slots);
            return NULL;
        }
    }
    /* Every row, the first's included, is compared with one copy of the first: the words the
     * caller then reads (out) are those every slot held, even if a client rewrites its own
     * meanwhile. */
    const int64_t *at = slots.buf;
    unsigned char first[MAX_ROW_BYTES];
    int same = 1;
    if (slots.shape[0] > 0) {
        memcpy(first, ROW(column, at[0]), (size_t)row_bytes);
        for (Py_ssize_t i = 0; i < slots.shape[0] && same; i++)
            same = memcmp(first, ROW(column, at[i]), (size_t)row_bytes) == 0;
        if (out_obj != Py_None)
            memcpy(out.buf, first, (size_t)row_bytes);
    }
    if (out_obj != Py_None)
        PyBuffer_Release(&out);
    PyBuffer_Release(&column);
    PyBuffer_Release(&slots);
    return PyBool_FromLong(same);
}

static PyObject *
fence_pending_slots(PyObject *self, PyObject *args)
{
    PyObject *req_obj, *answered_obj, *active_obj, *busy_obj, *slots_obj, *seqs_obj;
    Py_buffer req, answered, active, busy, slots_out, seqs_out;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOOO", &req_obj, &answered_obj, &active_obj, &busy_obj, &slots_obj, &seqs_obj))
        return NULL;
    if (get_column(req_obj, &req, 8, "req_seq") < 0)
        return NULL;
    Py_buffer *held[6] = {&req, NULL, NULL, NULL, NULL, NULL};
    int n_held = 1;
    Py_ssize_t found = -1;
    if (get_column(answered_obj, &answered, 8, "answered") < 0)
        goto done;
    held[n_held++] = &answered;
    if (get_column(active_obj, &active, 1, "active") < 0)
        goto done;
    held[n_held++] = &active;
    if (get_column(busy_obj, &busy, 1, "busy") < 0)
        goto done;
    held[n_held++] = &busy;
    const Py_ssize_t n = req.shape[0];
    if (answered.shape[0] != n || active.shape[0] != n || busy.shape[0] != n) {
        PyErr_SetString(PyExc_ValueError, "req_seq, answered, active and busy must have one item per slot");
        goto done;
    }
    if (get_out(slots_obj, &slots_out, n, 1, "slots_out") < 0)
        goto done;
    held[n_held++] = &slots_out;
    if (get_out(seqs_obj, &seqs_out, n, 0, "seqs_out") < 0)
        goto done;
    held[n_held++] = &seqs_out;
    int64_t *slot_at = slots_out.buf;
    uint64_t *seq_at = seqs_out.buf;
    found = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!*ROW(active, i) || *ROW(busy, i))
            continue;
        const uint64_t seq = __atomic_load_n((const uint64_t *)ROW(req, i), __ATOMIC_RELAXED);
        if (seq != *(const uint64_t *)ROW(answered, i)) {
            slot_at[found] = i;
            seq_at[found] = seq;
            found++;
        }
    }
    /* acquire: req_seq was read before the request's fields and rows (kalos/ipc/sync.py) */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
done:
    for (int i = 0; i < n_held; i++)
        PyBuffer_Release(held[i]);
    if (found < 0)
        return NULL;
    return PyLong_FromSsize_t(found);
}

static PyObject *
fence_publish_slots(PyObject *self, PyObject *args)
{
    PyObject *slots_obj, *seqs_obj, *generations_obj, *generation_obj, *resp_obj, *answered_obj, *woken_obj,
        *sleeping_obj, *out_obj;
    Py_buffer slots, seqs, generations, generation, resp, answered, woken, sleeping, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOOOOOO", &slots_obj, &seqs_obj, &generations_obj, &generation_obj, &resp_obj,
                          &answered_obj, &woken_obj, &sleeping_obj, &out_obj))
        return NULL;
    Py_buffer *held[9];
    int n_held = 0;
    Py_ssize_t woke = -1;
    if (get_column_for(resp_obj, &resp, 8, "resp_seq", 1) < 0)
        goto done;
    held[n_held++] = &resp;
    const Py_ssize_t n_slots = resp.shape[0];
    if (get_slots(slots_obj, &slots, n_slots, "slots") < 0)
        goto done;
    held[n_held++] = &slots;
    if (get_column(seqs_obj, &seqs, 8, "seqs") < 0)
        goto done;
    held[n_held++] = &seqs;
    const int checked = generations_obj != Py_None;
    if (checked) {
        if (get_column(generations_obj, &generations, 8, "generations") < 0)
            goto done;
        held[n_held++] = &generations;
    }
    if (get_column(generation_obj, &generation, 8, "generation") < 0)
        goto done;
    held[n_held++] = &generation;
    if (get_column_for(answered_obj, &answered, 8, "answered", 1) < 0)
        goto done;
    held[n_held++] = &answered;
    if (get_column_for(woken_obj, &woken, 8, "woken", 1) < 0)
        goto done;
    held[n_held++] = &woken;
    if (get_column(sleeping_obj, &sleeping, 4, "client_sleeping") < 0)
        goto done;
    held[n_held++] = &sleeping;
    const Py_ssize_t n = slots.shape[0];
    if (seqs.shape[0] != n || (checked && generations.shape[0] != n) || generation.shape[0] != n_slots
        || answered.shape[0] != n_slots || woken.shape[0] != n_slots || sleeping.shape[0] != n_slots) {
        PyErr_SetString(PyExc_ValueError, "seqs (and generations) must have one item per slot published, generation, "
                                          "answered, woken and client_sleeping one per slot");
        goto done;
    }
    if (get_out(out_obj, &out, n, 1, "out") < 0)
        goto done;
    held[n_held++] = &out;
    const int64_t *at = slots.buf;
    int64_t *woke_at = out.buf;
    /* release: the answers' fields and rows before resp_seq (kalos/ipc/sync.py) */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint64_t seq = *(const uint64_t *)ROW(seqs, i);
        if (checked && *(const uint64_t *)ROW(generation, at[i]) != *(const uint64_t *)ROW(generations, i))
            continue; /* the client left (and maybe another came) while its pass ran */
        __atomic_store_n((uint64_t *)ROW(resp, at[i]), seq, __ATOMIC_RELAXED);
        *(uint64_t *)ROW(answered, at[i]) = seq;
        *(uint64_t *)ROW(woken, at[i]) = seq;
    }
    /* store resp_seq, then load client_sleeping (Dekker, kalos/ipc/sync.py) */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    woke = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (checked && *(const uint64_t *)ROW(generation, at[i]) != *(const uint64_t *)ROW(generations, i))
            continue;
        if (__atomic_load_n((const uint32_t *)ROW(sleeping, at[i]), __ATOMIC_RELAXED))
            woke_at[woke++] = at[i];
    }
done:
    for (int i = 0; i < n_held; i++)
        PyBuffer_Release(held[i]);
    if (woke < 0)
        return NULL;
    return PyLong_FromSsize_t(woke);
}

static PyMethodDef fence_methods[] = {
    {"full", fence_full, METH_NOARGS,
     "full()\n--\n\nA sequentially consistent fence: no load or store moves across it."},
    {"spin_pending", fence_spin_pending, METH_VARARGS,
     "spin_pending(req_seq, answered, active, busy, timeout_ns)\n--\n\n"
     "Looks at the slots' words, the GIL released, until a slot that is active and not busy has\n"
     "a req_seq other than what was answered (True) or timeout_ns have passed (False); yields\n"
     "the core between looks."},
    {"spin_changed", fence_spin_changed, METH_VARARGS,
     "spin_changed(words, seen, timeout_ns)\n--\n\n"
     "Looks at words (1-d, 8-byte items, written by another agent), the GIL released, until one\n"
     "differs from its item of seen (True) or timeout_ns have passed (False); yields the core\n"
     "between looks."},
    {"same_rows", fence_same_rows, METH_VARARGS,
     "same_rows(column, slots, out=None)\n--\n\n"
     "Whether the rows of column (a 1-d array, or 2-d with contiguous rows) at slots (int64) are\n"
     "all equal byte for byte to one copy of the first (True for no slot); that copy goes into\n"
     "out (a writable buffer of a row's bytes) when given."},
    {"pending_slots", fence_pending_slots, METH_VARARGS,
     "pending_slots(req_seq, answered, active, busy, slots_out, seqs_out)\n--\n\n"
     "Writes each slot that is active, not busy, and whose req_seq differs from answered into\n"
     "slots_out (int64), its req_seq into seqs_out (uint64), in slot order; returns how many.\n"
     "Then a full fence (acquire)."},
    {"publish_slots", fence_publish_slots, METH_VARARGS,
     "publish_slots(slots, seqs, generations, generation, resp_seq, answered, woken, client_sleeping, out)\n--\n\n"
     "A full fence (release), then resp_seq, answered and woken := seqs at slots (skipping a slot\n"
     "whose generation is no longer its entry of generations, unless generations is None), a full\n"
     "fence (Dekker), then writes the published slots whose client_sleeping is set into out;\n"
     "returns how many."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fence_module = {
    PyModuleDef_HEAD_INIT, "kalos.ipc._fence",
    "The native pieces of the shared-memory channel: a memory fence, the sweep's spin and its per-pass words.", -1, fence_methods,
};

PyMODINIT_FUNC
PyInit__fence(void)
{
    return PyModule_Create(&fence_module);
}
