# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The decode step, compiled: the twin of ``mdiedge/model/_pystep.py`` with the same API (see
``mdiedge/model/_stepconstants.py``). The kernel is ``ext/step.h``: a whole dense block for
1..``STEP_ROWS`` rows in one call with the GIL released, its products ``ext/matvec.h``'s (float32 matrices) or
``ext/quant.h``'s (a ``QuantMatrix``, or a ``StackedMatrix`` of them), with the optional
parts of ``BlockWeights`` (bias, Q/K norms, sandwich norms, GeGLU, scale, window, a
mixture of experts: ``ext/step_moe.h``); a
``Plan`` holds consecutive blocks' pointers, made once, so ``blocks`` runs them all in one
call; ``logits`` is the final norm and the head product in one call. Arrays are numpy
arrays or torch CPU tensors (their addresses: ``mdiedge.model.arrays.address``)."""
from libc.stdlib cimport free, malloc

from mdiedge.model.arrays import address as _address
from mdiedge.model.qtypes import check_compiled as _check_compiled
from mdiedge.model._stepconstants import (ACTIVATIONS, MAX_PAIRED_HEAD_DIM,  # noqa: F401
                                     MAX_PARTS, MAX_ROWS, STEP_ROWS, BlockWeights, Experts,
                                     Limits, QuantMatrix, StackedMatrix, check, check_act_mul,
                                     check_call, check_halves, check_logits, logits_usable,
                                     usable)

PREFERRED = True  # the model decodes through it (see the twin's)

cdef extern from "step.h" nogil:
    void st_init()
    int ST_FLOAT
    int ST_PARTS
    int ST_MAX_HEAD_DIM
    int ST_SILU
    int ST_GELU_TANH
    ctypedef struct st_matrix:
        const void *w[3]
        int t[3]
        Py_ssize_t n[3]
        int parts
        const void *x8[3]
    ctypedef struct st_block:
        const float *attn_norm
        const float *mlp_norm
        const float *cos
        const float *sin
        st_matrix qkv, wo, gate_up, down
        void *k
        void *v
        Py_ssize_t dim, n_heads, n_kv, head_dim, hidden, n_slots, max_seq
        float eps
        const float *qkv_bias
        const float *q_norm
        const float *k_norm
        const float *post_attn_norm
        const float *post_mlp_norm
        int activation
        float attn_scale
        Py_ssize_t window
        int qk_pairs
        int kv_half
        Py_ssize_t n_experts, top_k
        int renormalize
        st_matrix router
        const st_matrix *expert_gate_up
        const st_matrix *expert_down
        long long *expert_counts
    int st_block_step(const st_block *b, const float *x, float *out, int R,
                      const long long *slots, const long long *pos, int threads, int dot)
    int st_blocks_step(const st_block *bs, int n, const float *x, float *out, int R,
                       const long long *slots, const long long *pos, int threads, int dot)
    int QM_TYPES
    const char *qm_names[]
    const int qm_block[]
    const int qm_block_bytes[]
    void st_halves(const float *x, unsigned short *h, Py_ssize_t n)
    void st_widen_base(const unsigned short *h, float *f, Py_ssize_t n)
    void (*st_widen)(const unsigned short *h, float *f, Py_ssize_t n)
    void st_act_rows(int activation, const float *both, float *out, Py_ssize_t rows,
                     Py_ssize_t hidden, int threads)
    int st_logits(const float *x, const float *norm, float eps, const void *head,
                  const void *head_x8, int head_t, float *out, Py_ssize_t dim,
                  Py_ssize_t vocab, int R, int threads, int dot)

st_init()
_check_compiled(tuple((qm_names[i].decode(), qm_block[i], qm_block_bytes[i])
                     for i in range(QM_TYPES)), __name__)
assert ST_PARTS == MAX_PARTS == 3, "ext/step.h's ST_PARTS is not _stepconstants's MAX_PARTS"
assert ST_MAX_HEAD_DIM == MAX_PAIRED_HEAD_DIM, \
    "ext/step.h's ST_MAX_HEAD_DIM is not _stepconstants's MAX_PAIRED_HEAD_DIM"
assert (ST_SILU, ST_GELU_TANH) == tuple(map(ACTIVATIONS.index, ("silu", "gelu_tanh"))), \
    "ext/step.h's activations are not _stepconstants's ACTIVATIONS"

cdef const float *_ptr(t) except? NULL:
    return <const float *><size_t>_address(t)


cdef const float *_optional(t) except? NULL:
    """NULL for a part the block does not have (None)."""
    return NULL if t is None else _ptr(t)


cdef int _type(m) except? -2:
    """ST_FLOAT for a float32 tensor, else the QuantMatrix's quant.h type."""
    return m.code if isinstance(m, QuantMatrix) else ST_FLOAT


cdef const void *_matrix(m) except? NULL:
    return <const void *><size_t>_address(m.data if isinstance(m, QuantMatrix) else m)


cdef void _fill_matrix(st_matrix *m, matrix) except *:
    """m = ``matrix``: a float32 tensor or a ``QuantMatrix`` (one part), or a
    ``StackedMatrix`` (its parts)."""
    parts = matrix.parts if isinstance(matrix, StackedMatrix) else (matrix,)
    m.parts = len(parts)
    for p, part in enumerate(parts):
        m.w[p], m.t[p], m.n[p] = _matrix(part), _type(part), part.shape[0]
        m.x8[p] = _x8(part)


cdef const void *_x8(m) except? NULL:
    """A QuantMatrix's x8 layout (``QuantMatrix.x8``), else NULL."""
    if isinstance(m, QuantMatrix) and m.x8 is not None:
        return <const void *><size_t>_address(m.x8)
    return NULL


cdef Py_ssize_t _expert_matrices(weights):
    """The st_matrix entries the block's experts take (two per expert; 0 for a dense block)."""
    return 0 if weights.experts is None else 2 * weights.experts.n_experts


cdef void _fill_experts(st_block *b, experts, st_matrix *room) except *:
    """b's mixture of experts (none where ``experts`` is None), its matrices' entries in
    ``room`` (``_expert_matrices``)."""
    b.n_experts, b.top_k, b.renormalize, b.expert_counts = 0, 0, 0, NULL
    b.expert_gate_up = b.expert_down = NULL
    if experts is None:
        return
    cdef Py_ssize_t n = experts.n_experts
    b.n_experts, b.top_k, b.renormalize = n, experts.top_k, experts.renormalize
    _fill_matrix(&b.router, experts.router)
    for e in range(n):
        _fill_matrix(&room[e], experts.gate_up[e])
        _fill_matrix(&room[n + e], experts.down[e])
    b.expert_gate_up = room
    b.expert_down = room + n
    if experts.counts is not None:
        b.expert_counts = <long long *><size_t>_address(experts.counts)


cdef void _fill(st_block *b, weights, st_matrix *room) except *:
    b.attn_norm, b.mlp_norm = _ptr(weights.attn_norm), _ptr(weights.mlp_norm)
    _fill_matrix(&b.qkv, weights.qkv)
    _fill_matrix(&b.wo, weights.wo)
    b.gate_up.parts = b.down.parts = 0
    if weights.experts is None:
        _fill_matrix(&b.gate_up, weights.gate_up)
        _fill_matrix(&b.down, weights.down)
    _fill_experts(b, weights.experts, room)
    b.cos, b.sin = _ptr(weights.cos), _ptr(weights.sin)
    b.k, b.v = <void *>_ptr(weights.k), <void *>_ptr(weights.v)
    b.n_slots, b.n_kv, b.max_seq = weights.n_slots, weights.n_kv, weights.k.shape[2]
    b.dim, b.n_heads, b.head_dim = weights.dim, weights.n_heads, weights.head_dim
    b.hidden, b.eps = weights.hidden, weights.eps
    b.qkv_bias, b.q_norm = _optional(weights.qkv_bias), _optional(weights.q_norm)
    b.k_norm = _optional(weights.k_norm)
    b.post_attn_norm = _optional(weights.post_attn_norm)
    b.post_mlp_norm = _optional(weights.post_mlp_norm)
    b.activation = ACTIVATIONS.index(weights.activation)
    b.attn_scale = 0.0 if weights.attn_scale is None else weights.attn_scale
    b.window = weights.window
    b.qk_pairs = 1 if weights.qk_pairs else 0
    b.kv_half = 1 if weights.kv_half else 0


cdef class Plan:
    """Consecutive blocks to run in one call: their ``BlockWeights`` (kept, so the tensors
    live as long as the pointers) and the pointers, their experts' matrices in ``room``."""
    cdef st_block *bs
    cdef st_matrix *room
    cdef int n
    cdef readonly object weights, limits

    def __cinit__(self, weights):
        self.limits = Limits(weights)
        self.weights = list(weights)
        self.n = len(self.weights)
        cdef Py_ssize_t entries = sum(_expert_matrices(w) for w in self.weights), at = 0
        self.bs = <st_block *>malloc(self.n * sizeof(st_block))
        self.room = <st_matrix *>malloc((entries + 1) * sizeof(st_matrix))
        if self.bs == NULL or self.room == NULL:
            raise MemoryError(f"a plan of {self.n} blocks: no memory")
        for i in range(self.n):
            _fill(&self.bs[i], self.weights[i], self.room + at)
            at += _expert_matrices(self.weights[i])

    def __dealloc__(self):
        free(self.bs)
        free(self.room)


def plan(weights):
    return Plan(weights)


cdef long long *_rows(slots, positions, int rows) except NULL:
    """The rows' slots, then their positions: 2 rows long longs, for the caller to free."""
    cdef long long *found = <long long *>malloc(2 * rows * sizeof(long long))
    if found == NULL:
        raise MemoryError(f"decode step of {rows} rows: no memory")
    try:
        for r in range(rows):
            found[r] = slots[r]
            found[rows + r] = positions[r]
    except BaseException:
        free(found)
        raise
    return found


def blocks(plan_, x, out, slots, positions, int threads, int dot=0):
    if not isinstance(plan_, Plan):
        raise ValueError(f"plan {type(plan_).__name__} is not this module's Plan")
    cdef Plan made = plan_
    limits = made.limits
    check_call(limits, limits.wants_grad, x, out, slots, positions, threads)
    cdef int rows = x.shape[0], status
    cdef const float *xp = _ptr(x)
    cdef float *op = <float *>_ptr(out)
    cdef long long *c_rows = _rows(slots, positions, rows)
    try:
        with nogil:
            status = st_blocks_step(made.bs, made.n, xp, op, rows, c_rows, c_rows + rows,
                                    threads, dot)
    finally:
        free(c_rows)
    if status != 0:
        raise MemoryError(f"decode step of {rows} rows: no scratch memory")


def block(weights, x, out, slots, positions, int threads, int dot=0):
    check(weights, x, out, slots, positions, threads)
    cdef st_block b
    cdef int rows = x.shape[0], status
    cdef st_matrix *room = <st_matrix *>malloc((_expert_matrices(weights) + 1)
                                               * sizeof(st_matrix))
    if room == NULL:
        raise MemoryError("a block's experts: no memory")
    cdef const float *xp = _ptr(x)
    cdef float *op = <float *>_ptr(out)
    cdef long long *c_rows = NULL
    try:
        c_rows = _rows(slots, positions, rows)
        _fill(&b, weights, room)
        with nogil:
            status = st_block_step(&b, xp, op, rows, c_rows, c_rows + rows, threads, dot)
    finally:
        free(room)
        free(c_rows)
    if status != 0:
        raise MemoryError(f"decode step of {rows} rows: no scratch memory")


def logits(norm, double eps, head, x, out, int threads, int dot=0):
    check_logits(norm, head, x, out, threads)
    cdef int rows = x.shape[0], status
    cdef Py_ssize_t dim = head.shape[1], vocab = head.shape[0]
    cdef const float *xp = _ptr(x)
    cdef const float *np_ = _ptr(norm)
    cdef const void *hp = _matrix(head)
    cdef const void *hx8 = _x8(head)
    cdef int head_t = _type(head)
    cdef float *op = <float *>_ptr(out)
    with nogil:
        status = st_logits(xp, np_, <float>eps, hp, hx8, head_t, op, dim, vocab, rows,
                           threads, dot)
    if status != 0:
        raise MemoryError(f"logits of {rows} rows: no scratch memory")


def act_mul(both, out, activation, int threads=1):
    """out (rows, hidden) = activation(gate) * up of both = [gate | up] (rows, 2 hidden), as the
    step computes it (``ACTIVATIONS``), the rows shared among ``threads``; returns out."""
    cdef int code = check_act_mul(both, out, activation, threads)
    cdef Py_ssize_t rows = both.shape[0], hidden = out.shape[1]
    cdef const float *bp = _ptr(both)
    cdef float *op = <float *>_ptr(out)
    with nogil:
        st_act_rows(code, bp, op, rows, hidden, threads)
    return out


def halves(values, out):
    """float32 ``values`` as IEEE halves into uint16 ``out``, rounded to nearest even, as the q8
    mode's KV cache is written; returns out."""
    cdef Py_ssize_t n = check_halves(values, out, "float32", "uint16")
    cdef const float *xp = _ptr(values)
    cdef unsigned short *hp = <unsigned short *><size_t>_address(out)
    with nogil:
        st_halves(xp, hp, n)
    return out


def widen_halves(values, out, bint reference=False):
    """uint16 ``values``, IEEE halves, into float32 ``out`` exactly, as the q8 mode's attention
    reads its KV cache: on this CPU's path (F16C on x86-64), or the portable C one with
    ``reference``; returns out."""
    cdef Py_ssize_t n = check_halves(values, out, "uint16", "float32")
    cdef const unsigned short *hp = <const unsigned short *><size_t>_address(values)
    cdef float *op = <float *>_ptr(out)
    with nogil:
        if reference:
            st_widen_base(hp, op, n)
        else:
            st_widen(hp, op, n)
    return out
