# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Per-step packing on the hot path: flatten the scheduled sequences into the index arrays of a
ForwardBatch (positions, slot mapping, cu_seqlens, token ids) without per-token Python work.

    pack_indices(context, qlens, tables, block_size)   index arrays from host arrays
    pack_batch(seqs, block_size)                       a whole ForwardBatch's arrays from
                                                       ScheduledSeqs (the general path)
    pack_decode(seqs, ..., block_size, ...)            a decode step straight into a captured
                                                       graph's pinned input buffer, rewriting
                                                       only the block-table entries that changed
    sample_inputs(seqs, began)                         the GPU sampler's per-row inputs
    gather_param_rows(params, slots, steps, owners, rows, out, start)
                                                       cached sampler parameter rows -> out

Token ids are read straight from a request's prompt (an int32 array) and output list: position p
of the model's context (`Request.all_token_ids[p]`) without building that list.
"""
import numpy as np
cimport numpy as cnp

cnp.import_array()


cdef inline object _token_at(object prompt, object output, Py_ssize_t num_prompt,
                             Py_ssize_t sink, Py_ssize_t dropped, Py_ssize_t pos):
    """all_token_ids[pos] of a request: prompt + output with [sink, sink + dropped) removed."""
    if dropped and pos >= sink:
        pos += dropped
    if pos < num_prompt:
        return prompt[pos]
    return output[pos - num_prompt]


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


cdef Py_ssize_t _fill_tokens(object s, int ctx, int q, int[:] ids, int[:] pos, int[:] slot,
                             int[:, :] tab, Py_ssize_t i, Py_ssize_t t, int block_size,
                             int[:] li, Py_ssize_t k, bint every_row):
    """Sequence i's rows from token t: ids (its context's tokens, then its drafts), positions,
    KV slots; each row's index into li from k when `every_row` (a verify). Returns the new k."""
    cdef Py_ssize_t j, num_prompt, sink, dropped, ntok, pp
    cdef int p
    cdef const int[:] pv = None
    req = s.request
    prompt = req.prompt_token_ids
    if isinstance(prompt, np.ndarray):     # Request's int32 prompt: read without boxing
        pv = prompt
    output = req.output_token_ids
    num_prompt = len(prompt)
    dropped = req.num_dropped_tokens
    sink = req.num_sink_tokens if dropped else 0
    ntok = num_prompt + len(output) - dropped
    drafts = req.draft_token_ids
    for j in range(q):
        p = ctx + <int>j
        if p < ntok:
            pp = p + dropped if dropped and p >= sink else p
            if pv is not None and pp < num_prompt:
                ids[t + j] = pv[pp]
            else:
                ids[t + j] = _token_at(prompt, output, num_prompt, sink, dropped, p)
        else:
            ids[t + j] = drafts[p - ntok]
        pos[t + j] = p
        slot[t + j] = tab[i, p // block_size] * block_size + p % block_size
        if every_row:
            li[k] = <int>(t + j)
            k += 1
    return k


def pack_batch(list seqs, int block_size):
    """ScheduledSeqs -> (input_ids, positions, query_start_loc, seq_lens, block_tables,
    slot_mapping, state_slots, logits_indices), int32, laid out as metrale.forward.ForwardBatch
    documents (block tables padded with 0 to the longest table). A sequence with drafts
    (`num_drafts` > 0: a speculative verify) adds them after its new token and projects every
    one of its rows to logits."""
    cdef Py_ssize_t B = len(seqs)
    cdef Py_ssize_t i, j, t, T = 0, width = 0, n_sample = 0, L, nd, k = 0
    ctx_a = np.empty(B, dtype=np.int32)
    q_a = np.empty(B, dtype=np.int32)
    cdef int[:] ctx = ctx_a
    cdef int[:] q = q_a
    for i in range(B):
        s = seqs[i]
        ctx[i] = s.request.num_computed_tokens
        nd = s.num_drafts
        q[i] = s.num_new_tokens + nd
        T += q[i]
        L = len(s.block_table)
        if L > width:
            width = L
        n_sample += q[i] if nd else (1 if s.sample else 0)
    ids_a, pos_a, slot_a = (np.empty(T, dtype=np.int32) for _ in range(3))
    qsl_a = np.empty(B + 1, dtype=np.int32)
    sl_a, st_a = np.empty(B, dtype=np.int32), np.empty(B, dtype=np.int32)
    tab_a = np.zeros((B, width), dtype=np.int32)
    li_a = np.empty(n_sample, dtype=np.int32)
    cdef int[:] ids = ids_a
    cdef int[:] pos = pos_a
    cdef int[:] slot = slot_a
    cdef int[:] qsl = qsl_a
    cdef int[:] sl = sl_a
    cdef int[:, :] tab = tab_a
    cdef int[:] st = st_a
    cdef int[:] li = li_a
    t = 0
    qsl[0] = 0
    for i in range(B):
        s = seqs[i]
        table = s.block_table
        for j in range(len(table)):
            tab[i, j] = table[j]
        nd = s.num_drafts
        k = _fill_tokens(s, ctx[i], q[i], ids, pos, slot, tab, i, t, block_size, li, k, nd > 0)
        t += q[i]
        qsl[i + 1] = <int>t
        sl[i] = ctx[i] + q[i]
        st[i] = s.state_slot
        if s.sample and not nd:
            li[k] = <int>t - 1
            k += 1
    return ids_a, pos_a, qsl_a, sl_a, tab_a, slot_a, st_a, li_a


PADDING = ("padding row",)
"""Marks a graph buffer row that holds the padding block table (spare block, then zeros)."""


def pack_decode(list seqs, int[:] ids, int[:] positions, int[:] seq_lens, int[:, :] tables,
                int[:] slots, int[:] state_slots, int block_size, int spare_block,
                int spare_slot, list row_tables, int[:] row_lens):
    """Write a decode step (every sequence adds one token) padded to the bucket (the buffers'
    first dimension) into a captured graph's input buffers. Padding rows get position 0,
    context 1, the spare KV block and the spare state row.

    Block tables are written incrementally: `row_tables[r]` is the list (a request's live
    `block_ids`, which only ever grows) whose first `row_lens[r]` entries row r holds, or
    PADDING, or None when unknown; entries past `row_lens[r]` are 0. Returns the number of real
    rows, or -1 when the step is not a decode that fits (then nothing was written).

    query_start_loc and logits_indices are the identity for a decode step: the caller fills
    them once."""
    cdef Py_ssize_t n = len(seqs), bucket = ids.shape[0], width = tables.shape[1]
    cdef Py_ssize_t i, j, L, old, num_prompt, sink, dropped
    cdef int p
    if n > bucket:
        return -1
    for i in range(n):
        s = seqs[i]
        if s.num_new_tokens != 1 or len(s.block_table) > width:
            return -1
    for i in range(n):
        s = seqs[i]
        req = s.request
        table = s.block_table
        p = req.num_computed_tokens
        prompt = req.prompt_token_ids
        num_prompt = len(prompt)
        dropped = req.num_dropped_tokens
        sink = req.num_sink_tokens if dropped else 0
        ids[i] = _token_at(prompt, req.output_token_ids, num_prompt, sink, dropped, p)
        positions[i] = p
        seq_lens[i] = p + 1
        state_slots[i] = s.state_slot
        L = len(table)
        old = row_lens[i]
        if row_tables[i] is table and L >= old:
            for j in range(old, L):
                tables[i, j] = table[j]
        else:
            for j in range(L):
                tables[i, j] = table[j]
            for j in range(L, old):
                tables[i, j] = 0
            row_tables[i] = table
        row_lens[i] = <int>L
        slots[i] = tables[i, p // block_size] * block_size + p % block_size
    for i in range(n, bucket):
        ids[i] = 0
        positions[i] = 0
        seq_lens[i] = 1
        slots[i] = spare_block * block_size
        state_slots[i] = spare_slot
        if row_tables[i] is not PADDING:
            for j in range(1, row_lens[i]):
                tables[i, j] = 0
            tables[i, 0] = spare_block
            row_tables[i] = PADDING
            row_lens[i] = 1
    return n


def sample_inputs(list seqs, dict began):
    """The GPU sampler's inputs for the sampling sequences `seqs`: (params list, steps int64
    [B] (output tokens so far), slots int64 [B] (state slots), rows whose request has not
    begun in its slot: began[request_id] != state_slot)."""
    cdef Py_ssize_t B = len(seqs), i
    steps_a = np.empty(B, dtype=np.int64)
    slots_a = np.empty(B, dtype=np.int64)
    cdef long long[:] steps = steps_a
    cdef long long[:] slots = slots_a
    params = [None] * B
    fresh = []
    for i in range(B):
        s = seqs[i]
        req = s.request
        slot = s.state_slot
        params[i] = req.sampling_params
        steps[i] = len(req.output_token_ids)
        slots[i] = slot
        if began.get(req.request_id) != slot:
            fresh.append(i)
    return params, steps_a, slots_a, fresh


def gather_param_rows(list params, const long long[:] slots, const long long[:] steps,
                      list owners, const int[:, :] rows, int[:, :] out, Py_ssize_t start):
    """Copy the cached parameter row of each sampling row i >= start into out[i] while
    `owners[slots[i]] is params[i]` (the row was packed from this very SamplingParams in this
    slot). Returns the first row that is not cached; when every row is done, writes the step
    column (11: steps[i] mod 2^32) of all rows and returns len(params)."""
    cdef Py_ssize_t B = len(params), i, j, ncol = rows.shape[1], num_slots = rows.shape[0]
    cdef long long slot
    for i in range(start, B):
        slot = slots[i]
        if slot < 0 or slot >= num_slots or owners[slot] is not params[i]:
            return i
        for j in range(ncol):
            out[i, j] = rows[slot, j]
    for i in range(B):
        out[i, 11] = <int>(<unsigned int>(steps[i] & 0xFFFFFFFF))
    return B


def steady_decode_seqs(list running, list previous, int block_size, object make_seq):
    """The ScheduledSeqs of a steady decode step (every running request adds one token and
    samples): (seqs, crossing), crossing the requests that need one more KV block first.
    A ScheduledSeq of `previous` (the last such step) is reused when it says the same thing
    (same request, same live block list, same state row); others are made with
    make_seq(request, 1, block_ids, state_slot, True)."""
    cdef Py_ssize_t n = len(running), i, num_prev = len(previous)
    seqs = [None] * n
    crossing = []
    for i in range(n):
        req = running[i]
        blocks = req.block_ids
        slot = req.state_slot
        if req.num_computed_tokens >= len(blocks) * block_size:
            crossing.append(req)
        if i < num_prev:
            seq = previous[i]
            if (seq.request is req and seq.block_table is blocks and seq.state_slot == slot
                    and seq.num_new_tokens == 1 and seq.sample is True):
                seqs[i] = seq
                continue
        seqs[i] = make_seq(req, 1, blocks, slot, True)
    return seqs, crossing
