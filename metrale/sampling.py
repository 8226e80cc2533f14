"""Sampling parameters and the CPU samplers.

`SamplingParams` is the one description of how a request picks tokens; it crosses the wire
(frontend -> engine) as a plain dict (`to_dict` / `from_dict`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 = off
    min_p: float = 0.0
    top_n_sigma: float = 0.0          # 0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None       # None = off; k >= 0 = chosen token's logprob + top-k
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0
