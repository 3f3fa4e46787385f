"""memsaving.gradients equals tf.gradients on many model shapes, in both modes."""

import pytest

from helpers import assert_close, run_session, run_tf_function
from model_zoo import ALL_MODELS, DeepMLP, EmbeddingModel, ResidualNet


@pytest.mark.parametrize("model_cls", ALL_MODELS, ids=lambda c: c.name)
def test_equal_in_tf_function(model_cls):
    plain, ours, kinds = run_tf_function(model_cls())
    assert_close(plain, ours)
    assert [a for a, _ in kinds] == [b for _, b in kinds], "result types differ from tf.gradients"


@pytest.mark.parametrize("model_cls", ALL_MODELS, ids=lambda c: c.name)
def test_equal_in_v1_session(model_cls):
    plain, ours, kinds = run_session(model_cls())
    assert_close(plain, ours)
    assert [a for a, _ in kinds] == [b for _, b in kinds]


def test_embedding_gives_indexed_slices_like_tf_gradients():
    _, _, kinds = run_tf_function(EmbeddingModel())
    assert kinds[0] == ("IndexedSlices", "IndexedSlices")


@pytest.mark.parametrize("mode", ["speed", "memory"])
@pytest.mark.parametrize("model_cls", [DeepMLP, ResidualNet], ids=lambda c: c.name)
def test_named_modes_equal(model_cls, mode):
    plain, ours, _ = run_tf_function(model_cls(), checkpoints=mode)
    assert_close(plain, ours)


def test_no_checkpoints_equals_plain():
    plain, ours, _ = run_tf_function(DeepMLP(), checkpoints=[])
    assert_close(plain, ours, rtol=0)


@pytest.mark.parametrize("model_cls", ALL_MODELS, ids=lambda c: c.name)
def test_equal_at_the_smallest_feasible_budget(model_cls):
    """The tightest budget gives multi-level plans where the graph allows."""
    plain, ours, _ = run_tf_function(model_cls(), budget="smallest")
    assert_close(plain, ours)


@pytest.mark.parametrize("model_cls", [DeepMLP, ResidualNet], ids=lambda c: c.name)
def test_smallest_budget_equal_in_v1_session(model_cls):
    plain, ours, _ = run_session(model_cls(), budget="smallest")
    assert_close(plain, ours)
