"""The step contract between the model runner and the model: what one forward pass computes.

One `ForwardBatch` describes a single engine step over B sequences. Every sequence contributes a
contiguous run of new tokens (a prefill chunk, a whole prompt, or one decode token); there is no
separate "prefill mode": a sequence's computed-token count simply catches up with its length,
chunk by chunk (vLLM v1's `num_computed_tokens` invariant).

Layouts (T = total new tokens in the step, B = sequences):

    input_ids        int32 [T]      new tokens, sequence after sequence
    positions        int32 [T]      absolute position of each new token in its sequence
    query_start_loc  int32 [B+1]    cu_seqlens of the new tokens: seq i owns rows [qsl[i], qsl[i+1])
    seq_lens         int32 [B]      context length after this step (cached + new tokens)
    block_tables     int32 [B, M]   paged-KV block ids of each sequence, padded with 0 past its end
    slot_mapping     int32 [T]      flat KV slot of each new token: block_id * block_size + offset
    state_slots      int32 [B]      row of the GDN state pool (conv + recurrent) each sequence owns
    logits_indices   int32 [N]      rows of the final hidden states to project to logits
                                    (usually the last new token of each sequence that samples)
    state_out        int32 [T]      (optional; None in every step but a speculative verify)
                                    GDN state-pool row that also receives the sequence's state
                                    (conv window and delta-rule state) as it stands after new
                                    token t, or -1. A verify step sets it for the window's
                                    tokens so that any accepted prefix is restorable: the
                                    working row `state_slots[i]` still ends at the last token

The cached length of sequence i is `seq_lens[i] - (qsl[i+1] - qsl[i])`. When it is 0 the
sequence starts fresh: attention sees only its new tokens and GDN layers start from a zero state,
whatever the state pool row holds (rows are reused without being cleared).

KV cache, one pair per attention layer:   k, v   [num_blocks, block_size, n_kv_heads, head_dim]
GDN state pool, one pair per GDN layer:    conv   [num_slots, conv_dim, kernel_size - 1]
                                           ssm    [num_slots, n_v_heads, head_k_dim, head_v_dim] (fp32)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class ForwardBatch:
    input_ids: np.ndarray
    positions: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    slot_mapping: np.ndarray
    state_slots: np.ndarray
    logits_indices: np.ndarray
    block_size: int
    state_out: np.ndarray | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)

    @property
    def context_lens(self) -> np.ndarray:
        """Tokens already cached for each sequence before this step."""
        return self.seq_lens - self.query_lens

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token (the shape captured as a CUDA graph)."""
        return self.num_tokens == self.num_seqs


def contiguous_batch(
    token_lists: list[list[int]],
    context_lens: list[int],
    block_tables: list[list[int]],
    state_slots: list[int],
    block_size: int,
    all_logits: bool = False,
) -> ForwardBatch:
    """Build a ForwardBatch in plain Python (tests and the reference path; the engine packs in
    metrale._hot). `token_lists[i]` are the new tokens of sequence i, whose first
    `context_lens[i]` tokens are already cached in the blocks of `block_tables[i]`."""
    qlens = [len(t) for t in token_lists]
    qsl = np.zeros(len(qlens) + 1, dtype=np.int32)
    qsl[1:] = np.cumsum(qlens)
    ids = np.array([t for toks in token_lists for t in toks], dtype=np.int32)
    positions = np.concatenate(
        [np.arange(c, c + q, dtype=np.int32) for c, q in zip(context_lens, qlens)]
    ) if qlens else np.zeros(0, np.int32)
    width = max((len(b) for b in block_tables), default=1) or 1
    bt = np.zeros((len(block_tables), width), dtype=np.int32)
    for i, b in enumerate(block_tables):
        bt[i, : len(b)] = b
    slots = np.empty(len(ids), dtype=np.int32)
    for i, (c, q) in enumerate(zip(context_lens, qlens)):
        pos = np.arange(c, c + q)
        slots[qsl[i]: qsl[i + 1]] = bt[i, pos // block_size] * block_size + pos % block_size
    if all_logits:
        logits_indices = np.arange(len(ids), dtype=np.int32)
    else:
        logits_indices = (qsl[1:] - 1).astype(np.int32)
    return ForwardBatch(
        input_ids=ids,
        positions=positions,
        query_start_loc=qsl,
        seq_lens=np.array([c + q for c, q in zip(context_lens, qlens)], dtype=np.int32),
        block_tables=bt,
        slot_mapping=slots,
        state_slots=np.array(state_slots, dtype=np.int32),
        logits_indices=logits_indices,
        block_size=block_size,
    )


def prefill_work_list(query_start_loc, seq_lens, bq: int) -> np.ndarray:
    """int32 [nwork, 2] (sequence, first new-token index) tiles of `bq` query tokens for the
    prefill attention kernels, ordered by decreasing number of visible keys (the long causal
    tiles start first, the short ones fill the tail). Sequences with no new tokens add none;
    at most ceil(T / bq) + B items for T new tokens over B sequences."""
    qsl = np.asarray(query_start_loc).astype(np.int64)
    qlens = np.diff(qsl)
    seq = np.repeat(np.arange(len(qlens)), -(-qlens // bq))
    if not len(seq):
        return np.zeros((0, 2), np.int32)
    starts = np.concatenate([np.arange(0, n, bq) for n in qlens])
    ctx = np.asarray(seq_lens).astype(np.int64)[: len(qlens)] - qlens
    keys = ctx[seq] + np.minimum(starts + bq, qlens[seq])
    order = np.argsort(-keys, kind="stable")
    return np.stack([seq[order], starts[order]], axis=1).astype(np.int32)
