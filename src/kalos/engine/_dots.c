/* The CPU engine's scores for a pass of a few queries: every row read from memory once.
 *
 * A crowd of agents on a CPU sidecar turns into passes of 2 to 64 queries. OpenBLAS multiplies
 * such a narrow batch by the tall matrix of rows no faster than a wide one: it first copies
 * (packs) the whole matrix, then runs a kernel shaped for many columns, and a pass of 2 to 16
 * costs 3 to 5 mat-vecs (benchmarks/small_batch.py --device cpu --numpy). Here each pair of
 * rows is loaded once and dotted with four queries at a time while it sits in L1, the next
 * rows prefetched, and the eight dot products' lanes summed by one shuffle tree instead of
 * eight horizontal sums.
 *
 * scores(rows, queries, out, lo, hi): out[q, i] = rows[i] . queries[q] for lo <= i < hi, in
 * float32 with float32 sums (as BLAS; the last bits depend on the CPU's FMA and on which tile
 * a row falls in, as BLAS's do), the GIL released: the engine runs one call per
 * core on disjoint row ranges. The function is built for AVX-512, AVX2 and baseline x86-64
 * (chosen at load) where the compiler and C library allow, else for the target's baseline.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

#define LANES 16
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
/* The same vector at float alignment: rows and queries are loaded unaligned. */
typedef float vec_u __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));

#define ROWS_PER_TILE 2
#define QUERIES_PER_TILE 4
/* How far ahead the next rows are prefetched: four rows, and never less than this many floats. */
#define PREFETCH_MIN_FLOATS 1024

#if defined(__x86_64__) && defined(__GLIBC__) && (defined(__clang__) ? __clang_major__ >= 14 : __GNUC__ >= 8)
#define CLONED __attribute__((target_clones("avx512f", "arch=haswell", "default")))
#else
#define CLONED
#endif
#define INLINE static inline __attribute__((always_inline))
#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int lane_index __attribute__((vector_size(LANES * sizeof(int))));
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (lane_index){__VA_ARGS__})
#endif

INLINE float
lane_sum(vec v)
{
    float s = 0;
    for (int i = 0; i < LANES; i++)
        s += v[i];
    return s;
}

/* The lane sums of eight accumulators into s[0..7]: halves folded pairwise three times. */
INLINE void
lane_sums8(vec a0, vec a1, vec a2, vec a3, vec a4, vec a5, vec a6, vec a7, float *s)
{
#define FOLD8_LO 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define FOLD8_HI 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define FOLD4_LO 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define FOLD4_HI 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
#define FOLD2_LO 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29
#define FOLD2_HI 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31
    /* [a0's 8 | a1's 8], ... then [a0's 4 | a1's 4 | a2's 4 | a3's 4], ... then pairs. */
    vec t0 = SHUFFLE(a0, a1, FOLD8_LO) + SHUFFLE(a0, a1, FOLD8_HI);
    vec t1 = SHUFFLE(a2, a3, FOLD8_LO) + SHUFFLE(a2, a3, FOLD8_HI);
    vec t2 = SHUFFLE(a4, a5, FOLD8_LO) + SHUFFLE(a4, a5, FOLD8_HI);
    vec t3 = SHUFFLE(a6, a7, FOLD8_LO) + SHUFFLE(a6, a7, FOLD8_HI);
    vec u0 = SHUFFLE(t0, t1, FOLD4_LO) + SHUFFLE(t0, t1, FOLD4_HI);
    vec u1 = SHUFFLE(t2, t3, FOLD4_LO) + SHUFFLE(t2, t3, FOLD4_HI);
    vec v = SHUFFLE(u0, u1, FOLD2_LO) + SHUFFLE(u0, u1, FOLD2_HI);
    vec w = v + SHUFFLE(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    for (int i = 0; i < 8; i++)
        s[i] = w[2 * i];
}

#define LOAD(p) (*(const vec_u *)(p))

CLONED static void
score_rows(const float *rows, const float *queries, float *out, size_t dim, size_t n_queries,
           size_t out_stride, size_t lo, size_t hi)
{
    const size_t dim_vec = dim - dim % LANES;
    const size_t ahead = 4 * dim > PREFETCH_MIN_FLOATS ? 4 * dim : PREFETCH_MIN_FLOATS;
    size_t i = lo;
    for (; i + ROWS_PER_TILE <= hi; i += ROWS_PER_TILE) {
        const float *r0 = rows + i * dim, *r1 = r0 + dim;
        size_t q = 0;
        for (; q + QUERIES_PER_TILE <= n_queries; q += QUERIES_PER_TILE) {
            const float *q0 = queries + q * dim, *q1 = q0 + dim, *q2 = q1 + dim, *q3 = q2 + dim;
            vec a00 = {0}, a01 = {0}, a02 = {0}, a03 = {0}, a10 = {0}, a11 = {0}, a12 = {0}, a13 = {0};
            for (size_t j = 0; j < dim_vec; j += LANES) {
                __builtin_prefetch(r0 + ahead + j);
                __builtin_prefetch(r1 + ahead + j);
                vec x0 = LOAD(r0 + j), x1 = LOAD(r1 + j);
                vec y0 = LOAD(q0 + j), y1 = LOAD(q1 + j), y2 = LOAD(q2 + j), y3 = LOAD(q3 + j);
                a00 += x0 * y0; a01 += x0 * y1; a02 += x0 * y2; a03 += x0 * y3;
                a10 += x1 * y0; a11 += x1 * y1; a12 += x1 * y2; a13 += x1 * y3;
            }
            float s[8];
            lane_sums8(a00, a01, a02, a03, a10, a11, a12, a13, s);
            for (size_t j = dim_vec; j < dim; j++) {
                s[0] += r0[j] * q0[j]; s[1] += r0[j] * q1[j]; s[2] += r0[j] * q2[j]; s[3] += r0[j] * q3[j];
                s[4] += r1[j] * q0[j]; s[5] += r1[j] * q1[j]; s[6] += r1[j] * q2[j]; s[7] += r1[j] * q3[j];
            }
            for (int c = 0; c < QUERIES_PER_TILE; c++) {
                out[(q + c) * out_stride + i] = s[c];
                out[(q + c) * out_stride + i + 1] = s[QUERIES_PER_TILE + c];
            }
        }
        for (; q < n_queries; q++) { /* (the engine pads its passes to whole tiles of queries) */
            const float *q0 = queries + q * dim;
            vec a0 = {0}, a1 = {0};
            for (size_t j = 0; j < dim_vec; j += LANES) {
                vec y = LOAD(q0 + j);
                a0 += LOAD(r0 + j) * y;
                a1 += LOAD(r1 + j) * y;
            }
            float s0 = lane_sum(a0), s1 = lane_sum(a1);
            for (size_t j = dim_vec; j < dim; j++) {
                s0 += r0[j] * q0[j];
                s1 += r1[j] * q0[j];
            }
            out[q * out_stride + i] = s0;
            out[q * out_stride + i + 1] = s1;
        }
    }
    for (; i < hi; i++) { /* an odd row at the end */
        const float *r0 = rows + i * dim;
        for (size_t q = 0; q < n_queries; q++) {
            const float *q0 = queries + q * dim;
            vec a0 = {0};
            for (size_t j = 0; j < dim_vec; j += LANES)
                a0 += LOAD(r0 + j) * LOAD(q0 + j);
            float s0 = lane_sum(a0);
            for (size_t j = dim_vec; j < dim; j++)
                s0 += r0[j] * q0[j];
            out[q * out_stride + i] = s0;
        }
    }
}

/* A C-contiguous 2-d float32 buffer, or an error naming ``what``. */
static int
get_matrix(PyObject *obj, Py_buffer *view, const char *what, int writable)
{
    const char *kind = writable ? "a writable" : "a";
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        if (PyErr_ExceptionMatches(PyExc_MemoryError))
            return -1;
        PyErr_Clear(); /* (the buffer protocol's message does not say which argument) */
        PyErr_Format(PyExc_ValueError, "%s must be %s C-contiguous 2-d float32 array", what, kind);
        return -1;
    }
    if (view->ndim != 2 || view->itemsize != 4 || view->format == NULL || view->format[0] != 'f'
        || view->format[1] != '\0') {
        PyErr_Format(PyExc_ValueError, "%s must be %s C-contiguous 2-d float32 array", what, kind);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *
dots_scores(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *rows_obj, *queries_obj, *out_obj;
    Py_ssize_t lo, hi;
    if (!PyArg_ParseTuple(args, "OOOnn:scores", &rows_obj, &queries_obj, &out_obj, &lo, &hi))
        return NULL;
    Py_buffer rows, queries, out;
    if (get_matrix(rows_obj, &rows, "rows", 0) < 0)
        return NULL;
    if (get_matrix(queries_obj, &queries, "queries", 0) < 0) {
        PyBuffer_Release(&rows);
        return NULL;
    }
    if (get_matrix(out_obj, &out, "out", 1) < 0) {
        PyBuffer_Release(&rows);
        PyBuffer_Release(&queries);
        return NULL;
    }
    PyObject *result = NULL;
    if (queries.shape[1] != rows.shape[1])
        PyErr_Format(PyExc_ValueError, "queries have %zd dimensions, rows %zd", queries.shape[1], rows.shape[1]);
    else if (out.shape[0] != queries.shape[0])
        PyErr_Format(PyExc_ValueError, "out has %zd rows for %zd queries", out.shape[0], queries.shape[0]);
    else if (lo < 0 || lo > hi || hi > rows.shape[0] || hi > out.shape[1])
        PyErr_Format(PyExc_ValueError, "rows [%zd, %zd) are not within the %zd rows and the %zd columns of out",
                     lo, hi, rows.shape[0], out.shape[1]);
    else {
        Py_BEGIN_ALLOW_THREADS
        score_rows(rows.buf, queries.buf, out.buf, (size_t)rows.shape[1], (size_t)queries.shape[0],
                   (size_t)out.shape[1], (size_t)lo, (size_t)hi);
        Py_END_ALLOW_THREADS
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&rows);
    PyBuffer_Release(&queries);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef dots_methods[] = {
    {"scores", dots_scores, METH_VARARGS,
     "scores(rows, queries, out, lo, hi): out[q, i] = rows[i] . queries[q] for lo <= i < hi "
     "(C-contiguous float32 arrays; the GIL is released)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef dots_module = {
    PyModuleDef_HEAD_INIT, "_dots", "The CPU engine's scores for a pass of a few queries.", -1, dots_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__dots(void)
{
    return PyModule_Create(&dots_module);
}
