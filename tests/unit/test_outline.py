"""The outline parser: well-formed outlines, missing brackets, unknown and later dependencies
(the only way to a cycle), repeated numbers, junk lines, nothing parsable, too many points; and
the ancestors a point's sequence carries."""
from __future__ import annotations

from logicpipe.controller.jobs.outline import ancestors, parse_outline


def shape(points):
    return [(p.id, p.title, p.deps) for p in points]


def test_a_well_formed_outline():
    points, warnings = parse_outline("1. Boil water. []\n2. Warm the pot. [1]\n3) Add leaves [1, 2]\n")
    assert shape(points) == [(1, "Boil water.", ()), (2, "Warm the pot.", (1,)), (3, "Add leaves", (1, 2))]
    assert warnings == []


def test_repairs_are_made_and_reported():
    text = ("Here is the outline:\n"
            "1. First. [3]\n"          # a later point: dropped (a cycle could form)
            "2. Second. [1, 0]\n"      # 0: no such point
            "\n"
            "2. Again two. [2, 2]\n"   # a repeated number: deps on 2 mean the first 2
            "4. Fourth\n"              # no brackets: no deps
            "Question: and now?\n"     # the outline is over (a small model goes on with another example)
            "1. More.\n")
    points, warnings = parse_outline(text)
    assert shape(points) == [(1, "First.", ()), (2, "Second.", (1,)), (3, "Again two.", (2,)), (4, "Fourth", ())]
    assert any("dependency on 3" in w and "cycle" in w for w in warnings)
    assert any("dependency on 0" in w and "no such point" in w for w in warnings)
    assert any("used twice" in w for w in warnings)
    assert any("not a point" in w and "Here is" in w for w in warnings)
    assert any("follows the outline" in w and "Question" in w for w in warnings)
    assert text[:points[-1].line_end].endswith("4. Fourth\n")  # where the outline ends


def test_a_cycle_written_out_is_broken_and_every_point_can_run():
    points, warnings = parse_outline("1. A. [2]\n2. B. [1]\n")
    assert shape(points) == [(1, "A.", ()), (2, "B.", (1,))] and len(warnings) == 1


def test_nothing_parsable_and_too_many_points():
    points, warnings = parse_outline("I cannot write an outline.")
    assert points == [] and "one point" in warnings[-1]
    points, warnings = parse_outline("\n".join(f"{i}. P{i}." for i in range(1, 12)), max_points=4)
    assert [p.id for p in points] == [1, 2, 3, 4] and "first 4" in warnings[-1]


def test_ancestors_are_transitive_and_in_outline_order():
    points, _ = parse_outline("1. A.\n2. B. [1]\n3. C.\n4. D. [2, 3]\n5. E. [4]\n")
    assert ancestors(points, points[4]) == [1, 2, 3, 4] and ancestors(points, points[0]) == []
