"""The Qwen3.5 / 3.6 MTP head (metrale.models.mtp) on tiny dense and MoE checkpoints carrying
random `mtp.*` tensors (tests.tiny_models.add_mtp; HF does not save them).

The oracle is an independent numpy transcription of the head written here from the raw
safetensors (fp32): embedding -> zero-centred RMSNorm, target hidden -> zero-centred RMSNorm,
fc([e | h]), one gated full-attention decoder layer (per-head [q | gate] q_proj, q/k head norms,
partial NeoX rotary, causal GQA over the positions, sigmoid output gate) with the dense SwiGLU
MLP or the softmax top-k MoE + sigmoid-gated shared expert, final norm, the main lm head.
Tolerance: max |ours - ref| / max |ref| <= 1e-4 (fp32 on both sides; observed ~1e-6).
The target hidden states fed in are the main model's own (CausalLM.forward_with_hidden),
themselves checked against HF's text model.
"""
from __future__ import annotations

import json
import os
import shutil

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from metrale.backends.cpu import CpuOps
from metrale.cache.kv import AttentionSpec, ModelCaches
from metrale.forward import contiguous_batch
from metrale.models.checkpoint import CheckpointError
from metrale.models.mtp import shift_input_ids
from metrale.models.quant import QuantizedTensor
from metrale.models.registry import build_model
from tiny_models import VOCAB, add_mtp, load_hf, load_tiny, make_tiny, quantize_tiny, rewrite_config

RTOL = 1e-4
ARCHS = ("qwen3_5", "qwen3_5_moe")
BLOCK, NUM_BLOCKS = 4, 64
PROMPT = np.random.default_rng(7).integers(0, VOCAB, 37).tolist()
OTHER = np.random.default_rng(8).integers(0, VOCAB, 23).tolist()


def rel_err(ours, ref) -> float:
    return float(np.max(np.abs(np.asarray(ours, np.float64) - ref)) / np.max(np.abs(ref)))


# ---- the numpy oracle ------------------------------------------------------------------------

class Reference:
    """The MTP head from the raw tensors of a tiny checkpoint, fp32 numpy, one sequence."""

    def __init__(self, path):
        self.t = {k: v.astype(np.float32) for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
        with open(os.path.join(path, "config.json")) as f:
            self.c = json.load(f)["text_config"]

    def norm(self, x, name):
        x = x.astype(np.float32)
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + self.c["rms_norm_eps"]) * (1 + self.t[name])

    def rope(self, x, pos):
        d = x.shape[-1]
        rd = int(d * self.c["rope_parameters"]["partial_rotary_factor"])
        inv = self.c["rope_parameters"]["rope_theta"] ** (-np.arange(0, rd, 2, dtype=np.float64) / rd)
        ang = pos[:, None].astype(np.float64) * inv[None]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x1, x2 = x[..., : rd // 2], x[..., rd // 2: rd]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rd:]], -1).astype(np.float32)

    def attention(self, x, pos, p):
        c, t = self.c, self.t
        n, hq, hk, d = len(x), c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        qg = (x @ t[p + "q_proj.weight"].T).reshape(n, hq, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(n, hq * d)
        k = (x @ t[p + "k_proj.weight"].T).reshape(n, hk, d)
        v = (x @ t[p + "v_proj.weight"].T).reshape(n, hk, d)
        q, k = self.rope(self.norm(q, p + "q_norm.weight"), pos), self.rope(self.norm(k, p + "k_norm.weight"), pos)
        out = np.zeros((n, hq, d), np.float32)
        mask = np.triu(np.full((n, n), -np.inf, np.float32), 1)
        for h in range(hq):
            kh = h // (hq // hk)
            s = q[:, h] @ k[:, kh].T * d ** -0.5 + mask
            w = np.exp(s - s.max(-1, keepdims=True))
            out[:, h] = (w / w.sum(-1, keepdims=True)) @ v[:, kh]
        o = out.reshape(n, hq * d) / (1 + np.exp(-gate))
        return o @ t[p + "o_proj.weight"].T

    def swiglu(self, x, gate, up, down):
        g = x @ gate.T
        return (g / (1 + np.exp(-g)) * (x @ up.T)) @ down.T

    def mlp(self, x, p):
        t, c = self.t, self.c
        if "num_experts" not in c:
            return self.swiglu(x, t[p + "gate_proj.weight"], t[p + "up_proj.weight"], t[p + "down_proj.weight"])
        logits = x @ t[p + "gate.weight"].T
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.zeros_like(x)
        for i in range(len(x)):
            top = np.argsort(-probs[i], kind="stable")[: c["num_experts_per_tok"]]
            w = probs[i, top] / (probs[i, top].sum() if c.get("norm_topk_prob", True) else 1.0)
            for e, we in zip(top, w):
                ep = f"{p}experts.{e}."
                out[i] += we * self.swiglu(x[i: i + 1], t[ep + "gate_proj.weight"], t[ep + "up_proj.weight"],
                                           t[ep + "down_proj.weight"])[0]
        sp = p + "shared_expert."
        shared = self.swiglu(x, t[sp + "gate_proj.weight"], t[sp + "up_proj.weight"], t[sp + "down_proj.weight"])
        return out + shared / (1 + np.exp(-(x @ t[p + "shared_expert_gate.weight"].T)))

    def __call__(self, tokens, hidden, positions):
        """(hidden after mtp.norm [n, H], logits [n, V]) of rows (token at p + 1, target hidden
        at p, p) of one sequence, causal over the rows."""
        t = self.t
        e = self.norm(t["model.language_model.embed_tokens.weight"][np.asarray(tokens)], "mtp.pre_fc_norm_embedding.weight")
        h = self.norm(np.asarray(hidden, np.float32), "mtp.pre_fc_norm_hidden.weight")
        x = np.concatenate([e, h], -1) @ t["mtp.fc.weight"].T
        p = "mtp.layers.0."
        x = x + self.attention(self.norm(x, p + "input_layernorm.weight"), np.asarray(positions), p + "self_attn.")
        x = x + self.mlp(self.norm(x, p + "post_attention_layernorm.weight"), p + "mlp.")
        out = self.norm(x, "mtp.norm.weight")
        return out, out @ t["lm_head.weight"].T


# ---- harness ---------------------------------------------------------------------------------

class Harness:
    """A built model with its MTP head, both KV pools over the same shuffled block ids."""

    def __init__(self, path, seed: int = 0, mtp: str = "auto"):
        self.ops = CpuOps()
        self.model = build_model(load_tiny(path), self.ops, mtp=mtp)
        self.caches = ModelCaches(self.model.cache_spec(), self.ops, NUM_BLOCKS, BLOCK, 4)
        if self.model.mtp is not None:
            self.mtp_caches = ModelCaches(self.model.mtp.cache_spec(), self.ops, NUM_BLOCKS, BLOCK, 0)
        self.free = [int(b) for b in np.random.default_rng(seed).permutation(NUM_BLOCKS)]

    def blocks(self, n_tokens: int) -> list[int]:
        n = -(-n_tokens // BLOCK)
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def target(self, tokens_lists, contexts, tables, slots):
        """The main model's all-row logits and final-norm hidden states."""
        batch = contiguous_batch(tokens_lists, contexts, tables, slots, BLOCK, True)
        logits, hidden = self.model.forward_with_hidden(batch, self.caches)
        return np.asarray(logits), np.asarray(hidden)

    def draft(self, tokens_lists, contexts, tables, hidden):
        """MTP rows: token lists are the (shifted) MTP input ids, contexts the MTP KV already
        cached; -> (hidden [T, H], full logits [T, V])."""
        batch = contiguous_batch(tokens_lists, contexts, tables, [0] * len(tables), BLOCK, True)
        out = self.model.mtp.forward(batch, hidden, self.mtp_caches)
        return np.asarray(out), np.asarray(self.model.mtp.logits(out))


@pytest.fixture(scope="module", params=ARCHS)
def ckpt(request, tmp_path_factory):
    """(arch, checkpoint without mtp tensors, the same with them)."""
    root = tmp_path_factory.mktemp(request.param)
    plain = make_tiny(request.param, root / "plain")
    with_mtp = str(root / "mtp")
    shutil.copytree(plain, with_mtp)
    return request.param, plain, add_mtp(with_mtp)


@pytest.fixture(scope="module")
def reference(ckpt):
    return Reference(ckpt[2])


@pytest.fixture(scope="module")
def target_hidden(ckpt):
    """{name: (tokens, final-norm hidden [L, H])} of the two test sequences, by the main model."""
    h = Harness(ckpt[2], mtp="off")
    return {name: (ids, h.target([ids], [0], [h.blocks(len(ids))], [0])[1])
            for name, ids in (("prompt", PROMPT), ("other", OTHER))}


def mtp_rows(ids, next_token):
    """The MTP input ids of a sequence's positions 0..L-1: ids shifted, the next token last."""
    return shift_input_ids(np.asarray(ids), np.array([0, len(ids)]), np.array([next_token])).tolist()


# ---- the main model's hidden states ----------------------------------------------------------

def test_forward_with_hidden_matches_hf_and_forward(ckpt):
    _, _, path = ckpt
    h = Harness(path)
    logits, hidden = h.target([PROMPT], [0], [h.blocks(len(PROMPT))], [1])
    with torch.no_grad():
        ref = load_hf(path).model.language_model(input_ids=torch.tensor([PROMPT])).last_hidden_state[0].numpy()
    assert rel_err(hidden, ref) <= RTOL
    np.testing.assert_array_equal(logits, hidden @ np.asarray(h.model.lm_head).T)


# ---- the head against the oracle -------------------------------------------------------------

def test_one_shot_matches_the_numpy_reference(ckpt, reference, target_hidden):
    ids, hidden = target_hidden["prompt"]
    rows = mtp_rows(ids, 11)
    h = Harness(ckpt[2])
    ours_h, ours_logits = h.draft([rows], [0], [h.blocks(len(ids))], hidden)
    ref_h, ref_logits = reference(rows, hidden, np.arange(len(ids)))
    assert ours_logits.shape == (len(ids), VOCAB)
    assert rel_err(ours_h, ref_h) <= RTOL and rel_err(ours_logits, ref_logits) <= RTOL


def test_two_sequences_in_one_batch_match_each_alone(ckpt, reference, target_hidden):
    """Two sequences in one step, the second on blocks an earlier sequence left dirty."""
    (a, ha), (b, hb) = target_hidden["prompt"], target_hidden["other"]
    h = Harness(ckpt[2], seed=3)
    ta, tb = h.blocks(len(a)), h.blocks(len(b))
    h.draft([mtp_rows(a[:len(b)], 5)], [0], [tb], ha[:len(b)])            # dirties tb's MTP KV
    out_h, out_logits = h.draft([mtp_rows(a, 11), mtp_rows(b, 12)], [0, 0], [ta, tb], np.concatenate([ha, hb]))
    for rows, (ids, hid, nxt) in ((slice(0, len(a)), (a, ha, 11)), (slice(len(a), None), (b, hb, 12))):
        ref_h, ref_logits = reference(mtp_rows(ids, nxt), hid, np.arange(len(ids)))
        assert rel_err(out_h[rows], ref_h) <= RTOL and rel_err(out_logits[rows], ref_logits) <= RTOL


@pytest.mark.parametrize("split", [(20, 1), (9, 1, 13), (36, 1)])
def test_continuation_through_the_mtp_kv_equals_one_shot(ckpt, target_hidden, split):
    """Prefill some positions, then one more (and more chunks): the rows equal the one-shot
    rows, the later ones reading the earlier ones' K/V from the head's own cache."""
    ids, hidden = target_hidden["prompt"]
    rows = mtp_rows(ids, 11)
    h = Harness(ckpt[2], seed=5)
    table = h.blocks(len(ids))
    one_shot_h, one_shot_logits = h.draft([rows], [0], [table], hidden)
    h2 = Harness(ckpt[2], seed=6)
    table = h2.blocks(len(ids))
    start, parts_h, parts_logits = 0, [], []
    for n in split:
        out_h, out_logits = h2.draft([rows[start: start + n]], [start], [table], hidden[start: start + n])
        parts_h.append(out_h)
        parts_logits.append(out_logits)
        start += n
    assert rel_err(np.concatenate(parts_h), one_shot_h[:start]) <= RTOL
    assert rel_err(np.concatenate(parts_logits), one_shot_logits[:start]) <= RTOL


def test_second_draft_step_feeds_the_heads_own_hidden(ckpt, reference, target_hidden):
    """Draft 2 is the head's row at position L, its hidden the head's own output at L - 1 and
    its token draft 1: the oracle's rows 0..L with that row appended."""
    ids, hidden = target_hidden["prompt"]
    rows = mtp_rows(ids, 11)
    h = Harness(ckpt[2], seed=9)
    table = h.blocks(len(ids) + 1)
    out_h, out_logits = h.draft([rows], [0], [table], hidden)
    draft1 = int(np.argmax(out_logits[-1]))
    step_h, step_logits = h.draft([[draft1]], [len(ids)], [table], out_h[-1:])
    ref_h, ref_logits = reference(rows + [draft1], np.concatenate([hidden, out_h[-1:]]), np.arange(len(ids) + 1))
    assert rel_err(step_h, ref_h[-1:]) <= RTOL and rel_err(step_logits, ref_logits[-1:]) <= RTOL


def test_embeds_given_replace_the_lookup(ckpt, target_hidden):
    ids, hidden = target_hidden["prompt"]
    rows = mtp_rows(ids, 11)
    h = Harness(ckpt[2])
    mtp, table = h.model.mtp, h.blocks(len(ids))
    batch = contiguous_batch([rows], [0], [table], [0], BLOCK, True)
    by_ids = mtp.forward(batch, hidden, h.mtp_caches)
    by_embeds = mtp.forward(batch, hidden, h.mtp_caches, embeds=np.asarray(h.model.embed)[rows])
    np.testing.assert_array_equal(by_ids, by_embeds)
    with pytest.raises(ValueError, match="target_hidden has shape"):
        mtp.forward(batch, hidden[:-1], h.mtp_caches)


# ---- --mtp-vocab, sharing, helpers -----------------------------------------------------------

def test_vocab_limit_slices_the_head(ckpt, target_hidden):
    """--mtp-vocab N: logits [T, N], column j = token j (the head's first N rows); 0 and
    N >= vocab = the whole head; negative refused."""
    ids, hidden = target_hidden["prompt"]
    h = Harness(ckpt[2])
    mtp = h.model.mtp
    out = mtp.forward(contiguous_batch([mtp_rows(ids, 3)], [0], [h.blocks(len(ids))], [0], BLOCK, True),
                      hidden, h.mtp_caches)
    full = np.asarray(mtp.logits(out))
    for n in (1, 100, VOCAB - 1):
        limited = np.asarray(mtp.logits(out, n))
        assert limited.shape == (len(ids), n) and mtp.vocab_width(n) == n
        np.testing.assert_allclose(limited, full[:, :n], rtol=1e-6, atol=1e-6 * np.abs(full).max())
    for n in (0, VOCAB, VOCAB + 1000):
        assert mtp.vocab_width(n) == VOCAB
        np.testing.assert_array_equal(np.asarray(mtp.logits(out, n)), full)
    with pytest.raises(ValueError, match="--mtp-vocab -1"):
        mtp.logits(out, -1)


def test_head_shares_the_main_models_embedding_and_lm_head(ckpt):
    h = Harness(ckpt[2])
    mtp = h.model.mtp
    assert mtp.embed is h.model.embed and mtp.lm_head is h.model.lm_head
    assert mtp.cache_spec().layers == (AttentionSpec(2, 32),)


@pytest.mark.parametrize("tie", [True, False])
def test_tied_embeddings_share_one_table(tmp_path, tie):
    path = add_mtp(make_tiny("qwen3_5", tmp_path / "m", num_hidden_layers=2))
    rewrite_config(path, tie_word_embeddings=tie)        # the top-level flag is the one obeyed
    if tie:     # a tied release ships no lm_head (one it ships is used, as transformers does)
        from safetensors.numpy import save_file

        for f in Path(path).glob("*.safetensors"):
            tensors = load_file(f)
            tensors.pop("lm_head.weight", None)
            save_file(tensors, f, metadata={"format": "pt"})
    model = build_model(load_tiny(path), CpuOps())
    assert model.mtp.lm_head is model.lm_head and (model.mtp.embed is model.mtp.lm_head) is tie


def test_shift_input_ids():
    qsl = np.array([0, 3, 3, 5])          # the middle sequence has no rows
    out = shift_input_ids(np.array([10, 11, 12, 20, 21]), qsl, np.array([13, 99, 22]))
    assert out.tolist() == [11, 12, 13, 21, 22]


# ---- loading ---------------------------------------------------------------------------------

def test_checkpoint_without_mtp_loads_as_before(ckpt):
    _, plain, _ = ckpt
    ck = load_tiny(plain)
    assert not any(n.startswith("mtp.") for n in ck.tensors)
    model = build_model(ck, CpuOps())
    assert model.mtp is None and model.mtp_absent == ""
    with pytest.raises(CheckpointError, match="no MTP layers"):
        build_model(ck, CpuOps(), mtp="require")


def test_mtp_tensors_leave_the_main_model_unchanged(ckpt):
    _, plain, path = ckpt
    outs = []
    for p, mode in ((plain, "auto"), (path, "auto"), (path, "off")):
        h = Harness(p, mtp=mode)
        assert (h.model.mtp is not None) == (p == path and mode == "auto")
        outs.append(h.target([PROMPT], [0], [h.blocks(len(PROMPT))], [0])[0])
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


def test_model_mtp_prefix_is_read_as_mtp(ckpt, tmp_path, target_hidden):
    """Tensors saved as `model.mtp.*` load as `mtp.*`."""
    _, _, path = ckpt
    dst = shutil.copytree(path, tmp_path / "m")
    _edit(dst, lambda t: {("model." + k if k.startswith("mtp.") else k): v for k, v in t.items()})
    ids, hidden = target_hidden["prompt"]
    outs = []
    for p in (path, dst):
        h = Harness(p)
        outs.append(h.draft([mtp_rows(ids, 4)], [0], [h.blocks(len(ids))], hidden)[1])
    np.testing.assert_array_equal(outs[0], outs[1])


def _edit(path, edit) -> None:
    from safetensors.numpy import save_file

    file = os.path.join(path, "model.safetensors")
    save_file(edit(load_file(file)), file, metadata={"format": "pt"})


def _error(path, mode="auto") -> str:
    with pytest.raises(CheckpointError) as e:
        build_model(load_tiny(path), CpuOps(), mtp=mode)
    return str(e.value)


@pytest.fixture
def copy(ckpt, tmp_path):
    return lambda: str(shutil.copytree(ckpt[2], tmp_path / "m", dirs_exist_ok=True))


def test_partial_mtp_tensors_are_refused_naming_the_missing(copy):
    path = copy()
    gone = ("mtp.layers.0.self_attn.k_proj.weight", "mtp.norm.weight")
    _edit(path, lambda t: {k: v for k, v in t.items() if k not in gone})
    message = _error(path)
    assert "MTP head is incomplete: 2 of its" in message and all(f"'{n}'" in message for n in gone)


def test_declared_but_absent_head_loads_without_it_unless_required(ckpt, tmp_path):
    _, plain, _ = ckpt
    path = str(shutil.copytree(plain, tmp_path / "m"))
    config = json.load(open(os.path.join(path, "config.json")))
    rewrite_config(path, text_config=dict(config["text_config"], mtp_num_hidden_layers=1))
    model = build_model(load_tiny(path), CpuOps())
    assert model.mtp is None
    assert "mtp_num_hidden_layers: 1" in model.mtp_absent and "'mtp.fc.weight'" in model.mtp_absent
    message = _error(path, "require")
    assert "mtp_num_hidden_layers: 1" in message and "'mtp.fc.weight'" in message \
        and "cannot be built" in message


def _set_text(path, **changes) -> None:
    config = json.load(open(os.path.join(path, "config.json")))
    rewrite_config(path, text_config=dict(config["text_config"], **changes))


def test_layer_count_other_than_one_is_refused(copy):
    path = copy()
    _set_text(path, mtp_num_hidden_layers=2)
    assert "declares 2 MTP layers (mtp_num_hidden_layers: 2); only 1 is supported" in _error(path)


def test_declared_zero_layers_ignores_the_tensors(copy):
    path = copy()
    _set_text(path, mtp_num_hidden_layers=0)
    assert build_model(load_tiny(path), CpuOps()).mtp is None
    assert "declares 0 MTP layers" in _error(path, "require")


def test_undeclared_head_is_built_from_its_tensors(copy):
    """A config without mtp_num_hidden_layers (vLLM's default 1) and the tensors: built."""
    path = copy()
    config = json.load(open(os.path.join(path, "config.json")))
    config["text_config"].pop("mtp_num_hidden_layers")
    rewrite_config(path, text_config=config["text_config"])
    assert build_model(load_tiny(path), CpuOps()).mtp is not None


def test_stray_second_layer_is_refused(copy):
    path = copy()
    _edit(path, lambda t: {**t, **{k.replace("mtp.layers.0.", "mtp.layers.1."): v
                                   for k, v in t.items() if k.startswith("mtp.layers.0.")}})
    assert "MTP layer(s) 1 beside layer 0" in _error(path)


def test_dedicated_embeddings_are_refused(copy):
    path = copy()
    _set_text(path, mtp_use_dedicated_embeddings=True)
    assert "mtp_use_dedicated_embeddings true" in _error(path)


def test_wrong_shape_names_the_tensor(copy):
    path = copy()
    _edit(path, lambda t: {**t, "mtp.fc.weight": t["mtp.fc.weight"][:, :-1].copy()})
    message = _error(path)
    assert "'mtp.fc.weight' has shape (64, 127), expected (64, 128)" in message


def test_quantized_mtp_tensors_read_like_their_dequantisation(ckpt, tmp_path, target_hidden):
    """Block-FP8 mtp.layers.0 linears and mtp.fc go through the same QuantizedTensor path as
    the main model (a quantized fc is read dequantised: it is split by columns at load): the
    head computes what the dequantised checkpoint computes."""
    from safetensors.torch import load_file as load_torch, save_file as save_torch

    from tiny_models import _fp8_block

    arch, _, path = ckpt
    q = quantize_tiny(path, tmp_path / "q", "fp8-block", block=(16, 16))
    for folder, part in ((q, 0), (f"{q}-dequantised", 1)):
        file = os.path.join(folder, "model.safetensors")
        tensors = load_torch(file)
        stored, deq = _fp8_block(tensors["mtp.fc.weight"].float(), (16, 16))
        if part == 0:
            del tensors["mtp.fc.weight"]
            tensors.update({"mtp.fc." + k: v.contiguous() for k, v in stored.items()})
        else:
            tensors["mtp.fc.weight"] = deq
        save_torch(tensors, file, metadata={"format": "pt"})
    ids, hidden = target_hidden["prompt"]
    outs = []
    for p in (q, f"{q}-dequantised"):
        h = Harness(p)
        outs.append(h.draft([mtp_rows(ids, 4)], [0], [h.blocks(len(ids))], hidden)[1])
        if p == q:
            assert isinstance(h.model.mtp.layer.mixer.o, QuantizedTensor)
            assert str(load_tiny(p).tensors["mtp.fc.weight"].dtype) == "float8_e4m3fn"
    assert rel_err(outs[0], outs[1]) <= RTOL
