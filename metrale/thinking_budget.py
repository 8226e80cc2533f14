"""The thinking budget: the engine ends a `<think>` block by forcing its close tag (the frontend
splits reasoning off the text: metrale.api.reasoning_parser).

The frontend cannot force tokens, so it sends the budget in the request's SamplingParams
(`thinking_budget`, `think_start_id`, `think_end_id`, `forced_close_ids` — the ids of
"\\n</think>\\n\\n" —, `starts_in_thinking`). After each step's sampling the runner calls

    force_thinking_close(sampled, requests)

which, for every request that is inside its think block and has used `thinking_budget` tokens
there, replaces the sampled token with the next id of `forced_close_ids`. The rule is stateless
(it reads the request's output ids), so it survives preemption, recomputation and swaps, and it
does not depend on the scheduler:

    b  = 0 when the prompt opened the block (starts_in_thinking), else the index after the
         first `think_start_id` in the output (no start tag yet: nothing to force)
    f0 = b + thinking_budget                  where forcing begins
    the model closed the block itself (think_end_id in output[b:f0]): nothing to force
    else p = len(output) - f0; while 0 <= p < len(forced) and output[f0:] == forced[:p]:
         the next token is forced[p]

Tokens that were forced are ordinary output tokens afterwards (they count in usage and in
max_tokens; on the GPU sampler the penalty counts keep the sampled id, not the forced one).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass


def next_forced_id(params, output_ids: Sequence[int]) -> int | None:
    """The token the request must emit next, or None to keep what was sampled."""
    budget = getattr(params, "thinking_budget", None)
    forced = getattr(params, "forced_close_ids", None)
    if budget is None or not forced:
        return None
    if params.starts_in_thinking:
        begin = 0
    else:
        try:
            begin = list(output_ids).index(params.think_start_id) + 1
        except ValueError:
            return None
    f0 = begin + budget
    n = len(output_ids)
    if n < f0:
        return None
    if params.think_end_id in output_ids[begin:f0]:
        return None
    p = n - f0
    if p >= len(forced) or list(output_ids[f0:]) != list(forced[:p]):
        return None
    return int(forced[p])


def force_thinking_close(sampled: Mapping[str, object], requests) -> None:
    """Replace, in place, `sampled[request_id].token_id` where the budget says so."""
    for r in requests:
        if r.sampling_params.thinking_budget is None:
            continue
        token = next_forced_id(r.sampling_params, r.output_token_ids)
        if token is not None and r.request_id in sampled:
            s = sampled[r.request_id]
            s.token_id = token
            s.logprob = None if s.logprob is None else 0.0


Encode = Callable[[str], Sequence[int]]


@dataclass(frozen=True)
class ThinkingBudget:
    """When reasoning has used `max_thinking_tokens`, the engine appends `forced_ids` (the
    tokens of `"\\n</think>\\n\\n"` by default) instead of sampling, and the answer follows.

    Pure: the engine passes how many tokens the reasoning has used and whether it already ended.
    """

    max_thinking_tokens: int
    forced_ids: tuple[int, ...]

    @classmethod
    def from_tokenizer(cls, max_thinking_tokens: int, encode: Encode, end_text: str = "\n</think>\n\n") -> "ThinkingBudget":
        if max_thinking_tokens < 0:
            raise ValueError(f"max thinking tokens must be >= 0, got {max_thinking_tokens}")
        forced = tuple(encode(end_text))
        if not forced:
            raise ValueError(f"the tokenizer encodes {end_text!r} to no tokens")
        return cls(max_thinking_tokens, forced)

    def ids_to_force(self, thinking_tokens: int, reasoning_ended: bool) -> tuple[int, ...]:
        """The ids to force now: empty while under budget or after reasoning ended."""
        if reasoning_ended or thinking_tokens < self.max_thinking_tokens:
            return ()
        return self.forced_ids
