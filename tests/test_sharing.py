"""Processor sharing in the simulator: calls side by side on a node whose devices outnumber its cores."""

import pytest

from loomrl.plan.schedule import Step, StepKind
from loomrl.planner.simulation.sharing import simulate_shared
from loomrl.planner.simulation.simulator import _Node, _schedule


def one_node(_device: int) -> int:
    return 0


def test_two_calls_side_by_side_on_one_core_take_twice_as_long():
    start, end = simulate_shared([1.0, 1.0], [(0,), (1,)], [(), ()], one_node, cores=1.0)
    assert start == [0.0, 0.0] and end == pytest.approx([2.0, 2.0])


def test_a_call_using_every_device_runs_at_its_own_predicted_time():
    # its duration already includes its own slowdown (2 devices on 1 core): alone it is not slowed again
    start, end = simulate_shared([2.0], [(0, 1)], [()], one_node, cores=1.0)
    assert end == pytest.approx([2.0])


def test_staggered_calls_share_only_while_they_overlap():
    # A (1 s alone) on device 0; C (0.25 s alone) on device 1, then B (1 s alone) after C on device 1.
    durations = [1.0, 0.25, 1.0]  # A, C, B
    start, end = simulate_shared(durations, [(0,), (1,), (1,)], [(), (), (1,)], one_node, cores=1.0)
    # 0-0.5: A and C at rate 1/2 → C done at 0.5, A has 0.75 left; 0.5-2.0: A and B at 1/2 → A done at 2.0,
    # B has 0.25 left; alone at rate 1 → B ends at 2.25.
    assert end[1] == pytest.approx(0.5) and start[2] == pytest.approx(0.5)
    assert end[0] == pytest.approx(2.0) and end[2] == pytest.approx(2.25)


def test_other_nodes_do_not_slow_a_call():
    start, end = simulate_shared([1.0, 1.0], [(0,), (1,)], [(), ()], lambda d: d, cores=1.0)
    assert end == pytest.approx([1.0, 1.0])


def test_with_enough_cores_it_is_the_simulators_list_schedule():
    # a small diamond with a shared device and a second iteration-like chain
    devices = [(0, 1), (0,), (1,), (0, 1), (0,), (1,)]
    deps = [(), (0,), (0,), (1, 2), (3,), (3,)]
    durations = [1.0, 2.0, 0.5, 1.5, 0.0, 3.0]
    nodes = [_Node(Step(str(i), StepKind.SYNC, devices[i]), 0, durations[i], list(deps[i])) for i in range(6)]
    assert simulate_shared(durations, devices, deps, one_node, cores=8.0) == _schedule(nodes, devices)
    # FIFO per device without back-filling: node 2 (ready at 1) waits for nothing, node 1 for node 0 only
    start, end = _schedule(nodes, devices)
    assert start[:3] == [0.0, 1.0, 1.0] and end[3] == 4.5


def test_a_step_sent_with_its_dependency_is_queued_right_behind_it():
    # 0 on (0, 1) 1 s; 1 (after 0) on (1,) 2 s; 2 (after 0, sent with it) on (0,) 1 s; 3 (after 1) on (0, 1).
    # Node 2 is sent with node 0, so it is queued on device 0 before anything sent later and starts at 1.
    # Without that, both 1 and 2 are sent at 1: the same here. Node 4 (after 1, sent with it) on (1,) runs right
    # behind 1 at 3, before 3, which was sent at 3 when 1 ended but queued after it.
    devices = [(0, 1), (1,), (0,), (0, 1), (1,)]
    deps = [(), (0,), (0,), (1,), (1,)]
    carried = [(), (), (0,), (), (1,)]
    durations = [1.0, 2.0, 1.0, 1.0, 0.5]
    nodes = [
        _Node(Step(str(i), StepKind.SYNC, devices[i]), 0, durations[i], list(deps[i]), list(carried[i]))
        for i in range(5)
    ]
    start, end = _schedule(nodes, devices)
    assert start == [0.0, 1.0, 1.0, 3.5, 3.0] and end[3] == 4.5
    assert simulate_shared(durations, devices, deps, one_node, cores=8.0, carried=carried) == (start, end)
