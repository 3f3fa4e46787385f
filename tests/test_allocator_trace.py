"""The model of TensorFlow's BFC allocator (memsaving.sim.allocator) against
the real one: every allocation TensorFlow made in a fresh process, replayed
(experiments.allocator_trace)."""

import glob
import tempfile
from dataclasses import asdict

from helpers import in_a_fresh_process


def traced_step_replay() -> dict:
    """In a fresh process: a tanh MLP's gradient step run once, then once
    measured, under the profiler from TensorFlow's start; the measured peak,
    the whole history replayed through the model, and how many chunks
    TensorFlow gave larger than their rounded request."""
    import tensorflow as tf

    from experiments.allocator_trace import MARK, read_profile, replay_history
    from memsaving.sim.allocator import rounded

    logdir = tempfile.mkdtemp(prefix="memsaving_test_allocator_trace_")
    tf.profiler.experimental.start(logdir)
    try:
        x = tf.random.stateless_normal([96, 700], seed=(1, 2))
        weights = [tf.Variable(tf.random.stateless_normal([700, 700], seed=(i, 3)) * 0.05) for i in range(4)]

        @tf.function
        def step(x):
            h = x
            for w in weights:
                h = tf.tanh(tf.matmul(h, w))
            grads = tf.gradients(tf.reduce_sum(h * h), weights)
            return tf.add_n([tf.reduce_sum(g) for g in grads])

        step(x).numpy()
        tf.config.experimental.reset_memory_stats("CPU:0")
        with tf.profiler.experimental.Trace(MARK + "measured"):
            step(x).numpy()
        measured = int(tf.config.experimental.get_memory_info("CPU:0")["peak"])
    finally:
        tf.profiler.experimental.stop()
    events, marks = read_profile(glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True))
    history = replay_history(events, marks["measured"])
    whole = sum(1 for e in events if e.allocates and e.chunk > rounded(e.requested))
    return {"measured": measured, "history": asdict(history), "given_whole": whole}


def test_the_model_gives_every_chunk_tensorflow_gave_and_its_peak():
    # The whole history is replayed, so the model starts the measured run in the
    # allocator's own state and follows the same rules: it must agree to the byte.
    found = in_a_fresh_process("test_allocator_trace", "traced_step_replay")
    history = found["history"]
    assert history["allocations"] > 100 and found["given_whole"] > 0, "a trace with chunks given whole"
    assert history["chunk_mismatches"] == 0, history["first_mismatch"]
    assert history["in_use_mismatches"] == 0
    assert history["peak"] == found["measured"]
