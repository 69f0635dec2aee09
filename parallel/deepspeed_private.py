"""Every private name of DeepSpeed that CSA2 touches, and nothing else: the one file to re-check on a DeepSpeed upgrade.

DeepSpeed's pipeline engine offers no public hook for what our step needs (our reductions and optimizer step run
from its pipeline instructions, overlapped boundary transfers, a start-up broadcast that leaves the row-sharded
tables and experts alone), so ``PipelineAdapter`` overrides the private methods that do it and hands each over to a
public, named hook of ours. Each hook defaults to DeepSpeed's behaviour, so a subclass overrides only what it changes
and calls ``super()`` for DeepSpeed's part. Where DeepSpeed has a public method for a part, the hooks call it instead:
a list of gradients goes to its bucketed data-parallel all-reduce as ``buffered_allreduce_fallback(grads=...)``, and
a schedule is wrapped where it is run rather than where DeepSpeed builds it.
``tests/parallel/test_deepspeed_private.py`` fails when another module of ``parallel/``, ``train/``, ``model/`` or
``bench/`` names a private attribute of DeepSpeed's pipeline classes, or when DeepSpeed is not the version checked here.

Checked against DeepSpeed ``CHECKED_VERSION`` (pinned in ``pyproject.toml``). Besides the names in
``PRIVATE_NAMES``, the hooks read and write attributes DeepSpeed keeps without an underscore but does not document:
``pipe_buffers`` and ``grad_layer`` (a pipeline instruction's tensors), ``total_loss`` (the running loss of a batch),
and the step counters ``skipped_steps``, ``global_steps`` and ``global_samples``.
"""
from collections.abc import Callable

from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

CHECKED_VERSION = "0.19.8"

# The private names used below, for the guard test; keep in step with the code of this file.
PRIVATE_NAMES = ("_INSTRUCTION_MAP", "_exec_schedule", "_broadcast_model")

_DEEPSPEED = PipelineEngine._INSTRUCTION_MAP
"""DeepSpeed's function for each pipeline instruction type (``schedule.ForwardPass``, ``schedule.ReduceGrads``, ...):
``PipelineEngine._exec_schedule`` runs every instruction through ``self._INSTRUCTION_MAP[type(instruction)]``. Taking
DeepSpeed's own from that table, rather than by their seven ``_exec_*`` names, is what a hook's default runs."""


def instructions(engine: PipelineEngine) -> dict:
    """A copy of the engine's instruction table (instruction type -> function of the engine and the instruction's
    arguments), to wrap some entries of (benchmarks time them) and hand back with ``use_instructions``."""
    return dict(engine._INSTRUCTION_MAP)


def use_instructions(engine: PipelineEngine, table: dict) -> None:
    """Make this engine (not its class) run ``table``'s functions for the pipeline instructions."""
    engine._INSTRUCTION_MAP = table


def _hook(name: str) -> Callable:
    """An instruction-table entry that calls the engine's public hook ``name`` with the instruction's arguments."""
    def run(engine, **kwargs):
        return getattr(engine, name)(**kwargs)
    run.__name__ = name
    return run


class PipelineAdapter(PipelineEngine):
    """DeepSpeed's pipeline engine with its private steps handed to public hooks, each DeepSpeed's by default:

    - per instruction of the schedule: ``reduce_tied_gradients``, ``reduce_gradients``, ``step_optimizer``,
      ``send_activations``, ``recv_activations``, ``send_gradients``, ``recv_gradients``;
    - ``wrap_schedule`` (a training or an inference schedule, before it runs), ``after_schedule`` (once one ran);
    - ``broadcast_model`` (the start-up copy of the first data-parallel rank's weights, called from DeepSpeed's
      constructor)."""

    _INSTRUCTION_MAP = {
        **_DEEPSPEED,
        **{kind: _hook(name) for kind, name in (
            (schedule.ReduceTiedGrads, "reduce_tied_gradients"), (schedule.ReduceGrads, "reduce_gradients"),
            (schedule.OptimizerStep, "step_optimizer"), (schedule.SendActivation, "send_activations"),
            (schedule.RecvActivation, "recv_activations"), (schedule.SendGrad, "send_gradients"),
            (schedule.RecvGrad, "recv_gradients"))},
    }

    def reduce_tied_gradients(self) -> None:
        _DEEPSPEED[schedule.ReduceTiedGrads](self)

    def reduce_gradients(self) -> None:
        _DEEPSPEED[schedule.ReduceGrads](self)

    def step_optimizer(self, lr_kwargs=None) -> None:
        """DeepSpeed's optimizer step: the optimizer, the LR schedule, the step counters, the gradients cleared."""
        _DEEPSPEED[schedule.OptimizerStep](self, lr_kwargs)

    def send_activations(self, buffer_id: int) -> None:
        _DEEPSPEED[schedule.SendActivation](self, buffer_id)

    def recv_activations(self, buffer_id: int) -> None:
        _DEEPSPEED[schedule.RecvActivation](self, buffer_id)

    def send_gradients(self, buffer_id: int) -> None:
        _DEEPSPEED[schedule.SendGrad](self, buffer_id)

    def recv_gradients(self, buffer_id: int) -> None:
        _DEEPSPEED[schedule.RecvGrad](self, buffer_id)

    def count_skipped_step(self) -> None:
        """Count an optimizer step that was not taken as DeepSpeed counts one (its fp16 overflow skip does the
        same): the step and its samples go by, ``skipped_steps`` goes up."""
        self.skipped_steps += 1
        self.global_steps += 1
        self.global_samples += self.train_batch_size()

    def wrap_schedule(self, pipe_schedule: schedule.PipeSchedule) -> schedule.PipeSchedule:
        return pipe_schedule

    def after_schedule(self) -> None:
        pass

    def broadcast_model(self) -> None:
        super()._broadcast_model()

    def _exec_schedule(self, pipe_schedule):
        super()._exec_schedule(self.wrap_schedule(pipe_schedule))
        self.after_schedule()

    def _broadcast_model(self):
        self.broadcast_model()
