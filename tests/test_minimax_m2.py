"""MiniMax M2 on the CPU backend against HF transformers' MiniMaxM2ForCausalLM (fp32), on tiny
random checkpoints: sigmoid routing with a (randomised) score-correction bias, whole-projection
q/k norms, partial rotary (half the head). The checkpoint is in the layout save_pretrained writes
(the hub release's block_sparse_moe / w1-w3 names); the transformers-5 fused layout loads the
same. Also: refusals naming the field, the refusal on a backend without the ops (CUDA), and the
family's tool parser default."""
from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import family_checks as fc
from family_checks import ops_without
from metrale.api.tool_parsers import default_tool_parser
from metrale.backends.cpu import CpuOps
from metrale.models.checkpoint import CheckpointError
from metrale.models.registry import build_model
from tiny_models import VOCAB, load_tiny, make_tiny_family, rewrite_config

PROMPT_LEN = 70


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_family("minimax_m2", tmp_path_factory.mktemp("minimax_m2"))


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(1).integers(0, VOCAB, PROMPT_LEN).tolist()


@pytest.fixture(scope="module")
def ref(ckpt, prompt):
    return fc.reference(ckpt, prompt)


def _fuse_experts(src: str, dst) -> str:
    """The same checkpoint with the transformers-5 names: mlp.gate, mlp.experts.gate_up_proj
    [E, 2I, H], mlp.experts.down_proj [E, H, I], mlp.e_score_correction_bias."""
    import shutil

    shutil.copytree(src, dst)
    state = load_file(f"{src}/model.safetensors")
    out = {k: v for k, v in state.items() if ".block_sparse_moe." not in k}
    for layer in range(3):
        p = f"model.layers.{layer}.block_sparse_moe."
        n = f"model.layers.{layer}.mlp."
        out[n + "gate.weight"] = state[p + "gate.weight"]
        out[n + "e_score_correction_bias"] = state[p + "e_score_correction_bias"]
        out[n + "experts.gate_up_proj"] = np.stack([np.concatenate([state[f"{p}experts.{e}.w1.weight"],
                                                                    state[f"{p}experts.{e}.w3.weight"]])
                                                    for e in range(6)])
        out[n + "experts.down_proj"] = np.stack([state[f"{p}experts.{e}.w2.weight"] for e in range(6)])
    save_file(out, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return str(dst)


def test_fused_expert_layout_loads_like_the_release_layout(ckpt, prompt, ref, tmp_path):
    fc.check_one_shot(_fuse_experts(ckpt, tmp_path / "fused"), prompt, ref)


def test_the_routing_bias_is_live(ckpt, prompt, ref, tmp_path):
    """Zeroing e_score_correction_bias changes which experts are chosen: the logits move."""
    path = _fuse_experts(ckpt, tmp_path / "nobias")
    state = load_file(f"{path}/model.safetensors")
    for k in [k for k in state if k.endswith("e_score_correction_bias")]:
        state[k] = np.zeros_like(state[k])
    save_file(state, f"{path}/model.safetensors", metadata={"format": "pt"})
    h = fc.Harness(path)
    ours = h.step([prompt], [0], [h.blocks_for(PROMPT_LEN)], [2])
    assert fc.rel_err(ours, ref) > 1e-2


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(scoring_func="softmax"), "scoring_func 'softmax'"),
    (dict(use_qk_norm=False), "use_qk_norm False"),
    (dict(qk_norm_type="per_head"), "qk_norm_type 'per_head'"),
    (dict(shared_intermediate_size=64), "shared_intermediate_size 64"),
    (dict(rotary_dim=16), "rotary_dim 16"),
])
def test_unsupported_settings_are_refused_naming_the_field(tmp_path, changes, message):
    path = make_tiny_family("minimax_m2", tmp_path)
    rewrite_config(path, **changes)
    with pytest.raises(CheckpointError, match=message):
        build_model(load_tiny(path), CpuOps())


def test_rotary_dim_agreeing_with_the_partial_factor_loads(tmp_path):
    path = make_tiny_family("minimax_m2", tmp_path)
    rewrite_config(path, rotary_dim=8)
    assert build_model(load_tiny(path), CpuOps()).layers[0].mixer.rotary_dim == 8


def _CommonOpsOnly():
    """A backend with the common ops only (as the CUDA backend is today)."""
    return ops_without("route_topk", "moe_topk")


def test_backend_without_the_ops_refuses_at_load(ckpt):
    with pytest.raises(CheckpointError, match="minimax_m2 needs sigmoid MoE routing with a "
                                              "score-correction bias.*cuda kernels do not implement yet"):
        build_model(load_tiny(ckpt), _CommonOpsOnly())


def test_tool_parser_default():
    assert default_tool_parser("minimax_m2") == "minimax_xml"
