# cython: language_level=3, boundscheck=False, wraparound=False
"""KV-cache slot table, compiled (twin of ``mdiedge/_pyslots.py``, same API and errors)."""
from libc.stdint cimport int64_t
from libc.stdlib cimport malloc, free as c_free

from mdiedge.base.errors import SlotError

MAX_SAMPLE_ID = 2 ** 32 - 1


cdef inline void _check_id(object sample_id) except *:
    if not 0 <= sample_id <= MAX_SAMPLE_ID:
        raise SlotError(f"sample id {sample_id!r} outside 0..{MAX_SAMPLE_ID}")


cdef class SlotTable:
    cdef int64_t* _owner
    cdef Py_ssize_t _n

    def __cinit__(self, n_slots):
        if n_slots < 1:
            raise SlotError(f"a slot table needs at least one slot, got {n_slots!r}")
        self._n = n_slots
        self._owner = <int64_t*> malloc(self._n * sizeof(int64_t))
        if self._owner == NULL:
            raise MemoryError()
        self.clear()

    def __dealloc__(self):
        c_free(self._owner)

    @property
    def n_slots(self):
        return self._n

    @property
    def in_use(self):
        cdef Py_ssize_t i, count = 0
        for i in range(self._n):
            if self._owner[i] >= 0:
                count += 1
        return count

    cdef Py_ssize_t _find(self, int64_t sample_id) nogil:
        cdef Py_ssize_t i
        for i in range(self._n):
            if self._owner[i] == sample_id:
                return i
        return -1

    cdef Py_ssize_t _first_free(self) nogil:
        cdef Py_ssize_t i
        for i in range(self._n):
            if self._owner[i] < 0:
                return i
        return -1

    def allocate(self, sample_id):
        _check_id(sample_id)
        if self._find(sample_id) >= 0:
            raise SlotError(f"sample {sample_id} already holds a slot")
        cdef Py_ssize_t slot = self._first_free()
        if slot < 0:
            raise SlotError(f"all {self._n} KV slots in use; cannot admit sample {sample_id}")
        self._owner[slot] = sample_id
        return slot

    def slot_of(self, sample_id):
        _check_id(sample_id)
        cdef Py_ssize_t slot = self._find(sample_id)
        if slot < 0:
            raise SlotError(f"sample {sample_id} holds no slot")
        return slot

    def get_or_allocate(self, sample_id):
        _check_id(sample_id)
        cdef Py_ssize_t slot = self._find(sample_id)
        return slot if slot >= 0 else self.allocate(sample_id)

    def lookup(self, sample_ids):
        return [self.slot_of(s) for s in sample_ids]

    def free(self, sample_id):
        cdef Py_ssize_t slot = self.slot_of(sample_id)
        self._owner[slot] = -1
        return slot

    def clear(self):
        cdef Py_ssize_t i
        for i in range(self._n):
            self._owner[i] = -1

    def assignments(self):
        cdef Py_ssize_t i
        return {self._owner[i]: i for i in range(self._n) if self._owner[i] >= 0}
