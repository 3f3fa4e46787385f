"""Does a budget plan keep its promise? Measured peaks of Keras training steps against budgets.

Issue 15's acceptance benchmark.  For each model, built with Keras layers and
run with DEFAULT TensorFlow settings (Grappler on, default thread pools; no
call to ``set_inter_op_parallelism_threads``), one training step is a
``tf.function``: the forward pass with ``training=True``, a scalar loss (the
mean of the squared model output; ``sequence_output`` for keras_hub
backbones), the gradients with respect to ``model.trainable_variables``, and
those weight gradients reduced to one scalar inside the step
(``tf.add_n([tf.reduce_sum(g) ...])``, ``.values`` for IndexedSlices, None
skipped) so that the returned gradients do not dominate the peak: the plans
assume each gradient is consumed when made (``keep_x_gradients=False``).

Each model is swept in its own Python process (so memory an earlier model
left allocated cannot count in its absolute peaks), in this order:

1. plain: ``tf.gradients``, beside ``memsaving.plan(loss, weights,
   checkpoints=[], batch_size=B).plain_peak`` traced in the same step;
2. ``checkpoints="memory"``: measured beside the plan's ``predicted_peak``;
3. budgets of 0.3, 0.4, ..., 0.9 times the MEASURED plain peak:
   ``memsaving.gradients(loss, weights, budget=b, batch_size=B)`` (called as
   ``memsaving.gradients_and_plan``, the same code returning the plan it
   executed, so the prediction is the executed plan's).  When it raises
   ``BudgetError`` the case is "infeasible" and a step built with
   ``budget=error.smallest_budget`` is measured instead (once per distinct
   smallest budget), against that budget.

Peaks are ABSOLUTE (``memsaving.measure_peak``): the CPU BFC allocator's peak
bytes in use during the step, including the weights and inputs that are
alive before it, which is what ``Plan.predicted_peak`` and ``plain_peak``
include (as ``resident_bytes``) and what a budget bounds.  Each table shows
the bytes in use before the step beside the plan's ``resident_bytes``
(the bytes in use when the step was planned, or the weights and inputs it
reads when those are more; they differ by what was allocated or freed in
between).  Each step runs once as a warm-up (tracing, planning, one-time
buffers), then ``--repeat`` times (default 3) measured; "measured" is the
largest of those peaks (min and max are in the CSV), and the budget
fractions are of the largest measured plain peak.  A plan "fits" when
measured <= budget.  Errors are (predicted - measured) / measured.

With ``--calibrate`` (on by default; ``--no-calibrate`` turns it off) every
budget case, feasible or not as predicted, is ALSO built through
``memsaving.fit_to_budget(body, x, budget=b, restore_variables=True)``, where
``body`` is the same step written as a plain Python function calling
``memsaving.gradients(loss, weights, budget=b, batch_size=B)``; the returned function is then measured
exactly like the other steps (one warm-up run, ``--repeat`` runs under
``measure_peak``, the largest counts), and the "cal" columns give the rounds
fit_to_budget used, its own last measured peak, the re-measured peak over
the budget and whether it fits.  When fit_to_budget raises ``BudgetError``
its ``smallest_budget`` (the lowest peak it measured, plus 2% and what each
trace left on the device) is recorded and
fit_to_budget is run again at that budget (once per distinct value), the
result measured against it.  At a budget no plan meets even as predicted,
fit_to_budget measures the planner's lowest plan: it is returned when it
fits as measured, else its measured peak makes the error's smallest_budget
(a fraction below a lowest plan already measured reuses that outcome).  The
uncalibrated columns are unchanged: they document what the planner alone
promises.

Nothing is tuned: the benchmark documents what the planner promises and what
the allocator sees.  Results go to ``experiments/results/budget_promise.md``
and ``.csv`` (``--out DIR`` elsewhere; ``--quick`` writes the same names).

    python -m experiments.bench_budget_promise                       # all models, calibrated: ~36 min on 2 cores
    python -m experiments.bench_budget_promise --quick --out /tmp/bp  # smaller models, 3 fractions: a smoke run
    python -m experiments.bench_budget_promise --models mlp24,unet --fractions 0.5,0.7 --repeat 5
    python -m experiments.bench_budget_promise --no-calibrate        # the planner's promise alone: 10-15 minutes

Models: mlp24, resconv, two_tower, unet, attention, lstm_gru, resnet50v2,
efficientnetb0, gpt2, bert.  gpt2 and bert are keras_hub backbones built
from constructor arguments (no presets, nothing downloaded); without
keras_hub (``pip install -e '.[bench]'``) they are skipped with a message.
keras-hub 0.32.0 requires tensorflow-text, which pulls the full ``tensorflow``
distribution beside ``tensorflow-cpu``; to keep tensorflow-cpu alone, install
``keras-hub==0.32.0`` with ``--no-deps`` and then kagglehub, kagglesdk==0.1.28,
regex, sentencepiece and tokenizers (the backbones need no tensorflow-text).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import memsaving  # noqa: F401  (sets TF_CPU_ALLOCATOR_USE_BFC before TensorFlow starts)
import keras
import tensorflow as tf

from experiments.report import Table, machine
from memsaving.tools import models

FRACTIONS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
QUICK_FRACTIONS = (0.4, 0.6, 0.8)
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
NAME = "budget_promise"
MIB = 2 ** 20


# --------------------------------------------------------------------------------------------- models


@dataclass
class Case:
    """A built model, the inputs of one step and the batch the plans are sized for."""

    model: keras.Model
    inputs: object
    batch: int
    description: str


def _normal(*shape) -> tf.Tensor:
    return tf.random.stateless_normal(shape, seed=(1, 2))


def _tokens(batch: int, length: int, vocab: int) -> tf.Tensor:
    return tf.random.stateless_uniform([batch, length], seed=(3, 4), minval=0, maxval=vocab, dtype=tf.int32)


def _mlp24(quick: bool) -> Case:
    batch, depth = (128, 12) if quick else (512, 24)
    return Case(models.mlp(size=256, depth=depth, width=256), _normal(batch, 256), batch,
                f"Dense(256, relu) x {depth} + Dense(10), 256 features, batch {batch}")


def _resconv(quick: bool) -> Case:
    blocks, size, batch = (4, 32, 8) if quick else (8, 32, 16)
    return Case(models.residual_convnet(size=size, blocks=blocks, filters=(16, 32)), _normal(batch, size, size, 3),
                batch, f"{blocks} residual blocks (Conv2D+BatchNorm+Add, 16/32 channels), {size}x{size}, batch {batch}")


def _two_tower(quick: bool) -> Case:
    batch, depth = (128, 6) if quick else (512, 12)
    return Case(models.two_tower(size=256, depth=depth, width=256), _normal(batch, 256), batch,
                f"two towers of Dense(256, relu) x {depth}, concatenated, batch {batch}")


def _unet(quick: bool) -> Case:
    size, batch = (32, 2) if quick else (64, 4)
    return Case(models.unet(size), _normal(batch, size, size, 3), batch,
                f"memsaving.tools.models.unet, {size}x{size}, batch {batch}")


def _attention(quick: bool) -> Case:
    seq, blocks, batch = (64, 2, 4) if quick else (128, 3, 8)
    return Case(models.attention_encoder(size=seq, blocks=blocks, dim=128, heads=4), _normal(batch, seq, 128), batch,
                f"{blocks} pre-norm blocks (LayerNormalization, MultiHeadAttention 4 heads, Dense), seq {seq}, "
                f"dim 128, batch {batch}")


def _lstm_gru(quick: bool) -> Case:
    seq, batch = (32, 8) if quick else (64, 16)
    return Case(models.recurrent(size=seq, features=32, units=128), _normal(batch, seq, 32), batch,
                f"Dense(128), LSTM(128) and GRU(128) with return_sequences, Dense(10), seq {seq}, batch {batch}")


def _application(name: str) -> Callable[[bool], Case]:
    def build(quick: bool) -> Case:
        size, batch = (32, 4) if quick else (64, 8)
        return Case(models.BUILDERS[name](size), _normal(batch, size, size, 3), batch,
                    f"keras.applications, weights=None, {size}x{size}, classes=10, batch {batch}")
    return build


def keras_hub_backbone(kind: str, full=(4, 128, 4), quick=(2, 64, 2),
                       max_sequence_length: Optional[int] = 128) -> Callable[[bool], Case]:
    """A builder of a keras_hub ``"gpt2"`` or ``"bert"`` backbone from constructor arguments (no preset).

    ``full`` and ``quick`` are ``(layers, sequence length, batch)``;
    ``max_sequence_length`` None means the sequence length built for.
    """
    def build(is_quick: bool) -> Case:
        import keras_hub  # pylint: disable=import-outside-toplevel

        layers, seq, batch = quick if is_quick else full
        config = dict(vocabulary_size=1000, num_layers=layers, num_heads=4, hidden_dim=128, intermediate_dim=512,
                      max_sequence_length=max_sequence_length or seq)
        cls = keras_hub.models.GPT2Backbone if kind == "gpt2" else keras_hub.models.BertBackbone
        inputs = {"token_ids": _tokens(batch, seq, 1000), "padding_mask": tf.ones([batch, seq], tf.int32)}
        if kind == "bert":
            inputs["segment_ids"] = tf.zeros([batch, seq], tf.int32)
        return Case(cls(**config), inputs, batch,
                    f"keras_hub {cls.__name__}(vocabulary_size=1000, num_layers={layers}, num_heads=4, "
                    f"hidden_dim=128, intermediate_dim=512), no preset, seq {seq}, batch {batch}")
    return build


MODELS: Dict[str, Callable[[bool], Case]] = {
    "mlp24": _mlp24,
    "resconv": _resconv,
    "two_tower": _two_tower,
    "unet": _unet,
    "attention": _attention,
    "lstm_gru": _lstm_gru,
    "resnet50v2": _application("resnet50v2"),
    "efficientnetb0": _application("efficientnetb0"),
    "gpt2": keras_hub_backbone("gpt2"),
    "bert": keras_hub_backbone("bert"),
}
NEEDS_KERAS_HUB = frozenset({"gpt2", "bert"})


# ---------------------------------------------------------------------------------------------- steps


def scalar_loss(outputs) -> tf.Tensor:
    """Mean of the squared output (a backbone's ``sequence_output`` when it returns a dict)."""
    if isinstance(outputs, dict):
        outputs = outputs["sequence_output"]
    return tf.reduce_mean(tf.square(tf.cast(outputs, tf.float32)))


def reduce_gradients(grads) -> tf.Tensor:
    """All weight gradients summed into one scalar, inside the step."""
    parts = []
    for g in grads:
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            g = g.values
        parts.append(tf.reduce_sum(g))
    return tf.add_n(parts)


def make_step(model: keras.Model, batch: int, mode: str, budget: Optional[int] = None):
    """A training step (tf.function) and a dict that receives its Plan when traced."""
    captured: dict = {}

    @tf.function
    def step(inputs):
        loss = scalar_loss(model(inputs, training=True))
        weights = model.trainable_variables
        if mode == "plain":
            captured["plan"] = memsaving.plan(loss, weights, checkpoints=[], batch_size=batch)
            grads = tf.gradients(loss, weights)
        elif mode == "memory":
            grads, captured["plan"] = memsaving.gradients_and_plan(loss, weights, checkpoints="memory",
                                                                   batch_size=batch)
        else:
            grads, captured["plan"] = memsaving.gradients_and_plan(loss, weights, budget=budget, batch_size=batch)
        return reduce_gradients(grads)

    return step, captured


def step_body(model: keras.Model, batch: int, budget: int) -> Callable:
    """The budgeted step as a plain Python function, for ``memsaving.fit_to_budget`` (which traces it)."""

    def body(inputs):
        loss = scalar_loss(model(inputs, training=True))
        grads = memsaving.gradients(loss, model.trainable_variables, budget=budget, batch_size=batch)
        return reduce_gradients(grads)

    return body


@dataclass
class Measured:
    peaks: List[int]
    in_use_before: int
    plan: object
    seconds: float  # tracing, planning and the warm-up run

    @property
    def peak(self) -> int:
        return max(self.peaks)


def measure(model, case: Case, mode: str, repeat: int, budget: Optional[int] = None) -> Measured:
    """Build the step (raises BudgetError for an infeasible budget), warm up once, measure ``repeat`` peaks."""
    step, captured = make_step(model, case.batch, mode, budget)
    start = time.perf_counter()
    step(case.inputs).numpy()  # trace + plan + warm-up run
    seconds = time.perf_counter() - start
    before = int(tf.config.experimental.get_memory_info("CPU:0")["current"])
    peaks = [memsaving.measure_peak(step, case.inputs) for _ in range(repeat)]
    return Measured(peaks, before, captured["plan"], seconds)


@dataclass
class Calibrated:
    rounds: int  # rounds fit_to_budget measured
    own_peak: int  # fit_to_budget's own measured peak of the round it returned
    peaks: List[int]  # re-measured here, as the other steps: max of ``repeat`` after a warm-up
    seconds: float  # fit_to_budget (all its rounds)

    @property
    def peak(self) -> int:
        return max(self.peaks)


def measure_calibrated(model, case: Case, repeat: int, budget: int) -> Calibrated:
    """``memsaving.fit_to_budget`` on the budgeted step body (raises its BudgetError), then the returned
    function measured like every other step: one warm-up run, ``repeat`` peaks."""
    start = time.perf_counter()
    step = memsaving.fit_to_budget(step_body(model, case.batch, budget), case.inputs, budget=budget,
                                   restore_variables=True)
    seconds = time.perf_counter() - start
    step(case.inputs).numpy()  # warm-up, as for the other steps
    peaks = [memsaving.measure_peak(step, case.inputs) for _ in range(repeat)]
    return Calibrated(len(step.calibration.rounds), step.calibration.measured_peak, peaks, seconds)


# -------------------------------------------------------------------------------------------- sweeping


COLUMNS = ("model", "case", "fraction", "budget MiB", "status", "measured MiB", "measured min MiB",
           "predicted MiB", "measured/budget", "predicted/budget", "error", "smallest_budget MiB",
           "smallest/plain")
"""One row per measured step.  ``budget MiB``: the budget the step was built
with (the smallest feasible one for infeasible fractions); ``error``:
(predicted - measured) / measured; ``smallest/plain``: smallest_budget over
the measured plain peak."""

CAL_COLUMNS = ("cal status", "cal rounds", "cal own MiB", "cal measured MiB", "cal measured min MiB",
               "cal measured/budget", "cal smallest_budget MiB", "cal smallest/plain", "cal at smallest",
               "cal rounds at smallest")
"""With ``--calibrate``, for every budget row: ``memsaving.fit_to_budget``
at the row's budget (for rows infeasible as predicted, at the fraction's
budget, fraction x the measured plain peak, not the ``budget MiB`` column:
fit_to_budget then measures the planner's lowest plan).  ``cal status``:
fits / OVER (the re-measured peak against the budget), BudgetError
(fit_to_budget raised) or error;
``cal rounds``: rounds fit_to_budget measured (the rounds in its error for
BudgetError); ``cal own MiB``: fit_to_budget's own measured peak in its
last round; ``cal measured MiB`` / ``min``: the returned step re-measured
(max / min of the repeats after a warm-up), and ``cal measured/budget``
that max over the budget.  After a BudgetError, ``cal smallest_budget MiB``
is the error's smallest_budget (over the measured plain peak in ``cal
smallest/plain``), and the measured columns, ``cal at smallest`` (fits /
OVER / BudgetError / error) and ``cal rounds at smallest`` are those of
fit_to_budget run again at budget=smallest_budget: ``cal measured/budget``
is then measured / smallest_budget."""
CAL_MIB = (15, 16, 17, 19)  # row indices of the MiB columns among COLUMNS + CAL_COLUMNS
MIB_COLUMNS = (3, 5, 6, 7, 11) + CAL_MIB
"""Row indices of the columns held in MiB in a row and in bytes in the CSV."""
NO_CAL = [None] * len(CAL_COLUMNS)


@dataclass
class ModelResult:
    name: str
    description: str
    batch: int
    rows: List[list] = field(default_factory=list)
    resident: int = 0
    in_use_before: int = 0
    seconds: float = 0.0
    failures: List[str] = field(default_factory=list)
    calibrated: bool = False
    cal_seconds: float = 0.0  # fit_to_budget calls and their measurement


def _ratio(a, b) -> Optional[float]:
    return None if a is None or not b else a / b


def _mib(n) -> Optional[float]:
    return None if n is None else n / MIB


def _status(measured: int, budget: int) -> str:
    return "fits" if measured <= budget else "OVER"


def _short(error: Exception) -> str:
    """The error's own message (the last line of AutoGraph's "in user code:" traces)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[-1] if lines and lines[0].startswith("in user code") else (lines[0] if lines else "")
    return f"{type(error).__name__}: {text[:200]}"


def source_state() -> str:
    """The memsaving commit the figures were measured with, and uncommitted changes to it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--", "memsaving"], cwd=root, capture_output=True,
                                text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return "memsaving source: unknown (not a git checkout)"
    changed = sorted(line[3:] for line in status)
    return f"memsaving at commit {head}" + (f", uncommitted changes in {', '.join(changed)}" if changed else "")


def calibrate_case(model, case: Case, repeat: int, budget: int, plain_peak: int, result: ModelResult,
                   label: str, at_smallest: Dict[int, tuple], lowest_measured: Optional[list] = None) -> list:
    """The ``CAL_COLUMNS`` of one feasible budget case: fit_to_budget at ``budget`` re-measured, or its
    BudgetError and fit_to_budget again at the error's smallest_budget (cached in ``at_smallest``).
    After a BudgetError, the lowest peak its rounds measured is appended to ``lowest_measured``."""
    start = time.perf_counter()
    try:
        progress(result.name, f"  calibrated: fit_to_budget at {budget / MIB:.1f} MiB")
        try:
            c = measure_calibrated(model, case, repeat, budget)
        except memsaving.BudgetError as error:
            calibration = getattr(error, "calibration", None)
            rounds = len(calibration.rounds) if calibration is not None else None
            if lowest_measured is not None and calibration is not None and calibration.rounds:
                lowest_measured.append(min(r.measured_peak for r in calibration.rounds))
            smallest = error.smallest_budget
            if smallest is None:
                result.failures.append(f"{label} calibrated: BudgetError without smallest_budget: {_short(error)}")
                return ["BudgetError", rounds] + [None] * (len(CAL_COLUMNS) - 2)
            if smallest not in at_smallest:
                progress(result.name, f"  calibrated: BudgetError after {rounds} round(s); fit_to_budget at "
                                      f"smallest_budget = {smallest / MIB:.2f} MiB")
                try:
                    s = measure_calibrated(model, case, repeat, smallest)
                    at_smallest[smallest] = (s, _status(s.peak, smallest), s.rounds)
                except memsaving.BudgetError as again:
                    again_cal = getattr(again, "calibration", None)
                    result.failures.append(f"{label} calibrated: fit_to_budget at smallest_budget {smallest} "
                                           f"raised again: {_short(again)}")
                    at_smallest[smallest] = (None, "BudgetError",
                                             len(again_cal.rounds) if again_cal is not None else None)
                except Exception as again:  # pylint: disable=broad-except  # recorded, the sweep goes on
                    result.failures.append(f"{label} calibrated: fit_to_budget at smallest_budget {smallest}: "
                                           f"{_short(again)}")
                    at_smallest[smallest] = (None, "error", None)
            else:
                progress(result.name, f"  calibrated: BudgetError after {rounds} round(s); smallest_budget "
                                      f"{smallest / MIB:.2f} MiB measured already")
            s, status, s_rounds = at_smallest[smallest]
            return ["BudgetError", rounds, _mib(s.own_peak) if s else None, _mib(s.peak) if s else None,
                    _mib(min(s.peaks)) if s else None, _ratio(s.peak, smallest) if s else None, _mib(smallest),
                    smallest / plain_peak, status, s_rounds]
        except Exception as error:  # pylint: disable=broad-except
            result.failures.append(f"{label} calibrated: {_short(error)}")
            return ["error"] + [None] * (len(CAL_COLUMNS) - 1)
        return [_status(c.peak, budget), c.rounds, _mib(c.own_peak), _mib(c.peak), _mib(min(c.peaks)),
                c.peak / budget, None, None, None, None]
    finally:
        result.cal_seconds += time.perf_counter() - start


def sweep(name: str, quick: bool, fractions, repeat: int, calibrate: bool = False) -> ModelResult:
    keras.utils.set_random_seed(0)
    case = MODELS[name](quick)
    model = case.model
    result = ModelResult(name, case.description, case.batch, calibrated=calibrate)
    start = time.perf_counter()

    progress(name, f"plain ({case.description})")
    plain = measure(model, case, "plain", repeat)
    result.resident = plain.plan.resident_bytes
    result.in_use_before = plain.in_use_before
    plain_peak = plain.peak
    result.rows.append([name, "plain", None, None, "-", _mib(plain.peak), _mib(min(plain.peaks)),
                        _mib(plain.plan.plain_peak), None, None, plain.plan.plain_peak / plain.peak - 1, None, None]
                       + NO_CAL)

    progress(name, "checkpoints='memory'")
    try:
        mem = measure(model, case, "memory", repeat)
        result.rows.append([name, "memory", None, None, "-", _mib(mem.peak), _mib(min(mem.peaks)),
                            _mib(mem.plan.predicted_peak), None, None, mem.plan.predicted_peak / mem.peak - 1,
                            None, None] + NO_CAL)
    except Exception as error:  # pylint: disable=broad-except  # recorded, the sweep goes on
        result.failures.append(f"memory: {_short(error)}")
        result.rows.append([name, "memory", None, None, "error", None, None, None, None, None, None, None, None]
                           + NO_CAL)

    at_smallest: Dict[int, Measured] = {}
    cal_at_smallest: Dict[int, tuple] = {}
    floor_cal: Optional[list] = None  # the calibrated columns of an infeasible fraction that raised
    floor_peak = 0  # the lowest peak its rounds measured
    for fraction in fractions:
        budget = int(fraction * plain_peak)
        progress(name, f"budget {fraction:.2f} x measured plain = {budget / MIB:.1f} MiB")
        try:
            m = measure(model, case, "budget", repeat, budget)
        except memsaving.BudgetError as error:
            smallest = error.smallest_budget
            if smallest is None:
                result.failures.append(f"budget {fraction:.2f}: BudgetError without smallest_budget")
                result.rows.append([name, "budget", fraction, _mib(budget), "infeasible", None, None, None, None,
                                    None, None, None, None] + NO_CAL)
                continue
            if smallest not in at_smallest:
                progress(name, f"  infeasible; measuring budget=smallest_budget = {smallest / MIB:.1f} MiB")
                try:
                    at_smallest[smallest] = measure(model, case, "budget", repeat, smallest)
                except Exception as again:  # pylint: disable=broad-except
                    result.failures.append(f"budget=smallest_budget {smallest}: {_short(again)}")
                    at_smallest[smallest] = None
            else:
                progress(name, f"  infeasible; smallest_budget {smallest / MIB:.1f} MiB measured already")
            s = at_smallest[smallest]
            cal = NO_CAL
            if calibrate:
                if floor_cal is not None and budget < floor_peak:
                    progress(name, "  calibrated: below the lowest plan measured at a lower fraction; same "
                                   "outcome as there")
                    cal = floor_cal
                else:
                    lowest: List[int] = []
                    cal = calibrate_case(model, case, repeat, budget, plain_peak, result,
                                         f"budget {fraction:.2f} (infeasible as predicted)", cal_at_smallest, lowest)
                    if cal[0] == "BudgetError" and lowest:
                        floor_cal, floor_peak = cal, lowest[0]
            result.rows.append([
                name, "budget", fraction, _mib(smallest), "infeasible", _mib(s.peak) if s else None,
                _mib(min(s.peaks)) if s else None, _mib(s.plan.predicted_peak) if s else None,
                _ratio(s.peak, smallest) if s else None, _ratio(s.plan.predicted_peak, smallest) if s else None,
                s.plan.predicted_peak / s.peak - 1 if s else None, _mib(smallest), smallest / plain_peak,
            ] + cal)
            continue
        except Exception as error:  # pylint: disable=broad-except
            result.failures.append(f"budget {fraction:.2f}: {_short(error)}")
            result.rows.append([name, "budget", fraction, _mib(budget), "error", None, None, None, None, None,
                                None, None, None] + NO_CAL)
            continue
        cal = (calibrate_case(model, case, repeat, budget, plain_peak, result, f"budget {fraction:.2f}",
                              cal_at_smallest) if calibrate else NO_CAL)
        result.rows.append([
            name, "budget", fraction, _mib(budget), _status(m.peak, budget), _mib(m.peak), _mib(min(m.peaks)),
            _mib(m.plan.predicted_peak), m.peak / budget, m.plan.predicted_peak / budget,
            m.plan.predicted_peak / m.peak - 1, None, None,
        ] + cal)
    result.seconds = time.perf_counter() - start
    return result


# -------------------------------------------------------------------------------------------- printing


def progress(model: str, message: str) -> None:
    print(f"[budget_promise] {model}: {message}", flush=True)


def _f(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def print_model(r: ModelResult) -> None:
    print(f"\n{r.name}: {r.description}")
    print(f"in use before the step {r.in_use_before / MIB:.2f} MiB; plan resident_bytes "
          f"{r.resident / MIB:.2f} MiB; sweep {r.seconds:.0f} s"
          + (f" (of which fit_to_budget and its measurement {r.cal_seconds:.0f} s)" if r.calibrated else ""))
    cal_header = (f" | {'cal':>11} {'rounds':>6} {'own':>6} {'measured':>8} {'meas/bud':>8} {'smallest':>8} "
                  f"{'at smallest':>11}") if r.calibrated else ""
    print(f"{'case':>14} {'budget MiB':>10} {'status':>10} {'measured':>9} {'(min)':>8} {'predicted':>9} "
          f"{'meas/bud':>8} {'pred/bud':>8} {'error':>7} {'smallest/plain':>14}" + cal_header)
    for row in r.rows:
        _, kind, fraction, budget, status, measured, low, predicted, mb, pb, err, _, sp = row[:len(COLUMNS)]
        label = kind if fraction is None else f"{kind} {fraction:.2f}"
        line = (f"{label:>14} {_f(budget, '.1f'):>10} {status:>10} {_f(measured, '.1f'):>9} {_f(low, '.1f'):>8} "
                f"{_f(predicted, '.1f'):>9} {_f(mb, '.3f'):>8} {_f(pb, '.3f'):>8} {_f(err, '+.1%'):>7} "
                f"{_f(sp, '.3f'):>14}")
        if r.calibrated and row[13] is not None:
            cs, cr, own, cm, _, cmb, csm, _, at, atr = row[len(COLUMNS):]
            at_text = "-" if at is None else f"{at} ({_f(atr, 'd')})"
            line += (f" | {cs:>11} {_f(cr, 'd'):>6} {_f(own, '.1f'):>6} {_f(cm, '.1f'):>8} {_f(cmb, '.3f'):>8} "
                     f"{_f(csm, '.2f'):>8} {at_text:>11}")
        print(line)
    for failure in r.failures:
        print(f"  failed: {failure}")
    sys.stdout.flush()


def summarize(results: List[ModelResult], skipped: List[str]) -> Tuple[List[str], List[str]]:
    """Per-model summary table and overall lines (markdown)."""
    calibrated = any(r.calibrated for r in results)
    table = ["| model | plain: measured / predicted MiB (error) | memory: measured / predicted MiB (error) | "
             "feasible budgets | fit | max measured/budget | smallest_budget / measured plain | "
             "measured / smallest_budget | "
             + ("calibrated: fit / feasible (BudgetError) | calibrated: rounds | calibrated: max measured/budget | "
                "calibrated: smallest_budget / measured plain | calibrated: measured / smallest_budget | "
                if calibrated else "") + "sweep s |",
             "|---|---|---|---|---|---|---|---|---|" + ("---|" * 5 if calibrated else "")]
    feasible, fits = [], []
    infeasible, smallest_rows = [], []
    plain_errors, memory_errors = [], []
    for r in results:
        budget_rows = [row for row in r.rows if row[1] == "budget"]
        ok = [row for row in budget_rows if row[4] in ("fits", "OVER")]
        inf_all = [row for row in budget_rows if row[4] == "infeasible"]
        inf = [row for row in inf_all if row[5] is not None]  # measured at budget=smallest_budget
        feasible += [(r.name, row) for row in ok]
        fits += [row for row in ok if row[4] == "fits"]
        infeasible += [(r.name, row) for row in inf_all]
        smallest_rows += [(r.name, row) for row in inf]
        p = r.rows[0]
        plain_errors.append((r.name, p[10]))
        m = r.rows[1]
        if m[10] is not None:
            memory_errors.append((r.name, m[10]))
        worst = max((row[8] for row in ok), default=None)
        sp = sorted({row[12] for row in inf_all if row[12] is not None})
        ms = max((row[8] for row in inf), default=None)
        table.append(
            f"| {r.name} | {p[5]:.1f} / {p[7]:.1f} ({p[10]:+.1%}) | "
            + (f"{m[5]:.1f} / {m[7]:.1f} ({m[10]:+.1%})" if m[10] is not None else "error")
            + f" | {len(ok)}/{len(budget_rows)} | {sum(row[4] == 'fits' for row in ok)}/{len(ok)} | "
            f"{_f(worst, '.3f')} | {', '.join(f'{v:.3f}' for v in sp) or '-'} | {_f(ms, '.3f')} | "
            + (_calibrated_cells(ok) if calibrated else "") + f"{_f(r.seconds or None, '.0f')} |")
    lines = []
    n = len(feasible)
    lines.append(f"- feasible budget cases: {n} of "
                 f"{sum(1 for r in results for row in r.rows if row[1] == 'budget')}")
    if n:
        worst_name, worst_row = max(feasible, key=lambda item: item[1][8])
        lines.append(f"- measured <= budget: {len(fits)} of {n} ({len(fits) / n:.0%})")
        lines.append(f"- max measured/budget: {worst_row[8]:.3f} ({worst_name} at {worst_row[2]:.2f}); "
                     f"max predicted/budget: {max(row[9] for _, row in feasible):.3f}")
    if infeasible:
        distinct_all = {(name, row[3]) for name, row in infeasible}
        ratios = [row[12] for _, row in infeasible if row[12] is not None]
        lines.append(f"- infeasible cases: {len(infeasible)} ({len(distinct_all)} distinct smallest_budget values)"
                     + (f"; smallest_budget / measured plain peak: {min(ratios):.3f} to {max(ratios):.3f}"
                        if ratios else ""))
        distinct = {(name, row[3]): row for name, row in smallest_rows}
        if distinct:
            under = sum(row[8] <= 1 for row in distinct.values())
            worst = max(distinct.items(), key=lambda item: item[1][8])
            lines.append(f"- steps built with budget=smallest_budget and measured: {len(distinct)}; measured <= "
                         f"smallest_budget in {under}; max measured/smallest_budget {worst[1][8]:.3f} ({worst[0][0]})")
        unbuilt = len(distinct_all) - len(distinct)
        if unbuilt:
            lines.append(f"- budget=smallest_budget could not be built (raised again) for {unbuilt} of them: see "
                         "Failures")
    if calibrated:
        lines += _calibrated_lines(feasible, results, [(name, row) for name, row in infeasible if row[13] is not None])
    for label, errors in (("plain", plain_errors), ("memory", memory_errors)):
        if errors:
            within = [name for name, e in errors if abs(e) <= 0.10]
            worst = max(errors, key=lambda item: abs(item[1]))
            lines.append(f"- {label} predicted vs measured within 10%: {len(within)} of {len(errors)} models; "
                         f"largest error {worst[1]:+.1%} ({worst[0]})")
    for message in skipped:
        lines.append(f"- {message}")
    return table, lines


def _calibrated_cells(ok: List[list]) -> str:
    """The calibrated cells of one model's summary row (``ok``: its feasible budget rows)."""
    returned = [row for row in ok if row[13] in ("fits", "OVER")]
    raised = [row for row in ok if row[13] == "BudgetError"]
    rounds = [row[14] for row in ok if row[14] is not None]
    worst = max((row[18] for row in returned), default=None)
    smallest = {row[19]: row for row in raised if row[19] is not None}
    at = [row[18] for row in smallest.values() if row[18] is not None]
    return (f"{sum(row[13] == 'fits' for row in ok)}/{len(ok)} ({len(raised)}) | "
            f"{', '.join(str(n) for n in rounds) or '-'} | {_f(worst, '.3f')} | "
            f"{', '.join(f'{row[20]:.3f}' for row in sorted(smallest.values(), key=lambda x: x[19])) or '-'} | "
            f"{_f(max(at, default=None), '.3f')} | ")


def lowest_measured(result: ModelResult) -> float:
    """The lowest measured peak (MiB; each step's largest repeat) of any
    checkpointed step of a model's sweep: memory mode, the budget plans, the
    steps fit_to_budget returned.  A budget below it is one no plan tried
    met, whatever the planner predicted."""
    peaks = [row[5] for row in result.rows if row[1] != "plain" and row[5] is not None]
    peaks += [row[16] for row in result.rows if row[16] is not None]
    return min(peaks, default=float("inf"))


def _calibrated_lines(feasible: List[tuple], results: List[ModelResult], infeasible: List[tuple]) -> List[str]:
    """Overall lines for the calibrated columns (``feasible``: (model, row) of every feasible budget case;
    ``infeasible``: those of the cases infeasible as predicted that fit_to_budget was run on)."""
    n = len(feasible)
    returned = [(name, row) for name, row in feasible if row[13] in ("fits", "OVER")]
    raised = [(name, row) for name, row in feasible if row[13] == "BudgetError"]
    raised_anywhere = raised + [(name, row) for name, row in infeasible if row[13] == "BudgetError"]
    failed = n - len(returned) - len(raised)
    fits = [row for _, row in returned if row[13] == "fits"]
    rounds: Dict[int, int] = {}
    for _, row in returned:
        rounds[row[14]] = rounds.get(row[14], 0) + 1
    seconds = sum(r.cal_seconds for r in results)
    lowest = {r.name: lowest_measured(r) for r in results}
    lines = [f"- calibrated feasible cases (memsaving.fit_to_budget, max_rounds=4): {n}; returned a step in "
             f"{len(returned)} (rounds used: "
             + (", ".join(f"{k} round{'s' if k != 1 else ''} x{v}" for k, v in sorted(rounds.items())) or "-")
             + f"), BudgetError in {len(raised)}" + (f", other errors in {failed} (see Failures)" if failed else "")
             + (f"; {seconds:.0f} s in fit_to_budget and its measurement" if seconds else "")]
    if n:
        lines.append(f"- calibrated measured <= budget: {len(fits)} of {n} feasible cases ({len(fits) / n:.0%}); "
                     + (f"{len(fits)} of the {len(returned)} steps fit_to_budget returned "
                        f"({len(fits) / len(returned):.0%})" if returned else "no step returned"))
    below = [(name, row) for name, row in feasible if row[3] < lowest[name]]
    if n and below:
        kept = [(name, row) for name, row in feasible if row[3] >= lowest[name]]
        kept_fits = sum(row[13] == "fits" for _, row in kept)
        lines.append(f"- feasible as measured (budget >= the lowest peak any step of the model measured): "
                     f"{len(kept)} of {n} cases; calibrated measured <= budget in {kept_fits} of them"
                     + (f" ({kept_fits / len(kept):.0%})" if kept else "") + "; below every measured step: "
                     + ", ".join(f"{name} at {row[2]:.2f} ({row[13]})" for name, row in below))
    if returned:
        worst_name, worst_row = max(returned, key=lambda item: item[1][18])
        own = max(row[15] / row[3] for _, row in returned)
        lines.append(f"- calibrated max measured/budget: {worst_row[18]:.3f} ({worst_name} at {worst_row[2]:.2f}); "
                     f"fit_to_budget's own last-round peak / budget at most {own:.3f}")
    if infeasible:
        fitted = [(name, row) for name, row in infeasible if row[13] in ("fits", "OVER")]
        lines.append(f"- calibrated, infeasible as predicted (fit_to_budget at the fraction's budget measures the "
                     f"planner's lowest plan): {len(infeasible)} cases; returned a step in {len(fitted)} (measured "
                     f"<= budget in {sum(row[13] == 'fits' for _, row in fitted)}"
                     + (f": {', '.join(f'{name} at {row[2]:.2f}' for name, row in fitted)}" if fitted else "")
                     + f"), BudgetError with a measured smallest_budget in "
                     f"{sum(row[13] == 'BudgetError' for _, row in infeasible)}")
    if raised_anywhere:
        distinct = {(name, row[19]): row for name, row in raised_anywhere if row[19] is not None}
        measured = {key: row for key, row in distinct.items() if row[18] is not None}
        ratios = [row[20] for row in distinct.values()]
        lines.append(f"- calibrated BudgetError: {len(raised_anywhere)} cases (feasible or not as predicted), "
                     f"{len(distinct)} distinct smallest_budget values"
                     + (f" (smallest_budget / measured plain peak {min(ratios):.3f} to {max(ratios):.3f})"
                        if ratios else ""))
        within = sum(row[18] <= 1.05 for row in measured.values())
        under = sum(row[18] <= 1 for row in measured.values())
        line = (f"- smallest_budget from calibration measured <= 1.05 x itself: "
                f"{'yes' if distinct and within == len(distinct) else 'no'}, {within} of {len(distinct)} "
                f"(fit_to_budget at smallest_budget returned a step for {len(measured)}, measured <= "
                f"smallest_budget in {under}")
        if measured:
            worst = max(measured.items(), key=lambda item: item[1][18])
            line += (f"; max measured/smallest_budget {worst[1][18]:.3f} ({worst[0][0]}); fit_to_budget there: "
                     + ", ".join(f"{key[0]} {row[21]} ({row[22]} rounds)" for key, row in measured.items()))
        lines.append(line + ")")
        unmeasured = len(distinct) - len(measured)
        if unmeasured:
            lines.append(f"- fit_to_budget at smallest_budget raised again (or failed) for {unmeasured} of them: "
                         "see Failures")
    return lines


# ------------------------------------------------------------------------------------------------ main


def write(results: List[ModelResult], summary_table: List[str], summary_lines: List[str], out: str,
          command: str) -> List[str]:
    calibrated = any(r.calibrated for r in results)
    columns = COLUMNS + (CAL_COLUMNS if calibrated else ())
    table = Table(NAME, "Budget promise: measured peaks of Keras training steps against budgets (issue 15)",
                  columns)
    for r in results:
        for row in r.rows:
            table.add(*row[:len(columns)])
    notes = [f"Command: `{command}`; {source_state()}. Default TensorFlow settings (Grappler on, default thread pools). "
             "Absolute peaks (memsaving.measure_peak: weights and inputs included, as in the plans' "
             "predicted_peak); measured = max of the repeats after one warm-up run. Budgets are fractions of the "
             "measured plain peak; infeasible fractions are measured at budget=smallest_budget (budget MiB "
             "column). error = (predicted - measured) / measured."
             + (" cal columns: the same budget steps built with memsaving.fit_to_budget(body, x, "
                "budget=b, restore_variables=True) (b = fraction x measured plain, also for rows infeasible as "
                "predicted, where fit_to_budget measures the planner's lowest plan) and then measured as above "
                "(max of the repeats after one warm-up); after its BudgetError, fit_to_budget again at the error's smallest_budget, measured "
                "against it (cal measured/budget is then measured / smallest_budget). cal own MiB: "
                "fit_to_budget's own last-round peak." if calibrated else ""), "", "Models:", ""]
    notes += [f"- {r.name}: {r.description}; in use before the step {r.in_use_before / MIB:.2f} MiB, plan "
              f"resident_bytes {r.resident / MIB:.2f} MiB" for r in results]
    notes += ["", "Summary:", ""] + summary_table + [""] + summary_lines
    failures = [f"- {r.name}: {f}" for r in results for f in r.failures]
    if failures:
        notes += ["", "Failures:", ""] + failures
    table.notes = notes
    md = table.write_markdown(out)
    path = os.path.join(out, f"{NAME}.csv")
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model", "case", "fraction", "budget_bytes", "status", "measured_max_bytes",
                         "measured_min_bytes", "predicted_bytes", "measured_over_budget", "predicted_over_budget",
                         "error", "smallest_budget_bytes", "smallest_over_plain"]
                        + (["cal_status", "cal_rounds", "cal_own_peak_bytes", "cal_measured_max_bytes",
                            "cal_measured_min_bytes", "cal_measured_over_budget", "cal_smallest_budget_bytes",
                            "cal_smallest_over_plain", "cal_at_smallest", "cal_rounds_at_smallest"]
                           if calibrated else []))
        for row in table.rows:
            writer.writerow(["" if v is None else round(v * MIB) if k in MIB_COLUMNS
                             else round(v, 4) if isinstance(v, float) else v for k, v in enumerate(row)])
    return [md, path]


def run_worker(name: str, quick: bool, fractions, repeat: int, path: str, calibrate: bool = False) -> None:
    """Sweep one model in this process and write its result as JSON to ``path``."""
    if name in NEEDS_KERAS_HUB:
        try:
            import keras_hub  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
        except ImportError as error:
            message = (f"{name} skipped: keras_hub is not importable ({error}); "
                       "install it with pip install -e '.[bench]' (keras-hub==0.32.0)")
            print(f"[budget_promise] {message}", flush=True)
            with open(path, "w") as f:
                json.dump({"skipped": message}, f)
            return
    result = sweep(name, quick, fractions, repeat, calibrate)
    print_model(result)
    with open(path, "w") as f:
        json.dump(dataclasses.asdict(result), f)


def run_isolated(name: str, args, fractions) -> Tuple[Optional[ModelResult], Optional[str]]:
    """Sweep ``name`` in a fresh Python process, so that each model starts with an empty allocator
    (memory left by an earlier model would count in the absolute peaks)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        command = [sys.executable, "-m", "experiments.bench_budget_promise", "--worker", name, "--result", path,
                   "--fractions", ",".join(str(f) for f in fractions), "--repeat", str(args.repeat)]
        if args.quick:
            command.append("--quick")
        command.append("--calibrate" if args.calibrate else "--no-calibrate")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        code = subprocess.call(command, cwd=root)
        if not os.path.exists(path):
            message = f"{name} failed: the worker process exited with code {code} and wrote no result"
            print(f"[budget_promise] {message}", flush=True)
            return None, message
        with open(path) as f:
            data = json.load(f)
    if "skipped" in data:
        return None, data["skipped"]
    return ModelResult(**data), None


def read_csv(path: str) -> List[ModelResult]:
    """The models' rows of a sweep's CSV (as :func:`write` wrote them), to
    summarize again without measuring; descriptions and times are not in
    the CSV."""
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        results: Dict[str, ModelResult] = {}
        for values in reader:
            row = []
            for k, v in enumerate(values):
                if v == "":
                    row.append(None)
                elif k in MIB_COLUMNS:
                    row.append(int(v) / MIB)
                elif k in (14, 22):
                    row.append(int(v))
                else:
                    try:
                        row.append(float(v))
                    except ValueError:
                        row.append(v)
            name = row[0]
            if name not in results:
                results[name] = ModelResult(name, "(read from a CSV)", 0, calibrated=len(header) > len(COLUMNS))
            results[name].rows.append(row + NO_CAL[len(row) - len(COLUMNS):])
    return list(results.values())


def main(argv: Optional[List[str]] = None) -> List[ModelResult]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {list(MODELS)}")
    parser.add_argument("--fractions", default=None,
                        help="budget fractions of the measured plain peak (default 0.3,...,0.9; --quick 0.4,0.6,0.8)")
    parser.add_argument("--quick", action="store_true", help="smaller models and three fractions: a smoke run")
    parser.add_argument("--repeat", type=int, default=3, help="measured runs per step after one warm-up (default 3)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="directory for budget_promise.md and .csv")
    parser.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                        help="also build each feasible budget step with memsaving.fit_to_budget and measure it "
                             "(the cal columns; default on, --no-calibrate for the planner's promise alone)")
    parser.add_argument("--summarize", metavar="CSV",
                        help="print the summary of an earlier sweep's budget_promise.csv; measures nothing")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: sweep one model in this process
    parser.add_argument("--result", help=argparse.SUPPRESS)  # internal: where the worker writes its JSON
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = sorted(set(names + ([args.worker] if args.worker else [])) - set(MODELS))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {list(MODELS)}")
    if args.fractions:
        fractions = [float(f) for f in args.fractions.split(",") if f.strip()]
    else:
        fractions = list(QUICK_FRACTIONS if args.quick else FRACTIONS)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.summarize:
        summary_table, summary_lines = summarize(read_csv(args.summarize), [])
        print("\n".join(summary_table + [""] + summary_lines))
        return []
    if args.worker:
        run_worker(args.worker, args.quick, fractions, args.repeat, args.result, args.calibrate)
        return []
    command = "python -m experiments.bench_budget_promise" + ("" if argv is None and len(sys.argv) <= 1 else
                                                              " " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"budget_promise: {', '.join(names)}; fractions {fractions}; {args.repeat} measured runs per step; "
          f"{'with' if args.calibrate else 'without'} fit_to_budget calibration; one process per model; "
          f"{machine()}; {source_state()}", flush=True)

    results, skipped = [], []
    start = time.perf_counter()
    for name in names:
        result, message = run_isolated(name, args, fractions)
        if result is not None:
            results.append(result)
        else:
            skipped.append(message)

    summary_table, summary_lines = summarize(results, skipped)
    print(f"\nSummary ({time.perf_counter() - start:.0f} s in all)\n")
    print("\n".join(summary_table))
    print()
    print("\n".join(summary_lines))
    if results:
        for path in write(results, summary_table, summary_lines, args.out, command):
            print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
