"""Typed, validated configuration: the one home of defaults.

`EngineConfig` is what the engine core needs (batching limits, cache sizes, device); the serve
layer (`ServeConfig`) adds network and process settings on top. Defaults follow the operator
reference in shared/seeds.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


# --ssm-h-dtype: the dtype the GDN recurrent state is pooled in between steps (it is fp32 inside
# a step either way; a 16-bit pool rounds it once per sequence per step). f16 keeps 3 more bits
# than bf16 but saturates at 65504; bf16 has fp32's range.
SSM_H_DTYPES = ("f32", "f16-pool", "bf16-pool")


def ssm_pool_dtype(name: str) -> np.dtype:
    import ml_dtypes

    return {"f32": np.dtype(np.float32), "f16-pool": np.dtype(np.float16),
            "bf16-pool": np.dtype(ml_dtypes.bfloat16)}[name]


class ConfigError(ValueError):
    """A setting out of range: the message names the flag and what is accepted."""


@dataclass
class EngineConfig:
    device: str = "auto"                  # auto | cpu | cuda
    dtype: str = "auto"                   # auto (fp32 on cpu, bf16 on cuda) | float32 | bfloat16
    max_seq_len: int = 32768
    max_batch_size: int = 8               # sequences per decode step
    max_num_seqs: int = 128               # queued + running
    max_prefill_tokens: int = 8192        # new tokens per step (chunked prefill budget)
    block_size: int = 16                  # tokens per KV block
    num_kv_blocks: int = 0                # 0 = size from memory
    kv_cache_memory_mb: int = 0           # cpu backend: 0 = enough for max_batch_size x max_seq_len, capped
    gpu_memory_utilization: float = 0.90
    oom_guard_mb: int = 4096
    enable_prefix_caching: bool = False
    ssm_cache_slots: int = 16
    ssm_checkpoint_interval: int = 256    # tokens between GDN state snapshots
    ssm_h_dtype: str = "f32"              # GDN state pool: f32 | f16-pool | bf16-pool (half the bytes)
    # KV cache precision (metrale.cache.kv_dtypes). The operator reference's default is fp8; ours
    # stays bf16 until the fp8 kernels (kernels_cuda/kv_quant.cu, attention.cu `_fp8`) are
    # measured on the H200: CUDA runs bf16 and fp8 and refuses the other dtypes
    # (check_backend); the CPU suite compares against HF at 1e-4 with unquantized KV.
    kv_cache_dtype: str = "bf16"          # bf16 | fp8 | nvfp4 | turbo2|3|4|8 | the nine <K>k_<V>v pairs
    kv_high_precision_layers: str = "0"   # N | auto (2) | max | all; 0 = the dtype's automatic value
    fp8_kv_calibration_tokens: int = 0    # fp8 KV: calibrate fixed per-layer scales over N tokens
    scheduler: str = "fifo"               # fifo | slai
    tbt_deadline_ms: float = 100.0
    request_timeout: float = 300.0        # seconds, 0 disables
    swap_space_gb: float = 3.0
    auto_compact: float = 0.0             # compact a context at F x max_seq_len (0 = off)
    default_min_p: float = 0.08           # min_p of requests that set none (nor the model's
    default_top_n_sigma: float = 1.0      # generation_config.json); 0 = off
    adaptive_sampling: bool = False       # entropy-gated greedy (metrale.sampling)
    profile: bool = False
    warmup: str = "auto"                  # startup warm-up: auto (on for cuda) | on | off
    prefill_graphs: str = "on"            # CUDA graphs for prefill / mixed steps too: on | off
    seed: int | None = None               # engine seed for unseeded requests; None = from the OS
    # speculative decoding (metrale.spec; the operator reference's flags)
    speculative: bool = False             # MTP drafts (with prompt_lookup_decoding: copies first)
    num_drafts: int = 1                   # drafts per verify (K = num_drafts + 1 rows)
    draft_confidence_stop: float = 0.0    # TAU in (0, 1): an MTP chain stops after a draft < TAU
    mtp_quantization: str = "bf16"        # the MTP head's precision: bf16 | fp8 | nvfp4
    mtp_vocab: int = 100000               # MTP head scores ids [0, N) (0 = the whole vocab)
    self_speculative: bool = False        # layer-skipping drafter
    ngram_speculative: bool = False       # CPU-side n-gram drafter
    prompt_lookup_decoding: bool = False  # copies of earlier context (needs speculative)
    prompt_lookup_ngram: int = 4
    prompt_lookup_max_drafts: int = 8
    prompt_lookup_min_match: int = 8
    prompt_lookup_miss_backoff: int = 16
    prompt_lookup_max_seqs: int = 8
    dflash: bool = False                  # refused: see _validate_speculation
    # stored responses and conversations (metrale.store): retention
    store_max_items: int = 0              # objects kept; the oldest evicted past it (0 = no limit)
    store_ttl: float = 0.0                # seconds after an object's last write (0 = forever)

    def validate(self) -> "EngineConfig":
        positive = ("max_seq_len", "max_batch_size", "max_num_seqs", "max_prefill_tokens",
                    "block_size", "ssm_cache_slots", "ssm_checkpoint_interval")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "bfloat16", "bf16", "float32"):
            raise ConfigError(f"dtype must be auto, bfloat16 or float32, got {self.dtype!r}")
        if self.ssm_h_dtype not in SSM_H_DTYPES:
            raise ConfigError(f"--ssm-h-dtype must be one of {', '.join(SSM_H_DTYPES)}, "
                              f"got {self.ssm_h_dtype!r}")
        self._validate_kv_cache()
        if self.warmup not in ("auto", "on", "off"):
            raise ConfigError(f"--warmup must be auto, on or off, got {self.warmup!r}")
        if self.prefill_graphs not in ("on", "off"):
            raise ConfigError(f"--prefill-graphs must be on or off, got {self.prefill_graphs!r}")
        if self.scheduler not in ("fifo", "slai"):
            raise ConfigError(f"--scheduler must be fifo or slai, got {self.scheduler!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("--gpu-memory-utilization must be in (0, 1]")
        if not 0.0 <= self.auto_compact <= 1.0:
            raise ConfigError("--auto-compact must be in [0, 1] (0 disables)")
        if self.swap_space_gb < 0:
            raise ConfigError("--swap-space-gb must be >= 0 (0 disables swapping)")
        if self.request_timeout < 0:
            raise ConfigError("--request-timeout must be >= 0 (0 disables)")
        if self.store_max_items < 0 or self.store_ttl < 0:
            raise ConfigError("--store-max-items and --store-ttl must be >= 0 (0 = no limit)")
        self._validate_sampling()
        self._validate_speculation()
        if self.max_batch_size > self.max_num_seqs:
            self.max_num_seqs = self.max_batch_size
        return self

    def _validate_kv_cache(self) -> None:
        from metrale.cache.kv_dtypes import KV_CACHE_DTYPES

        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")
        if self.fp8_kv_calibration_tokens < 0:
            raise ConfigError(f"--fp8-kv-calibration-tokens must be >= 0 (0 = per-vector scales "
                              f"only), got {self.fp8_kv_calibration_tokens}")
        # --kv-high-precision-layers is never refused: the engine warns on an unparseable value
        # and uses 0 (the operator reference's rule; kv_dtypes.high_precision_layers)

    def check_backend(self, backend: str) -> None:
        """Refuse what the chosen backend cannot run yet (called once the device is known)."""
        if backend != "cuda" or self.kv_cache_dtype == "bf16":
            return
        if self.kv_cache_dtype != "fp8":
            raise ConfigError(
                f"--kv-cache-dtype {self.kv_cache_dtype} is not implemented on the CUDA backend "
                f"yet (its attention kernels read bf16 and fp8 KV): serve with --kv-cache-dtype "
                f"fp8 or bf16, or run this KV dtype on the CPU backend (--device cpu)")
        if self.fp8_kv_calibration_tokens:
            raise ConfigError(
                f"--fp8-kv-calibration-tokens {self.fp8_kv_calibration_tokens} is not implemented "
                f"on the CUDA backend yet (its fp8 KV keeps a scale per vector): leave it at 0, "
                f"or calibrate on the CPU backend (--device cpu)")

    def _validate_sampling(self) -> None:
        if not 0.0 <= self.default_min_p <= 1.0:
            raise ConfigError(f"--default-min-p must be in [0, 1] (0 disables), got "
                              f"{self.default_min_p}")
        if not self.default_top_n_sigma >= 0.0:
            raise ConfigError(f"--default-top-n-sigma must be >= 0 (0 disables), got "
                              f"{self.default_top_n_sigma}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise ConfigError(f"--seed must be an integer in [0, 2^63), got {self.seed!r}")

    def _validate_speculation(self) -> None:
        """The operator reference's rules: --speculative, --self-speculative and
        --ngram-speculative may be combined (resolved by precedence ngram -> self-spec -> MTP,
        metrale.spec); --prompt-lookup-decoding requires --speculative and conflicts with
        --dflash, --self-speculative and --ngram-speculative; --dflash conflicts with
        --speculative."""
        if not 1 <= self.num_drafts <= 16:
            raise ConfigError(f"--num-drafts must be in 1..16, got {self.num_drafts}")
        if self.draft_confidence_stop and not 0.0 < self.draft_confidence_stop < 1.0:
            raise ConfigError(f"--draft-confidence-stop must be in (0, 1), got "
                              f"{self.draft_confidence_stop}")
        if self.draft_confidence_stop and not self.speculative:
            raise ConfigError("--draft-confidence-stop needs --speculative (it stops MTP chains)")
        if self.mtp_quantization not in ("bf16", "fp8", "nvfp4"):
            raise ConfigError(f"--mtp-quantization must be bf16, fp8 or nvfp4, got "
                              f"{self.mtp_quantization!r}")
        if self.mtp_vocab < 0:
            raise ConfigError(f"--mtp-vocab must be >= 0 (0 = the whole vocab), got {self.mtp_vocab}")
        if self.dflash:
            if self.speculative:
                raise ConfigError("--dflash conflicts with --speculative")
            raise ConfigError(
                "--dflash (DFlash, Chen, Liang and Liu, z-lab.ai/projects/dflash: a separately "
                "trained block-diffusion draft model, conditioned on the target's hidden "
                "features, that drafts a block of tokens in one forward pass) needs its draft "
                "checkpoint (z-lab/<model>-DFlash, a trust-remote-code architecture), which this "
                "build does not load: use --speculative (MTP), --prompt-lookup-decoding or "
                "--ngram-speculative")
        if self.prompt_lookup_decoding:
            if not self.speculative:
                raise ConfigError("--prompt-lookup-decoding requires --speculative")
            for flag, on in (("--self-speculative", self.self_speculative),
                             ("--ngram-speculative", self.ngram_speculative)):
                if on:
                    raise ConfigError(f"--prompt-lookup-decoding conflicts with {flag}")
        if not 1 <= self.prompt_lookup_max_drafts <= 16:
            raise ConfigError(f"--prompt-lookup-max-drafts must be in 1..16, got "
                              f"{self.prompt_lookup_max_drafts}")
        for name in ("prompt_lookup_ngram", "prompt_lookup_min_match", "prompt_lookup_max_seqs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.prompt_lookup_miss_backoff < 0:
            raise ConfigError(f"--prompt-lookup-miss-backoff must be >= 0 (0 never skips), got "
                              f"{self.prompt_lookup_miss_backoff}")
