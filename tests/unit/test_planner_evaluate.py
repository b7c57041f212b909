"""evaluate_mesh: pipelines in force costed again at a workload, on the same terms as a new plan
(the controller compares the two before it moves any request)."""
from __future__ import annotations

import pytest

from logicpipe.planner import DeviceProfile, Link, ModelSpec, Objective, Workload, evaluate_mesh, make_mesh_plan
from logicpipe.planner.evaluate import split_rows

GiB = 2**30
MODEL = ModelSpec.llama(name="small", hidden_size=1024, intermediate_size=2816, num_heads=16, num_kv_heads=4,
                        vocab_size=32000, num_layers=24, weight_format="fp16")
LAN = Link(bandwidth=1.25e8, latency=5e-4)


def node(name: str, memory: int = 8 * GiB, bandwidth: float = 1e11, others: tuple[str, ...] = ()) -> DeviceProfile:
    return DeviceProfile(name, "cuda", memory, 1e13, bandwidth, links={o: LAN for o in others if o != name})


def test_a_plan_costed_again_at_its_own_workload_predicts_what_it_was_made_with():
    names = ("a", "b", "c")
    nodes = [node(n, others=names) for n in names]
    wl = Workload(context_tokens=2048, batch=12)
    made = make_mesh_plan(nodes, MODEL, wl)
    again = evaluate_mesh(made.pipelines, nodes, MODEL, wl)
    assert [p.node_ids for p in again.pipelines] == [p.node_ids for p in made.pipelines]
    assert sum(p.rows for p in again.pipelines) == 12
    assert again.tokens_per_s == pytest.approx(made.tokens_per_s, rel=0.02)


def test_rows_go_where_they_add_most_and_only_where_their_kv_fits():
    fast, slow = node("fast", bandwidth=4e11), node("slow", bandwidth=1e11)
    wl = Workload(context_tokens=2048, batch=16)
    plans = [make_mesh_plan([n], MODEL, Workload(context_tokens=2048)).pipelines[0] for n in (fast, slow)]
    mesh = evaluate_mesh(plans, [fast, slow], MODEL, wl)
    by_node = {p.node_ids[0]: p for p in mesh.pipelines}
    assert by_node["fast"].rows > by_node["slow"].rows and mesh.rows == 16
    assert mesh.tokens_per_s == pytest.approx(sum(p.tokens_per_s for p in mesh.pipelines))
    # a node with room for the weights and the KV of about 3 sequences takes no more than that
    tight = node("tight", memory=int((MODEL.num_layers * MODEL.layer_weight_bytes + 2 * MODEL.lm_head_bytes
                                      + 3.5 * 2048 * MODEL.num_layers * MODEL.kv_bytes_per_token_per_layer) / 0.9))
    small = make_mesh_plan([tight], MODEL, Workload(context_tokens=2048)).pipelines[0]
    mesh = evaluate_mesh([small], [tight], MODEL, wl)
    assert 1 <= mesh.pipelines[0].rows <= 3


def test_latency_is_one_stream_on_the_first_pipeline_and_bad_input_is_refused():
    a, b = node("a"), node("b")
    plans = [make_mesh_plan([n], MODEL, Workload()).pipelines[0] for n in (a, b)]
    mesh = evaluate_mesh(plans, [a, b], MODEL, Workload(batch=8), Objective.LATENCY)
    assert [p.rows for p in mesh.pipelines] == [1, 1] and mesh.tokens_per_s == mesh.pipelines[0].tokens_per_s
    with pytest.raises(ValueError, match="no pipeline"):
        evaluate_mesh([], [a], MODEL, Workload())
    with pytest.raises(ValueError, match="no profile for node b"):
        evaluate_mesh(plans, [a], MODEL, Workload())


def test_split_rows_is_greedy_on_the_marginal_rate():
    # pipeline 0 saturates at 2 rows; pipeline 1 keeps gaining
    rates = [lambda r: min(r, 2) * 10.0, lambda r: r * 4.0]
    assert split_rows(rates, 5) == [2, 3]
    assert split_rows(rates, 5, [lambda r: True, lambda r: r <= 1]) == [4, 1]
    assert split_rows(rates, 5, [lambda r: r <= 1, lambda r: r <= 1]) == [1, 1]  # the rest would queue
