"""What the extracted model says each gradient reads, on a Keras-style
dropout (a random mask, SelectV2) and a causal softmax mask; and the
measured peak of a dropout stack against the prediction."""

import tensorflow as tf

import memsaving
from memsaving.tf.extract import graph_model
from memsaving.tf.forward import forward_graph

MIB = 2 ** 20


def _dropout(h, rate, seed):
    """Keras 3's stateless dropout, as its TensorFlow backend builds it."""
    noise = tf.random.stateless_uniform(tf.shape(h), seed=seed)
    keep = noise >= rate
    return tf.where(keep, h / (1.0 - rate), tf.zeros_like(h))


def _model_of(fn, *args):
    found = {}

    x, w = args

    @tf.function(autograph=False)
    def trace(x):
        loss = fn(x, w)
        fwd = forward_graph([loss.graph.capture(w.handle)], [loss])
        found["model"] = graph_model(fwd, batch_size=1)
        return loss

    trace(x)
    return found["model"]


def _reads_by_name(model):
    return {op.name.split("/")[-1]: [model.tensors[t].name.split("/")[-1] for t in op.grad_reads]
            for op in model.ops}


def test_select_reads_its_condition_and_random_ops_read_nothing():
    w = tf.Variable(tf.ones([8, 8]))

    def fn(x, w):
        h = tf.identity(x @ w, name="h")
        scores = tf.where(tf.linalg.band_part(tf.ones([8, 8]), -1, 0) > 0, h, -1e9, name="masked")
        dropped = _dropout(tf.nn.softmax(scores), 0.1, seed=(1, 2))
        return tf.reduce_sum(tf.identity(dropped, name="out") * 2.0)

    model = _model_of(fn, tf.ones([8, 8]), w)
    reads = _reads_by_name(model)
    assert reads["masked"] == ["Greater:0"]  # the mask, not the scores nor the output
    forward = {op.name.split("/")[-1] for op in model.ops if op.forward}
    assert "StatelessRandomUniformV2" not in forward
    for op in model.ops:
        if not op.forward:
            assert op.grad_reads == (), op.name  # never differentiated: holds nothing for the backward


def test_dropout_stack_prediction_follows_the_measured_peak():
    """Sixteen dense + dropout layers: the random noise and the scaled values
    are freed in the forward pass; only the masks and the products stay."""
    ws = [tf.Variable(tf.random.normal([256, 256], seed=i) * 0.05) for i in range(16)]

    def forward(x):
        h = x
        for i, w in enumerate(ws):
            h = _dropout(tf.nn.relu(h @ w), 0.1, seed=(i, 7))
        return tf.reduce_sum(h * h)

    captured = {}

    @tf.function
    def step(x):
        loss = forward(x)
        captured["plan"] = memsaving.plan(loss, ws, checkpoints=[], batch_size=512, profile=False)
        grads = tf.gradients(loss, ws)
        return loss + tf.add_n([tf.reduce_sum(g) for g in grads])

    x = tf.random.normal([512, 256], seed=3)
    step(x)
    measured = max(memsaving.measure_peak_increase(step, x) for _ in range(3))
    plan = captured["plan"]
    predicted = plan.plain_peak - plan.resident_bytes
    print(f"dropout stack: measured {measured / MIB:.2f} MiB, predicted {predicted / MIB:.2f}")
    assert abs(predicted - measured) <= 0.2 * measured  # 33 MiB (+98%) before the noise and masks were freed


def test_a_product_with_a_constant_does_not_hold_its_operand():
    """``0.5 * h`` (Gelu's first factor): the gradient that would read ``h``
    is the constant's, which nothing asks for; the product with the weight
    reads each operand for the other's gradient."""
    w = tf.Variable(tf.ones([8, 8]))

    def fn(x, w):
        h = tf.identity(x @ w, name="h")
        half = tf.multiply(h, 0.5, name="half")
        return tf.reduce_sum(tf.multiply(half, tf.identity(h, name="other"), name="both"))

    model = _model_of(fn, tf.ones([8, 8]), w)
    ops = {op.name.split("/")[-1]: op for op in model.ops}
    names = {t: info.name.split("/")[-1] for t, info in model.tensors.items()}
    assert [names[t] for t in ops["half"].grad_reads] == ["y:0"]  # the constant 0.5, not h
    assert [names[t] for t in ops["both"].grad_reads] == ["half:0", "other:0"]
    assert [[names[t] for t in reads] for reads in ops["both"].input_grad_reads] == [["other:0"], ["half:0"]]
    matmul = next(op for op in model.ops if op.type == "MatMul")
    # x is fed in: only the weight's gradient is used, and it reads x alone
    assert matmul.input_grad_reads[1] and not matmul.input_grad_reads[0]


def test_a_constant_power_holds_a_factor_made_in_advance():
    """``h ** 3`` (tanh Gelu): its gradient reads no forward tensor at
    backward time but a factor ``3 * h ** 2`` the executor makes at once;
    the factor is counted as the op's saved bytes, and the square Grappler
    makes for the cube as its forward temporary."""
    w = tf.Variable(tf.ones([8, 8]))

    def fn(x, w):
        h = tf.identity(x @ w, name="h")
        return tf.reduce_sum(tf.pow(h, 3.0, name="cube"))

    model = _model_of(fn, tf.ones([8, 8]), w)
    cube = next(op for op in model.ops if op.name.endswith("cube"))
    assert cube.grad_reads == ()
    assert cube.saved_bytes == 8 * 8 * 4
    assert cube.temp_bytes >= 8 * 8 * 4
