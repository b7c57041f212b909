"""The general MoE block (stage_node.model.moe with common.families.moe_of_config) against HF's own
MoE modules of DeepSeek V2 and V3 and GLM-4.5: sigmoid or softmax scores, the correction bias,
group-limited choice (n_group > 1, topk_group < n_group), routed_scaling_factor != 1 and shared
experts, on random rows; both ways to the experts (grouped, and the CUDA graphs' gathered one, here
on the CPU)."""
from __future__ import annotations

import pytest
import torch

from logicpipe.common.families import ModelError, moe_of_config
from logicpipe.stage_node.model.moe import experts_forward, experts_gathered, route, shared_expert
from logicpipe.stage_node.model.ops import Rows, glu
from logicpipe.stage_node.model.weights import Experts

TINY = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4,
            n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, num_hidden_layers=3,
            first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, vocab_size=128)


def hf_block(family: str, **extra):
    """(HF's MoE module with random weights, its config dict)."""
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config as Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as Block
    elif family == "deepseek_v2":
        from transformers import DeepseekV2Config as Config
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe as Block
        extra = {"topk_method": "group_limited_greedy", **extra}
    else:
        from transformers import Glm4MoeConfig as Config
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE as Block
    config = Config(**{**TINY, **extra})
    torch.manual_seed(0)
    block = Block(config).eval()
    with torch.no_grad():
        for name, t in [*block.named_parameters(), *block.named_buffers()]:
            t.copy_(torch.rand_like(t) * 0.5 if "correction_bias" in name else torch.randn_like(t) * 0.3)
    return block, config.to_dict()


def ours(block) -> Experts:
    """The block's weights as build_layer holds them (router and bias in float32)."""
    s = block.shared_experts
    bias = getattr(block.gate, "e_score_correction_bias", None)
    return Experts(router=block.gate.weight.detach().float(), gate_up=block.experts.gate_up_proj.detach(),
                   down=block.experts.down_proj.detach(), correction_bias=None if bias is None else bias.float(),
                   shared_gate_up=torch.cat([s.gate_proj.weight, s.up_proj.weight]).detach(),
                   shared_down=s.down_proj.weight.detach())


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2", "glm4_moe"])
@pytest.mark.parametrize("norm", [True, False])
def test_the_moe_block_equals_transformers(family, norm):
    if family == "deepseek_v2" and norm:
        with pytest.raises(ModelError, match="norm_topk_prob"):
            moe_of_config(hf_block(family)[1] | {"norm_topk_prob": True}, family)
        return
    block, raw = hf_block(family, norm_topk_prob=norm)
    moe = moe_of_config(raw, family)
    assert moe.layers == (False, True, True) and moe.shared_intermediate_size == 64
    assert (moe.n_group, moe.topk_group, moe.routed_scaling_factor) == (4, 2, 2.5)
    experts = ours(block)
    h = torch.randn(37, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = block(h[None])[0]
        _, hf_weights, hf_idx = block.gate(h)
    rows = Rows(None, None, all_prompt=True)
    weights, idx = route(h, experts, moe, rows)
    order, hf_order = idx.sort(-1), hf_idx.sort(-1)
    assert torch.equal(order.values, hf_order.values), "the chosen experts"
    torch.testing.assert_close(weights.gather(1, order.indices), hf_weights.gather(1, hf_order.indices))
    act = glu("silu")
    got = experts_forward(h, experts, moe, act, rows)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-5, f"{family}: relative error {err:.3g}"
    gathered = experts_gathered(h, experts, weights, idx, act) + shared_expert(h, experts, act, rows)
    assert ((gathered - want).abs().max() / want.abs().max()).item() <= 1e-5


def test_group_limited_routing_keeps_to_the_chosen_groups():
    """Every chosen expert lies in one of the topk_group groups (DeepSeek V3's routing)."""
    block, raw = hf_block("deepseek_v3")
    moe = moe_of_config(raw, "deepseek_v3")
    h = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    _, idx = route(h, ours(block), moe, Rows(None, None, all_decode=True))
    groups = idx // (moe.num_experts // moe.n_group)
    assert all(len(set(g)) <= moe.topk_group for g in groups.tolist())


@pytest.mark.parametrize("bad, match", [({"n_group": 3}, "n_group"), ({"topk_group": 5}, "topk_group"),
                                        ({"moe_layer_freq": 2}, "moe_layer_freq"),
                                        ({"topk_method": "greedy"}, "topk_method")])
def test_routing_the_forward_cannot_run_is_refused(bad, match):
    raw = hf_block("deepseek_v3")[1] | bad
    with pytest.raises(ModelError, match=match):
        moe_of_config(raw, "deepseek_v3")


def test_a_rows_routing_does_not_depend_on_the_rows_beside_it():
    """Batch invariance of the sigmoid router (8 experts: a row's 8 scores alone went by torch's scalar
    tail, beside two other rows by its vector loop, and rounded otherwise: deepseek_v3's decode rows
    differed alone and in a step with others)."""
    block, raw = hf_block("deepseek_v3", n_routed_experts=8, num_experts_per_tok=2)
    moe, experts = moe_of_config(raw, "deepseek_v3"), ours(block)
    h = torch.randn(64, 64, generator=torch.Generator().manual_seed(4)) * 0.1  # scores away from 0 and 1
    rows = Rows(None, None, all_decode=True)
    logits = torch.mm(h, experts.router.t())
    assert any(not torch.equal(torch.sigmoid(logits[i: i + 1]), torch.sigmoid(logits)[i: i + 1])
               for i in range(64))  # the rounding in question (torch's own, without the padding)
    among = route(h, experts, moe, rows)
    for i in range(64):
        alone = route(h[i: i + 1], experts, moe, rows)
        assert torch.equal(alone[0], among[0][i: i + 1]) and torch.equal(alone[1], among[1][i: i + 1]), i
