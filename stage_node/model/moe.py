"""A mixture-of-experts MLP (Qwen3-MoE, Mixtral, Qwen2-MoE, GLM-4.5, DeepSeek V2 / V3, gpt-oss): the
router picks `top_k` experts per row; the row's output is their gated MLPs' outputs, each weighted by
its routing weight, summed; plus, where the model has one, a shared expert every row runs.

Routing (`route`, shared by every way below, no host sync) follows the family's HF router
(common.families.MoE): softmax or sigmoid scores in float32, a correction bias that only chooses,
group-limited choice, renormalising and a scaling factor; gpt-oss's softmax over its top k logits.

Two ways to compute it, with the same arithmetic per row:
  * grouped (`experts_grouped`): the rows routed to an expert go through it together, expert by
    expert in ascending order, each adding its share into the row's output in that order (as HF
    does). On a CPU every product picks its kernel by its rows' kind (stage_node.ops), so a row's
    result does not depend on which other rows share the step or its experts: a decode row's by
    `w @ x.T` padded to 4 rows, a prompt row's by `x @ w.T` with at least 4. Data-dependent
    shapes and a host sync: eager only.
  * gathered (`experts_gathered`, CUDA, up to 32 rows): each (row, slot) gathers its expert's
    matrices and multiplies them alone (a batched product of one row each), then the slots are
    summed in the router's order. Fixed shapes and no sync: what a CUDA graph replays.
  * on CUDA with Triton, every row count: stage_node.kernels.grouped's kernels (the top k after
    the router's product, then the experts), each chosen expert's matrices read once per step, a
    row's bits independent of its step, no host sync (a CUDA graph of any bucket replays it).
    `route` and the gathered way stay the reference they are tested against (and the way
    without Triton).
Quantized experts (a list of one matrix per expert) always go the grouped way.
"""
from __future__ import annotations

import torch

from logicpipe.common.families import MoE
from logicpipe.stage_node.kernels import grouped, invariant
from logicpipe.stage_node.model.ops import Rows, linear, rowwise
from logicpipe.stage_node.model.weights import Experts

GATHER_MAX_ROWS = 32  # CUDA: steps up to this many rows take the gathered way (the largest graph bucket of an MoE stage)


def route(h: torch.Tensor, experts: Experts, moe: MoE, rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """h: [T, hidden] -> (weights [T, k], expert ids [T, k]), as HF's routers compute them: softmax
    (or sigmoid) of the router's logits in float32; the experts chosen by those scores (plus the
    correction bias, among the top `topk_group` groups); their weights the plain scores, renormalised
    if the config says, times routed_scaling_factor; cast to the model dtype unless the family scales
    in float32. `moe.scoring` "topk_softmax" (gpt-oss): the top k of the logits (the router has a
    bias), then the softmax over those k, in the model dtype."""
    if moe.scoring == "topk_softmax":
        logits = linear(h, experts.router, experts.router_bias, rows)  # [T, experts]
        top, idx = torch.topk(logits, moe.top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), idx
    if moe.router_in_float:  # DeepSeek / GLM: the float32 router over the rows in float32
        logits = linear(h.float(), experts.router, None, rows)  # [T, experts]
    else:
        logits = linear(h, experts.router, None, rows).float()
    scores = rowwise(torch.sigmoid, logits) if moe.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores if experts.correction_bias is None else scores + experts.correction_bias
    if moe.n_group > 1 and moe.topk_group < moe.n_group:
        by_group = choice.view(choice.shape[0], moe.n_group, -1)  # [T, groups, experts per group]
        group_scores = by_group.topk(2, dim=-1)[0].sum(dim=-1) if moe.group_score == "top2" else by_group.amax(-1)
        keep = torch.zeros_like(group_scores).scatter_(1, torch.topk(group_scores, moe.topk_group, dim=-1)[1], 1)
        keep = keep[:, :, None].expand_as(by_group).reshape(choice.shape).bool()
        choice = choice.masked_fill(~keep, float("-inf") if moe.group_score == "top2" else 0.0)
    if experts.correction_bias is None:  # the chosen scores are the weights (V2: of the masked scores)
        top, idx = torch.topk(choice, moe.top_k, dim=-1)
    else:
        idx = torch.topk(choice, moe.top_k, dim=-1)[1]
        top = scores.gather(1, idx)
    if moe.norm_topk_prob:
        top = top / (top.sum(dim=-1, keepdim=True) + moe.norm_eps) if moe.norm_eps else top / top.sum(-1, keepdim=True)
    if moe.routed_scaling_factor != 1.0:
        top = top * moe.routed_scaling_factor
    return (top if moe.weights_in_float else top.to(h.dtype)), idx


def experts_forward(h: torch.Tensor, experts: Experts, moe: MoE, glu, rows: Rows) -> torch.Tensor:
    """The mixture's output for h: [T, hidden] -> [T, hidden]; glu: the gated nonlinearity over an
    expert's fused gate/up product (ops.glu). With a part of the experts (a tensor-parallel rank's,
    model.tp): the part of the output its experts give (a routed expert held elsewhere counts zero)."""
    if h.is_cuda and not isinstance(experts.gate_up, list) and invariant.triton_available():
        # every row count: the experts by stage_node.kernels.grouped's kernels; the top k by its one-program
        # router where the family routes plainly (softmax, top k), else by `route` (torch, no host sync)
        if plain_routing(moe, experts):
            weights, idx = grouped.route(linear(h, experts.router, None, rows), moe, h.dtype)
        else:
            weights, idx = route(h, experts, moe, rows)
        out = grouped.experts(h, experts, *held_here(weights, idx, experts), glu)
        return out if experts.shared_gate_up is None else out + shared_expert(h, experts, glu, rows)
    weights, idx = route(h, experts, moe, rows)
    if h.is_cuda and h.shape[0] <= GATHER_MAX_ROWS and not isinstance(experts.gate_up, list):
        out = experts_gathered(h, experts, *held_here(weights, idx, experts), glu)
    else:
        out = experts_grouped(h, experts, weights, idx - experts.first if experts.first else idx, glu, rows)
    return out if experts.shared_gate_up is None else out + shared_expert(h, experts, glu, rows)


def held_here(weights: torch.Tensor, idx: torch.Tensor, experts: Experts) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, local ids) of the routed experts for kernels that run every (row, slot): a slot whose
    expert is held elsewhere (a tensor-parallel rank's part, model.tp) weighs zero and points at expert 0."""
    n = len(experts.gate_up)
    if experts.first == 0 and n == experts.router.shape[0]:
        return weights, idx
    local = idx - experts.first
    here = (local >= 0) & (local < n)
    return torch.where(here, weights, torch.zeros_like(weights)), torch.where(here, local, torch.zeros_like(local))


def plain_routing(moe: MoE, experts: Experts) -> bool:
    """Whether `moe` routes as grouped.route computes: softmax of the model-dtype router's logits, the
    top k, renormalised or not (Qwen3-MoE, Qwen2-MoE, Mixtral)."""
    return (moe.scoring == "softmax" and not moe.router_in_float and experts.correction_bias is None
            and experts.router_bias is None and moe.n_group == 1 and moe.routed_scaling_factor == 1.0)


def shared_expert(h: torch.Tensor, experts: Experts, glu, rows: Rows) -> torch.Tensor:
    """The shared expert's output for h: [T, hidden] -> [T, hidden] (a dense gated MLP every row runs;
    Qwen2-MoE's scaled by sigmoid(h . gate)), as HF adds it to the routed output."""
    y = linear(glu(linear(h, experts.shared_gate_up, None, rows)), experts.shared_down, None, rows)
    if experts.shared_gate is not None:
        y = rowwise(torch.sigmoid, linear(h, experts.shared_gate, None, rows)) * y  # gate: [1, hidden]
    return y


def _bias(b: torch.Tensor | None, e) -> torch.Tensor | None:
    return None if b is None else b[e]


def _expert(x: torch.Tensor, experts: Experts, e: int, glu, rows: Rows) -> torch.Tensor:
    h = glu(linear(x, experts.gate_up[e], _bias(experts.gate_up_bias, e), rows))
    return linear(h, experts.down[e], _bias(experts.down_bias, e), rows)


def experts_grouped(h: torch.Tensor, experts: Experts, weights: torch.Tensor, idx: torch.Tensor, glu,
                    rows: Rows) -> torch.Tensor:
    """idx: the routed experts' ids among experts.gate_up (one held elsewhere: out of range, skipped)."""
    out = torch.zeros_like(h)
    n = len(experts.gate_up)
    for e in idx.unique().tolist():  # ascending
        if not 0 <= e < n:
            continue
        tok, slot = torch.where(idx == e)
        part = rows.subset(tok.tolist(), h.device)
        y = _expert(h[tok], experts, e, glu, part) * weights[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def experts_gathered(h: torch.Tensor, experts: Experts, weights: torch.Tensor, idx: torch.Tensor,
                     glu) -> torch.Tensor:
    T, k = idx.shape
    flat = idx.reshape(-1)  # [T * k]
    x = h.repeat_interleave(k, dim=0)[:, :, None]  # [T * k, hidden, 1]
    gate_up = torch.bmm(experts.gate_up.index_select(0, flat), x).squeeze(-1)  # [T * k, 2 * inter]
    if experts.gate_up_bias is not None:
        gate_up = gate_up + experts.gate_up_bias.index_select(0, flat)
    y = torch.bmm(experts.down.index_select(0, flat), glu(gate_up)[:, :, None]).squeeze(-1)  # [T * k, hidden]
    if experts.down_bias is not None:
        y = y + experts.down_bias.index_select(0, flat)
    return (y.view(T, k, -1) * weights[:, :, None]).to(h.dtype).sum(dim=1)
