# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The few-row product, compiled: the twin of ``mdiedge/model/_pymatvec.py`` with the same API
(see ``mdiedge/model/_matvecconstants.py``). The kernel is ``ext/matvec.h``: the weight read once
per three rows, vector accumulators, OpenMP threads over the output columns, the GIL
released; a row's result does not depend on the rows beside it or the thread count."""
from mdiedge.model.arrays import address as _address
from mdiedge.model._matvecconstants import MAX_ROWS, check, usable  # noqa: F401  (this module's API)

TRANSPOSED_HEAD = False  # the kernel reads the head row-major, as every other weight

cdef extern from "matvec.h" nogil:
    void mv_init()
    void mv_rows(const float *w, const float *x, float *y, Py_ssize_t n, Py_ssize_t k,
                 int rows, int threads)

mv_init()


def rows(x, weight, out, int threads):
    check(x, weight, out, threads)
    cdef size_t w_ptr = _address(weight), x_ptr = _address(x), y_ptr = _address(out)
    cdef Py_ssize_t n = weight.shape[0], k = weight.shape[1]
    cdef int count = x.shape[0]
    with nogil:
        mv_rows(<const float *>w_ptr, <const float *>x_ptr, <float *>y_ptr, n, k, count, threads)
