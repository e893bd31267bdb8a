/* A sequentially consistent memory fence, callable from Python.
 *
 * CPython exposes no fence. Kalos orders its shared-memory channel with one: see
 * kalos/ipc/sync.py for the argument. The compiler builtin emits MFENCE (or a locked
 * instruction) on x86-64 and DMB ISH on aarch64, and also stops the C compiler from
 * moving memory accesses across the call.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *
fence_full(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyMethodDef fence_methods[] = {
    {"full", fence_full, METH_NOARGS,
     "full()\n--\n\nA sequentially consistent fence: no load or store moves across it."},
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
