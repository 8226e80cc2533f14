"""The engine's CUDA graphs, captured at load (CudaOps.capture_graphs): decode graphs per batch
bucket, then step graphs per token bucket (--prefill-graphs on) and the speculative verify
steps' graphs, then a drafter's own (the MTP head). Out of memory while capturing step graphs,
those steps run eagerly and the log says so."""
from __future__ import annotations

import logging
import time

from metrale.backends.base import EngineGraphs
from metrale.backends.cuda.graphs import DecodeGraphs, StepGraphs, step_graph_support

log = logging.getLogger("metrale.engine_core")


def capture_engine_graphs(ops, model, caches, cfg, spare_block: int, spare_slot: int,
                          speculation=None) -> EngineGraphs:
    """Every graph the runner replays; none under --profile (kernels run eagerly)."""
    if cfg.profile:
        log.info("--profile: CUDA graphs off, kernels run eagerly")
        return EngineGraphs()
    graphs = DecodeGraphs(model, ops, caches, cfg.max_batch_size,
                          max_blocks_per_seq=-(-cfg.max_seq_len // cfg.block_size),
                          spare_block=spare_block, spare_slot=spare_slot)
    graphs.capture()
    out = EngineGraphs(decode=graphs)
    log.info("captured %d decode graphs (batch buckets %s); graph memory pool %.1f MiB; "
             "programmatic dependent launch %s", len(graphs.graphs), sorted(graphs.graphs),
             graphs.pool.total_bytes() / 2**20, "on" if graphs.pdl else "off")
    if cfg.prefill_graphs == "on":
        out.step = _step_graphs(ops, model, caches, cfg, graphs, spare_block, spare_slot)
    if speculation is not None:
        out.verify = _step_graphs(ops, model, caches, cfg, graphs, spare_block, spare_slot,
                                  verify=True)
        speculation.capture_graphs(graphs)     # a drafter's own forwards (the MTP head)
    return out


def _step_graphs(ops, model, caches, cfg, decode_graphs, spare_block: int, spare_slot: int,
                 verify: bool = False):
    """Prefill / mixed steps per token bucket (StepGraphs) when every layer of the model allows
    it, else None; out of memory while capturing, None (the steps run eagerly) and the log says
    so. `verify`: the speculative verify steps' graphs (VERIFY_BUCKETS), whatever
    --prefill-graphs says."""
    what = "verify" if verify else "prefill"
    why = step_graph_support(model)
    if why is not None:
        log.info("%s graphs: off for this model (%s); those steps run eagerly", what, why)
        return None
    t0 = time.perf_counter()
    oom = None
    try:
        steps = StepGraphs(model, ops, caches, cfg.max_prefill_tokens,
                           cfg.max_batch_size, -(-cfg.max_seq_len // cfg.block_size),
                           spare_block=spare_block, spare_slot=spare_slot,
                           pool=decode_graphs.pool, stream=decode_graphs.stream, verify=verify)
        steps.capture()
    except ops.device.out_of_memory as e:
        oom = str(e)
    if oom is not None:     # outside the except: its traceback no longer pins the partial capture
        steps = None
        decode_graphs.pool.free_all_blocks()     # what the partial capture held, back to the device
        log.warning("%s graphs: out of memory while capturing (%s); those steps run "
                    "eagerly (lower --max-prefill-tokens or --gpu-memory-utilization)", what, oom)
        return None
    log.info("captured %d %s graphs (token buckets %s), %.2f s; graph memory pool now "
             "%.1f MiB", len(steps.graphs), what, sorted(steps.graphs), time.perf_counter() - t0,
             decode_graphs.pool.total_bytes() / 2**20)
    return steps
