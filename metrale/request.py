"""One generation request as the engine core sees it: its tokens, its limits, and its progress.

Progress is one number, `num_computed_tokens` (vLLM v1's invariant): the tokens whose KV and GDN
state are in the cache. Prefill, chunked prefill, decode and recompute after preemption are all
the same thing: the computed count catching up with `num_tokens`, chunk by chunk.

The scheduler owns the resource handles (`block_ids`, `state_slot`); everyone else reads them.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np

from metrale.sampling import SamplingParams


def as_token_ids(ids) -> np.ndarray:
    """A prompt's token ids as the one type they have from the frontend to the scheduler: a 1-D
    int32 numpy array (one already is passes through uncopied; the wire's int32 frame decodes to
    one without a copy). ValueError for ids that are not integers of int32's range."""
    if type(ids) is np.ndarray and ids.dtype == np.int32 and ids.ndim == 1:
        return ids
    try:
        out = np.asarray(ids, dtype=np.int32)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token ids must be integers in [0, 2^31): {e}") from None
    if out.ndim != 1:
        raise ValueError(f"token ids must be a flat sequence, got shape {out.shape}")
    return out


class ContextLengthExceeded(ValueError):
    """The prompt, or the prompt and the output asked for, cannot fit the context. `param` is
    the request field to change ("prompt" or "max_tokens")."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_context_length(num_prompt_tokens: int, max_seq_len: int,
                         max_tokens: int | None = None) -> None:
    """The context-length rule, in one place: a prompt must leave room for one output token
    and, when `max_tokens` is given, the prompt and max_tokens must fit max_seq_len together.
    The frontends apply it before submitting (400 context_length_exceeded, max_tokens given);
    the scheduler at admission for every caller (without max_tokens: an output that reaches the
    context ends with "length")."""
    n, limit = num_prompt_tokens, max_seq_len
    if n >= limit:
        raise ContextLengthExceeded(
            f"this model's maximum context length is {limit} tokens (--max-seq-len); the "
            f"prompt has {n} tokens; shorten it", "prompt")
    if max_tokens is not None and n + max_tokens > limit:
        raise ContextLengthExceeded(
            f"this model's maximum context length is {limit} tokens; you asked for "
            f"{n + max_tokens} ({n} in the prompt, {max_tokens} in the completion); lower "
            "max_tokens", "max_tokens")


class RequestStatus(enum.Enum):
    WAITING = "waiting"        # queued, never scheduled
    RUNNING = "running"        # holds KV blocks and a state slot
    PREEMPTED = "preempted"    # back in the queue; recomputes all_token_ids as its prompt, or
                               # copies them back from swap space (num_swapped_tokens > 0)
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: np.ndarray                # int32 [num_prompt_tokens] (as_token_ids)
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float | None = None               # absolute monotonic time (--request-timeout)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0                # tokens whose KV/state is in the cache
    num_cached_tokens: int = 0                  # prompt tokens served from the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None            # "stop" | "length" | "abort" | "timeout"
    num_preemptions: int = 0
    num_swapped_tokens: int = 0                 # preempted by swap: computed tokens held there
    num_compactions: int = 0                    # --auto-compact: times the middle was dropped
    num_dropped_tokens: int = 0                 # tokens dropped by compaction (after the sink)
    num_sink_tokens: int = 0                    # tokens kept at the start by compaction
    # -- resources, owned by the scheduler ------------------------------------------------------
    block_ids: list[int] = field(default_factory=list)       # KV blocks, in token order
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of full blocks (lazy)
    state_slot: int | None = None                            # GDN working row while running
    # -- speculative decoding (metrale.spec) ------------------------------------------------------
    draft_token_ids: list[int] = field(default_factory=list)  # proposed for the next verify
    num_verifies: int = 0                                    # verify steps this request took
    num_draft_tokens: int = 0                                # drafts it verified
    num_accepted_tokens: int = 0                             # of them, accepted
    last_verify: tuple[int, int] | None = None               # (drafts, accepted) of the last one

    def __post_init__(self):
        self.prompt_token_ids = as_token_ids(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """The model's context: prompt + output, minus what compaction dropped (the tokens the
        KV cache and GDN state describe, position i holding all_token_ids[i])."""
        tokens = self.prompt_token_ids.tolist() + self.output_token_ids
        if self.num_dropped_tokens:
            del tokens[self.num_sink_tokens: self.num_sink_tokens + self.num_dropped_tokens]
        return tokens

    @property
    def num_tokens(self) -> int:
        """Length of the model's context (`all_token_ids`)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) - self.num_dropped_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: str) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
