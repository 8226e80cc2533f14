"""DeepSeek V3 (`deepseek_v3`, metrale.models.deepseek_v3) on the CPU backend against HF
transformers' DeepseekV3ForCausalLM fp32, on tiny random checkpoints of two shapes: V3 style
(q LoRA, interleaved YaRN rope with DeepSeek's mscale, grouped routing, one dense layer) and
V2-Lite style (no q LoRA, plain rope, one group, wider shared experts, two dense layers).
The family checks (tests/family_checks.py: one-shot, prefill-then-decode, chunked prefill, mixed
batch over dirty blocks, greedy through the engine with prefix-cache hits); the router against
HF's; the latent cache's layout and its block moves; block FP8; refusals (CUDA, GGUF, settings);
the MTP layer as a drafter head; `met serve` answering a chat with tools (the deepseek_v3 tool
parser's round trip is in tests/test_family_tools.py)."""
from __future__ import annotations

import re

import numpy as np
import openai
import pytest

import family_checks as fc
from family_checks import ops_without
from metrale.api.tool_parsers import default_tool_parser
from metrale.backends.cpu import CpuOps
from metrale.cache.kv import MlaSpec, ModelCaches
from metrale.config import ConfigError
from metrale.llm import LLM
from metrale.models.checkpoint import CheckpointError
from metrale.models.registry import build_model
from test_models import Harness, rel_err
from tests.serving import Server
from metrale.sampling import SamplingParams
from tiny_models import (DEEPSEEK_ARCHS, VOCAB, add_deepseek_mtp, load_hf, load_tiny, make_tiny_deepseek,
                         quantize_tiny, rewrite_config, write_qwen_tokenizer)

PROMPT_LEN = 70
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "current weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
MLA_OPS = ("mla_prologue", "latent_attention", "gather_latents", "mla_expanded_attention", "head_linear")


@pytest.fixture(scope="module", params=DEEPSEEK_ARCHS)
def ckpt(request, tmp_path_factory):
    return make_tiny_deepseek(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(1).integers(0, VOCAB, PROMPT_LEN).tolist()


@pytest.fixture(scope="module")
def ref(ckpt, prompt):
    return fc.reference(ckpt, prompt)


def test_one_shot_prefill_matches_hf(ckpt, prompt, ref):
    fc.check_one_shot(ckpt, prompt, ref)


def test_prefill_then_decode_matches_hf(ckpt, prompt, ref):
    """Decode steps run the absorbed form, the prefill the expanded one: both equal HF."""
    fc.check_prefill_then_decode(ckpt, prompt, ref)


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_chunked_prefill_matches_hf(ckpt, prompt, ref, chunk):
    fc.check_chunked(ckpt, prompt, ref, chunk)


def test_mixed_batch_matches_each_sequence_alone(ckpt, prompt, ref):
    fc.check_mixed_batch(ckpt, prompt, ref)


def test_engine_greedy_with_prefix_cache_and_batching(ckpt, prompt):
    fc.check_engine_greedy(ckpt, prompt)


def test_yarn_attention_factor_and_attention_bias(tmp_path, prompt):
    """mscale != mscale_all_dim (DeepSeek V2's kind: an attention factor on cos / sin, i.e. on the
    rope dims only) and attention_bias true (q_a / kv_a / o_proj biases)."""
    rope = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5, "rope_theta": 10000.0}
    path = make_tiny_deepseek("deepseek_v3", tmp_path, rope_parameters=rope, attention_bias=True)
    ref = fc.reference(path, prompt)
    fc.check_one_shot(path, prompt, ref)
    fc.check_prefill_then_decode(path, prompt, ref)


def test_the_cache_holds_one_latent_row_per_token(ckpt):
    """MlaSpec: [kv_lora_rank + qk_rope_head_dim] per token and layer, not per-head K/V; the
    block movers (swap) copy its blocks like any KV."""
    h = Harness(ckpt, block_size=4)
    spec = h.model.cache_spec()
    assert all(s == MlaSpec(32, 8) for s in spec.layers)
    assert spec.attention_layers == list(range(len(spec.layers)))
    assert spec.kv_bytes_per_block(4, np.float32) == len(spec.layers) * 4 * 40 * 4
    caches = ModelCaches(spec, CpuOps(), 6, 4, 0)
    assert caches.latent(0).shape == (6, 4, 40)
    for i in spec.attention_layers:
        caches.latent(i)[...] = np.random.default_rng(i).standard_normal((6, 4, 40))
    saved = caches.read_blocks([1, 4])
    assert [a.shape for a in saved] == [(2, 4, 40)] * len(spec.layers)
    other = ModelCaches(spec, CpuOps(), 6, 4, 0)
    other.write_blocks([0, 2], saved)
    assert all(np.array_equal(other.latent(i)[[0, 2]], caches.latent(i)[[1, 4]]) for i in spec.attention_layers)
    with pytest.raises(TypeError, match="caches MlaSpec"):
        caches.kv(0)


def test_router_matches_hf_grouped_topk():
    """CpuOps.route_topk with groups and scale against DeepseekV3TopkRouter (sigmoid scores, the
    correction bias for the choice only, group-limited top-k, renormalised, scaled)."""
    import torch
    import transformers as tf

    config = tf.DeepseekV3Config(hidden_size=16, n_routed_experts=16, n_group=4, topk_group=2,
                                 num_experts_per_tok=4, routed_scaling_factor=2.5, norm_topk_prob=True)
    router = tf.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(16, generator=gen) * 0.5)
        x = torch.randn(64, 16, generator=gen)
        logits, hf_w, hf_e = router(x)
    w, e = CpuOps().route_topk(logits.numpy(), 4, "sigmoid", True, bias=router.e_score_correction_bias.numpy(),
                               groups=(4, 2), scale=2.5)
    order, hf_order = np.argsort(e, axis=1), np.argsort(hf_e.numpy(), axis=1)
    assert np.array_equal(np.take_along_axis(e, order, 1), np.take_along_axis(hf_e.numpy(), hf_order, 1))
    np.testing.assert_allclose(np.take_along_axis(w, order, 1),
                               np.take_along_axis(hf_w.numpy(), hf_order, 1), rtol=1e-6)


@pytest.mark.parametrize("field, value, message", [
    ("scoring_func", "softmax", "scoring_func 'softmax'"),
    ("topk_method", "group_limited_greedy", "topk_method 'group_limited_greedy'"),
    ("n_group", 3, "n_group 3"),
    ("num_key_value_heads", 2, "num_key_value_heads 2"),
    ("hidden_act", "gelu", "hidden_act 'gelu'"),
])
def test_unsupported_settings_are_refused_naming_the_field(tmp_path, field, value, message):
    path = make_tiny_deepseek("deepseek_v3", tmp_path)
    rewrite_config(path, **{field: value})
    with pytest.raises(CheckpointError, match=re.escape(message)):
        build_model(load_tiny(path), CpuOps())


def test_a_quantized_kv_cache_is_refused_clearly(ckpt):
    with pytest.raises(ConfigError, match="multi-head latent attention cache .* bf16"):
        LLM(ckpt, max_seq_len=128, kv_cache_dtype="fp8")


def _NoMlaOps():
    """A backend with the common ops only (as the CUDA backend is today)."""
    return ops_without(*MLA_OPS, "route_topk", "moe_topk")


def test_backend_without_the_ops_refuses_at_load(ckpt):
    with pytest.raises(CheckpointError) as err:
        build_model(load_tiny(ckpt), _NoMlaOps())
    text = str(err.value)
    assert "deepseek_v3 needs" in text and "multi-head latent attention" in text and "ops.latent_attention" in text
    assert "MoE routing" in text and "cuda kernels do not implement yet" in text and "--device cpu" in text


def test_the_real_cuda_backend_lacks_the_ops():
    """What the refusal keys on: CudaOps (imported without a GPU) has none of the MLA ops."""
    cuda_ops = pytest.importorskip("metrale.backends.cuda.ops")
    cls = next(c for n, c in vars(cuda_ops).items() if n.endswith("Ops") and isinstance(c, type)
               and hasattr(c, "attention"))
    assert not any(hasattr(cls, op) for op in MLA_OPS)


def test_a_checkpoint_without_its_mtp_layer_loads_and_require_refuses(ckpt):
    """HF's save_pretrained declares num_nextn_predict_layers 1 but writes no MTP layer: the
    model loads without a head (saying why); asking for one (speculative decoding) is refused."""
    with pytest.raises(CheckpointError, match="no MTP head: config.json declares 1 MTP layers"):
        build_model(load_tiny(ckpt), CpuOps(), mtp="require")
    model = build_model(load_tiny(ckpt), CpuOps())
    assert model.mtp is None and "model.layers." in model.mtp_absent


def test_the_tiny_checkpoint_serves_a_chat_request(tmp_path):
    path = make_tiny_deepseek("deepseek_v3", tmp_path / "model", max_position_embeddings=4096)
    write_qwen_tokenizer(path)
    args = ["serve", path, "--model-name", "m", "--frontends", "1", "--max-seq-len", "1024", "--no-event-log"]
    with Server(args, tmp_path / "serve.log").serving() as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        kw = dict(messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER],
                  max_tokens=12, temperature=0)
        whole = client.chat.completions.create(model="m", **kw).choices[0]
        streamed = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(model="m", stream=True, **kw))
        assert whole.finish_reason in ("length", "stop")
        assert whole.message.content and streamed == whole.message.content
    assert default_tool_parser("deepseek_v3") == "deepseek_v3"


def _forced_logits(path, prompt) -> np.ndarray:
    h = Harness(path)
    return h.step([prompt], [0], [h.blocks_for(len(prompt))], [2])


@pytest.mark.parametrize("arch", DEEPSEEK_ARCHS)
def test_block_fp8_checkpoint_matches_its_dequantised_self(tmp_path, prompt, arch):
    """DeepSeek V3's own release format: transformers fine-grained FP8 (weight_block_size,
    weight_scale_inv) on every linear, q_a / q_b / q_proj, kv_a_proj_with_mqa and kv_b_proj (the
    one MLA splits into W_UK / W_UV) included; the routers kept bf16 as the release keeps them."""
    src = make_tiny_deepseek(arch, tmp_path / "src")
    path = quantize_tiny(src, tmp_path / "fp8", "fp8-block", keep=("mlp.gate.",), block=(8, 8))
    ckpt = load_tiny(path)
    quantized = {n.rsplit(".", 2)[-2] for n in ckpt.tensors if n.endswith("weight_scale_inv")}
    assert {"kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "down_proj"} <= quantized
    assert ({"q_a_proj", "q_b_proj"} if arch == "deepseek_v3" else {"q_proj"}) <= quantized
    assert "gate" not in quantized
    ours = _forced_logits(path, prompt)
    assert rel_err(ours, fc.reference(f"{path}-dequantised", prompt)) <= fc.RTOL
    assert rel_err(ours, fc.reference(src, prompt)) > 10 * fc.RTOL      # the quantization is real
    # transformers' own fine-grained FP8 reader (dequantising on the CPU) agrees
    assert rel_err(ours, fc.reference(path, prompt)) <= fc.RTOL


def test_deepseek2_gguf_is_refused_saying_what_to_serve_instead(tmp_path):
    import gguf

    from metrale.models.loader import load_checkpoint

    path = str(tmp_path / "d.gguf")
    w = gguf.GGUFWriter(path, "deepseek2")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="architecture 'deepseek2' is not supported.*serve the HF checkpoint"):
        load_checkpoint(path, cache_dir=str(tmp_path))


# -- the MTP layer as a drafter head (metrale.models.deepseek_mtp) -------------------------------
def _mtp_reference(path, prompt, next_token) -> np.ndarray:
    """The MTP layer's logits per position from HF's own modules: the main model's final hidden
    states, the embedding of the next token (zero at position 0), enorm / hnorm / eh_proj, HF's
    DeepseekV3DecoderLayer n over the causal sequence, shared_head.norm, the lm head."""
    import torch
    import transformers as tf
    from safetensors.torch import load_file

    mod = tf.models.deepseek_v3.modeling_deepseek_v3
    hf = load_hf(path)
    n, state = hf.config.num_hidden_layers, load_file(f"{path}/model.safetensors")
    p = f"model.layers.{n}."
    layer = mod.DeepseekV3DecoderLayer(hf.config, n).float().eval()
    layer.load_state_dict({k[len(p):]: v.float() for k, v in state.items() if k.startswith(p) and
                           not k[len(p):].startswith(("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens"))})
    norms = {name: mod.DeepseekV3RMSNorm(hf.config.hidden_size, hf.config.rms_norm_eps) for name in
             ("enorm", "hnorm", "shared_head.norm")}
    for name, m in norms.items():
        m.weight.data = state[f"{p}{name}.weight"].float()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        h = hf.model(input_ids=ids).last_hidden_state
        e = hf.model.embed_tokens(torch.tensor([prompt[1:] + [next_token]]))
        e[:, 0] = 0
        x = torch.cat([norms["enorm"](e), norms["hnorm"](h)], -1) @ state[p + "eh_proj.weight"].float().T
        pos = torch.arange(len(prompt))[None]
        mask = torch.full((len(prompt), len(prompt)), float("-inf")).triu(1)[None, None]
        y = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=hf.model.rotary_emb(x, pos))
        return hf.lm_head(norms["shared_head.norm"](y))[0].numpy(), h[0].numpy()


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    return add_deepseek_mtp(make_tiny_deepseek("deepseek_v3", tmp_path_factory.mktemp("mtp"), seed=5), seed=7)


def test_mtp_head_matches_hf_modules_prefill_and_decode(mtp_ckpt, prompt):
    """The head over every position at once (expanded MLA) and then one row at a time (absorbed),
    fed HF's hidden states, against the reference; its cache is one MlaSpec."""
    from metrale.forward import contiguous_batch

    ref, hidden = _mtp_reference(mtp_ckpt, prompt, 7)
    ops = CpuOps()
    head = build_model(load_tiny(mtp_ckpt), ops, mtp="require").mtp
    assert head.cache_spec().layers == (MlaSpec(32, 8),)
    ids, bs, split = prompt[1:] + [7], 4, 50
    table = list(range(-(-len(ids) // bs)))
    caches = ModelCaches(head.cache_spec(), ops, len(table), bs, 0)
    batch = contiguous_batch([ids[:split]], [0], [table], [0], bs, all_logits=True)
    first = head.logits(head.forward(batch, hidden[:split], caches))
    assert rel_err(first, ref[:split]) <= fc.RTOL
    rows = [head.logits(head.forward(contiguous_batch([[ids[q]]], [q], [table], [0], bs), hidden[q: q + 1], caches))
            for q in range(split, len(ids))]
    assert rel_err(np.concatenate(rows), ref[split:]) <= fc.RTOL


def test_speculative_decoding_with_the_mtp_head_keeps_greedy_output(mtp_ckpt, prompt):
    """--speculative on the MTP head: the same greedy tokens as without, drafts proposed and
    verified (prefix-cache hits included: the drafter's private block copies move latents)."""
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = [prompt[:40], prompt[:40] + [3, 4], prompt[:33]]
    kw = dict(max_seq_len=256, max_batch_size=3, block_size=4, max_prefill_tokens=32, enable_prefix_caching=True)
    plain = LLM(mtp_ckpt, **kw)
    want = [plain.generate(p, greedy)[0].token_ids for p in prompts]
    spec = LLM(mtp_ckpt, speculative=True, **kw)
    first = spec.generate(prompts[0], greedy)[0].token_ids
    assert [first] + [r.token_ids for r in spec.generate(prompts[1:], greedy)] == want
    stats = spec.core.speculation.stats
    assert stats.num_verifies > 0 and stats.draft_tokens >= stats.num_verifies
    assert spec.core.speculation.mtp.num_private_copies > 0


def test_an_incomplete_mtp_layer_is_refused(mtp_ckpt, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    path = shutil.copytree(mtp_ckpt, tmp_path / "broken")
    state = load_file(f"{path}/model.safetensors")
    del state["model.layers.3.eh_proj.weight"]
    save_file(state, f"{path}/model.safetensors")
    with pytest.raises(CheckpointError, match="MTP layer is incomplete: missing model.layers.3.eh_proj.weight"):
        build_model(load_tiny(path), CpuOps())


def test_preemption_by_swapping_latent_blocks_gives_the_same_tokens(tmp_path):
    """A pool too small for the batch: requests are preempted, their latent blocks swapped out
    to host memory and back (the swap space moves them by block id like any KV), prefix
    caching on; every request's greedy tokens equal it alone through a roomy engine."""
    from test_engine_cache import engine, prompts, run, with_swap

    from metrale.models.loader import load_checkpoint

    ckpt = load_checkpoint(make_tiny_deepseek("deepseek_v3", tmp_path))
    ps = prompts()
    want = run(engine(ckpt), [{k: v} for k, v in ps.items()])
    core = engine(ckpt, enable_prefix_caching=True, num_kv_blocks=18, swap_space_gb=1.0)
    swap = with_swap(core)
    assert run(core, [ps]) == want
    assert core.scheduler.num_preemptions > 0
    assert swap.num_swap_outs == swap.num_swap_ins == core.scheduler.num_preemptions
