# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Per-step packing on the hot path: flatten the scheduled sequences into the index arrays of a
ForwardBatch (positions, slot mapping, cu_seqlens) without per-token Python work."""
import numpy as np
cimport numpy as cnp

cnp.import_array()


def pack_indices(const int[:] context_lens, const int[:] query_lens, const int[:, :] block_tables,
                 int block_size):
    """-> (positions[T], slot_mapping[T], query_start_loc[B+1], seq_lens[B]) as int32 arrays.
    Sequence i adds query_lens[i] tokens after context_lens[i] cached ones; its KV slots come
    from its row of block_tables."""
    cdef Py_ssize_t B = context_lens.shape[0]
    cdef Py_ssize_t i, j, T = 0
    for i in range(B):
        T += query_lens[i]
    positions = np.empty(T, dtype=np.int32)
    slots = np.empty(T, dtype=np.int32)
    qsl = np.empty(B + 1, dtype=np.int32)
    seq_lens = np.empty(B, dtype=np.int32)
    cdef int[:] pos_v = positions
    cdef int[:] slot_v = slots
    cdef int[:] qsl_v = qsl
    cdef int[:] sl_v = seq_lens
    cdef Py_ssize_t t = 0
    cdef int p
    qsl_v[0] = 0
    for i in range(B):
        for j in range(query_lens[i]):
            p = context_lens[i] + <int>j
            pos_v[t] = p
            slot_v[t] = block_tables[i, p // block_size] * block_size + p % block_size
            t += 1
        qsl_v[i + 1] = <int>t
        sl_v[i] = context_lens[i] + query_lens[i]
    return positions, slots, qsl, seq_lens
