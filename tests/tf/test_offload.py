"""Parameter offloading in TensorFlow: variables on a host device, a copy of
each weight per phase on the accelerator, triggers, placement after
Grappler, run order, and gradients unchanged.

Two logical CPUs stand in for the devices (tests/conftest.py): the host is
"/CPU:1", the accelerator "/CPU:0" (where ops without a device go)."""

import numpy as np
import pytest
import tensorflow as tf

import memsaving
from helpers import optimized_graphs, session_step_times
from memsaving.tf.forward import ops_made_in
from memsaving.tf.offload import OffloadOptions, handle_device, host_reads, insert_offload
from memsaving.tf.rewrite import is_segment_proxy
from memsaving.tf.placement import same_device

HOST, ACCELERATOR = "/CPU:1", "/CPU:0"


def _weights(depth=6, width=32):
    with tf.device(HOST):
        return [tf.Variable(tf.random.normal([width, width], stddev=width ** -0.5, seed=i)) for i in range(depth)]


def _loss(x, ws):
    h = x
    for i, w in enumerate(ws):
        h = tf.tanh(tf.matmul(h, w)) + (h if i % 3 == 2 else 0.0)
    return tf.reduce_mean(h * h)


def _offloaded_step(ws, options, report, **kwargs):
    """A step whose gradients come from memsaving with the weights offloaded,
    updating the weights on the host; ``report`` gets what the rewrite did."""

    @tf.function
    def step(x):
        loss = _loss(x, ws)
        graph = tf.compat.v1.get_default_graph()
        with ops_made_in(graph) as made:
            grads = memsaving.gradients(loss, ws, **kwargs)
        reads = host_reads([op for op in graph.get_operations() if op not in set(made)], options.device)
        report["reads"] = insert_offload(reads, made, grads + [loss], options)
        report["backward"] = set(made)
        with tf.device(options.device):
            for w, g in zip(ws, grads):
                w.assign_sub(0.0 * g)  # an update on the host that leaves the weights as they are
        return grads

    return step


@pytest.mark.parametrize("trigger", ["direct", "chain"])
@pytest.mark.parametrize("checkpoints", [[], "memory"], ids=["plain", "recomputing"])
def test_gradients_are_unchanged_to_the_bit(checkpoints, trigger):
    ws = _weights()
    x = tf.random.normal([64, 32], seed=1)

    @tf.function
    def reference(x):
        return tf.gradients(_loss(x, ws), ws)

    report = {}
    ours = _offloaded_step(ws, OffloadOptions(device=HOST, trigger=trigger), report, checkpoints=checkpoints)(x)
    for a, b in zip(reference(x), ours):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert len(report["reads"]) == len(ws)


def test_the_variables_behind_the_reads_are_found_on_the_host():
    on_host, on_device = _weights(depth=1)[0], tf.Variable(tf.ones([2, 2]))
    found = {}

    @tf.function
    def step():
        graph = tf.compat.v1.get_default_graph()
        total = tf.reduce_sum(on_host) + tf.reduce_sum(on_device)
        reads = [op for op in graph.get_operations() if op.type == "ReadVariableOp"]
        found["devices"] = sorted(handle_device(op.inputs[0])[-5:] for op in reads)
        found["host"] = [op.inputs[0] for op in host_reads(reads, HOST)]
        return total

    step()
    assert found["devices"] == ["CPU:0", "CPU:1"]
    assert len(found["host"]) == 1
    assert same_device(handle_device(found["host"][0]), on_host.device)


@pytest.mark.parametrize("checkpoints", [[], "memory"], ids=["plain", "recomputing"])
def test_every_accelerator_reader_reads_a_copy_of_its_phase(checkpoints):
    """From the traced graph: forward readers read the forward copy (a
    Snapshot on the accelerator, fed by a gate on the host), backward readers
    a backward copy that waits for a trigger of the backward pass, lower in
    the graph than the copy's readers."""
    ws = _weights()
    report = {}
    step = _offloaded_step(ws, OffloadOptions(device=HOST), report, checkpoints=checkpoints)
    step.get_concrete_function(tf.TensorSpec([64, 32]))
    backward = report["backward"]
    triggered = 0
    for entry in report["reads"]:
        read = entry.read
        assert entry.forward and entry.backward and not entry.host_readers
        for consumer in read.outputs[0].consumers():  # only gates read the host value (and bypassed proxies)
            if is_segment_proxy(consumer):
                assert not consumer.outputs[0].consumers(), "a segment's proxy is bypassed: its readers read copies"
                continue
            assert consumer.type == "Snapshot" and same_device(consumer.device, HOST), consumer.name
        copies = entry.forward + entry.backward
        assert len({id(c.value) for c in copies}) == len(copies)
        for phase, copy in [("forward", c) for c in entry.forward] + [("backward", c) for c in entry.backward]:
            assert copy.value.op.type == "Snapshot" and same_device(copy.value.op.device, ACCELERATOR)
            assert copy.value.op.inputs[0] is copy.gate and copy.gate.op.inputs[0] is read.outputs[0]
            for reader in copy.readers:
                assert (reader in backward) == (phase == "backward"), reader.name
                assert any(t is copy.value for t in reader.inputs)
                assert not is_segment_proxy(reader)
            if copy.trigger is not None:
                assert copy.trigger in copy.gate.op.control_inputs and copy.trigger in copy.value.op.control_inputs
                readers_of_trigger = {c for t in copy.trigger.outputs for c in t.consumers()}
                assert len(readers_of_trigger) != 1, f"{copy.trigger.name} may be inside a fused kernel"
                assert (copy.trigger in backward) == (phase == "backward")
                triggered += phase == "backward"
    # the last layers' backward copies start after a gradient op, not at the start of the step
    assert triggered >= len(ws) - 2


def test_copies_survive_grappler_on_their_devices_and_updates_run_on_the_host():
    ws = _weights()
    report = {}
    step = _offloaded_step(ws, OffloadOptions(device=HOST), report, checkpoints="memory")
    x = tf.random.normal([64, 32], seed=1)
    ran = optimized_graphs(lambda: step(x))
    mine = f"{report['reads'][0].read.name}/offload/forward_gate"  # the step's graph, not an earlier test's
    graphs = [g for g in ran if any(n.name == mine for n in g.node)]
    assert graphs
    nodes = {n.name: n for graph in graphs for n in graph.node}
    copies = [n for n in nodes.values() if n.op == "Snapshot" and n.name.endswith("_copy")]
    gates = [n for n in nodes.values() if n.op == "Snapshot" and n.name.endswith("_gate")]
    live = [c for entry in report["reads"] for c in entry.forward + entry.backward if not c.value.op.name.endswith(
        "unused_copy")]
    assert len(copies) >= len(live) and len(gates) >= len(live), "Grappler kept every copy"
    assert all(same_device(n.device, ACCELERATOR) for n in copies)
    assert all(same_device(n.device, HOST) for n in gates)
    reads = [n for n in nodes.values() if n.op == "ReadVariableOp"]
    assert reads and all(same_device(n.device, HOST) for n in reads)
    updates = [n for n in nodes.values() if n.op == "AssignSubVariableOp"]
    assert len(updates) == len(ws) and all(same_device(n.device, HOST) for n in updates)
    for node in nodes.values():  # no accelerator op reads a variable's value straight from the host
        if same_device(node.device, ACCELERATOR):
            for name in node.input:
                source = nodes.get(name.lstrip("^").split(":")[0])
                assert source is None or source.op != "ReadVariableOp", f"{node.name} reads {source.name}"


@pytest.mark.parametrize("checkpoints", [[], "memory"], ids=["plain", "recomputing"])
def test_copies_run_after_their_trigger_and_before_their_readers(checkpoints):
    """In a v1 session, from the step's timings: a gate starts after its
    trigger ends, a copy ends before any of its readers starts."""
    values = [w.numpy() for w in _weights()]
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [64, 32])
        with tf.device(HOST):
            variables = [tf.compat.v1.Variable(v, use_resource=True) for v in values]
        loss = _loss(x, variables)
        with ops_made_in(graph) as made:
            grads = memsaving.gradients(loss, variables, checkpoints=checkpoints)
        reads = host_reads([op for op in graph.get_operations() if op not in set(made)], HOST)
        report = insert_offload(reads, made, grads + [loss], OffloadOptions(device=HOST, lb=2))
        report = [entry for entry in report if entry.forward]  # v1 variables read themselves once more, unused
        assert len(report) == len(variables)
    times = session_step_times(graph, grads, {x: np.ones([64, 32], np.float32)})
    triggers = readers = 0
    for entry in report:
        for copy in entry.forward + entry.backward:
            gate, value = copy.gate.op.name, copy.value.op.name
            if value not in times:
                continue  # pruned: read only by gradients nothing uses
            if copy.trigger is not None and copy.trigger.name in times:
                assert times[gate][0] >= times[copy.trigger.name][1], f"{gate} started before its trigger ended"
                triggers += 1
            for reader in copy.readers:
                if reader.name in times:
                    assert times[reader.name][0] >= times[value][1], f"{reader.name} ran before its copy"
                    readers += 1
    # every weight's forward reader and backward readers but the first layer's (its input needs no gradient)
    assert triggers >= len(report) and readers >= 2 * len(report) - 1


def test_placement_examples_run():
    import doctest

    import memsaving.tf.placement

    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(memsaving.tf.placement):
        runner.run(test)
    assert runner.tries and runner.failures == 0
