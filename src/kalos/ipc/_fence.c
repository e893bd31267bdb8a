/* A sequentially consistent memory fence, callable from Python; and a sleep with little
 * timer slack.
 *
 * CPython exposes no fence. Kalos orders its shared-memory channel with one: see
 * kalos/ipc/sync.py for the argument. The compiler builtin emits MFENCE (or a locked
 * instruction) on x86-64 and DMB ISH on aarch64, and also stops the C compiler from
 * moving memory accesses across the call.
 *
 * A client that naps while its answer is computed (kalos/ipc/channel.py, ClientChannel._nap)
 * is woken by its own timer. Linux may postpone such a timer by the thread's timer slack
 * (50 us by default) to batch wake-ups, which would make every nap that much late.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#ifdef __linux__
#include <sys/prctl.h>
#include <time.h>
#define KALOS_HAVE_PRECISE_SLEEP 1
#endif

static PyObject *
fence_full(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

#ifdef KALOS_HAVE_PRECISE_SLEEP
static PyObject *
precise_sleep(PyObject *self, PyObject *args)
{
    double seconds;
    (void)self;
    if (!PyArg_ParseTuple(args, "d", &seconds))
        return NULL;
    if (!(seconds >= 0.0 && seconds <= 1.0)) {
        PyErr_SetString(PyExc_ValueError, "precise_sleep: seconds must be in [0, 1]");
        return NULL;
    }
    struct timespec duration;
    duration.tv_sec = (time_t)seconds;
    duration.tv_nsec = (long)((seconds - (double)duration.tv_sec) * 1e9);
    Py_BEGIN_ALLOW_THREADS
    /* The slack is the calling thread's own setting: set for this sleep, then put back. */
    int slack = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
    clock_nanosleep(CLOCK_MONOTONIC, 0, &duration, NULL);
    if (slack > 0)
        prctl(PR_SET_TIMERSLACK, (unsigned long)slack, 0, 0, 0);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}
#endif

static PyMethodDef fence_methods[] = {
    {"full", fence_full, METH_NOARGS,
     "full()\n--\n\nA sequentially consistent fence: no load or store moves across it."},
#ifdef KALOS_HAVE_PRECISE_SLEEP
    {"precise_sleep", precise_sleep, METH_VARARGS,
     "precise_sleep(seconds)\n--\n\nSleeps for seconds (0 to 1) with 1 us of timer slack instead of "
     "the thread's own (50 us by default), which is put back after."},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fence_module = {
    PyModuleDef_HEAD_INIT, "kalos.ipc._fence",
    "A sequentially consistent memory fence for the shared-memory channel.", -1, fence_methods,
};

PyMODINIT_FUNC
PyInit__fence(void)
{
    return PyModule_Create(&fence_module);
}
