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

from metrale.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"        # queued, never scheduled
    RUNNING = "running"        # holds KV blocks and a state slot
    PREEMPTED = "preempted"    # back in the queue; recomputes all_token_ids as its prompt
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
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
    # -- resources, owned by the scheduler ------------------------------------------------------
    block_ids: list[int] = field(default_factory=list)       # KV blocks, in token order
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of full blocks (lazy)
    state_slot: int | None = None                            # GDN working row while running

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

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
