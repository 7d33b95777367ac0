"""The min-cut partition as a pure function, on hand-built graphs with known answers,
and against brute force over every precedence-closed split of random DAGs."""
import itertools

import networkx as nx
import sympy
from hypothesis import given, settings
from hypothesis import strategies as st

from lamina.splitter import DataflowGraph, decide_partition


def make(edges, sizes, attention, free=()):
    g = nx.DiGraph()
    for u, v in edges:
        g.add_edge(u, v)
    for n in g.nodes:
        g.nodes[n]["bytes"] = sympy.Integer(sizes.get(n, 0))
    order = list(nx.topological_sort(g))
    return DataflowGraph(graph=g, order=order, attention=list(attention),
                         free=frozenset(free), output="out", symbols={})


def test_tensor_read_by_many_is_paid_once():
    # h feeds q (-> attention) and three readers after the attention
    edges = [("ids", "h"), ("h", "q"), ("q", "A"), ("A", "o")] + \
            [(x, f"c{j}") for j in range(3) for x in ("h", "o")] + \
            [(f"c{j}", "out") for j in range(3)]
    sizes = {"ids": 1, "h": 10, "q": 1, "o": 1, "c0": 1, "c1": 1, "c2": 1}
    p = decide_partition(make(edges, sizes, ["A"]))
    assert p.context == (("h",),)
    assert p.context_capacity == (10,)
    assert p.assign == {"ids": 0, "h": 0, "q": 0, "o": 1, "c0": 1, "c1": 1, "c2": 1, "out": 1}


def test_cheaper_tensor_before_the_cut_wins():
    # h (10 B) is needed after attention only through m = proj(h) (2 B): m moves before the cut
    edges = [("ids", "h"), ("h", "q"), ("q", "A"), ("A", "o"), ("h", "m"), ("m", "r"),
             ("o", "r"), ("r", "out")]
    p = decide_partition(make(edges, {"ids": 1, "h": 10, "q": 1, "o": 1, "m": 2, "r": 1}, ["A"]))
    assert p.context == (("m",),)
    assert p.assign["m"] == 0 and p.assign["r"] == 1


def test_qkv_are_free_and_free_nodes_are_not_context():
    # q is read only by the attention; `cos` (from positions) is read after it but is free
    edges = [("ids", "h"), ("h", "q"), ("pos", "cos"), ("cos", "q"), ("q", "A"), ("A", "o"),
             ("cos", "o2"), ("o", "o2"), ("h", "o2"), ("o2", "out")]
    sizes = {"ids": 1, "h": 4, "q": 100, "cos": 1000, "o": 1, "o2": 1}
    p = decide_partition(make(edges, sizes, ["A"], free={"pos", "cos"}))
    assert p.context == (("h",),) and p.context_capacity == (4,)
    assert "cos" not in p.assign and "pos" not in p.assign and "A" not in p.assign


def test_context_passes_through_middle_slices():
    # e (embedding) is read again after the second attention: it is context of both cuts
    edges = [("ids", "e"), ("e", "q0"), ("q0", "A0"), ("A0", "h1"), ("e", "h1"), ("h1", "q1"),
             ("q1", "A1"), ("A1", "h2"), ("h1", "h2"), ("e", "h2"), ("h2", "out")]
    sizes = {"ids": 1, "e": 8, "q0": 1, "h1": 8, "q1": 1, "h2": 1}
    p = decide_partition(make(edges, sizes, ["A0", "A1"]))
    assert p.context == (("e",), ("e", "h1"))
    assert p.assign == {"ids": 0, "e": 0, "q0": 0, "h1": 1, "q1": 1, "h2": 2, "out": 2}
    assert p.num_slices == 3


def _brute_force(dg):
    """Min cost of every precedence-closed S containing anc(A), excluding desc(A)."""
    g, a = dg.graph, dg.attention[0]
    anc, desc = nx.ancestors(g, a), nx.descendants(g, a) | {a}
    region = [u for u in g.nodes if u not in anc and u not in desc]
    best = None
    for r in range(len(region) + 1):
        for extra in itertools.combinations(region, r):
            s = anc | set(extra)
            if any(p not in s for u in s for p in g.predecessors(u)):
                continue  # not a runnable prefix
            cost = sum(dg.capacity(u) for u in s if any(
                v not in s and v != a for v in g.successors(u)))
            best = cost if best is None else min(best, cost)
    return best


@st.composite
def random_dag(draw):
    n = draw(st.integers(4, 9))
    names = [f"n{i}" for i in range(n)]
    edges = set()
    for j in range(1, n):  # every node reads at least one earlier node
        for i in draw(st.sets(st.integers(0, j - 1), min_size=1, max_size=3)):
            edges.add((names[i], names[j]))
    a_at = draw(st.integers(1, n - 2))
    # the attention reads one node and is read by a later one
    edges.add((names[a_at - 1], "A"))
    edges.add(("A", names[draw(st.integers(a_at, n - 1))]))
    for u in names:  # sinks feed the output
        if not any(e[0] == u for e in edges):
            edges.add((u, "out"))
    sizes = {u: draw(st.integers(1, 50)) for u in names}
    return make(sorted(edges), sizes, ["A"])


@settings(max_examples=150, deadline=None)
@given(random_dag())
def test_min_cut_equals_brute_force_and_is_closed(dg):
    p = decide_partition(dg)
    assert p.context_capacity[0] == _brute_force(dg)
    s = {u for u, k in p.assign.items() if k == 0}
    for u in s:  # runnable prefix
        assert all(v in s for v in dg.graph.predecessors(u))
