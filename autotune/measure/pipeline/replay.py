"""One rank's steps replayed: the schedule's forwards and backwards with the tensors torch's pipelining keeps (its
receive buffers, the outputs held until their backward, what the schedule's own variables keep alive), the
gradients scaled and the optimizer stepped as ``schedule.step`` and torchtitan do."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from autotune.measure.meters import FORWARD_BACKWARD, STEP, Meter
from autotune.measure.offload import step_on_host
from autotune.measure.pipeline.cutting import Stage, StageExit, first_tensor
from autotune.measure.pipeline.schedules import interleaved_actions
from autotune.measure.pipeline.stages import StageStrategy
from autotune.measure.trial import _fake_step
from autotune.tasks.task import ProbeTask

OPTIMIZER_STEPS = 2


class Replay:
    """One stage's steps: the schedule's forwards and backwards with the tensors torch's pipelining keeps."""

    def __init__(
        self,
        task: ProbeTask,
        stage: Stage,
        strategy: StageStrategy,
        device: torch.device,
        schedule: str,
        microbatches: int,
        micro_batch: int,
        recorder: Any,
    ) -> None:
        self.task, self.stage, self.strategy, self.device = task, stage, strategy, device
        self.schedule, self.k, self.micro_batch = schedule, microbatches, micro_batch
        # The breakdown's recorder the steps tell what they do (trial.recorder_of: one that hears nothing unless the
        # stage's steps are recorded).
        self.recorder = recorder
        shapes = stage.flow.shapes
        assert shapes is not None
        # The crossing activations as the rank holds them (sequence parallel: its L / tp positions).
        self.input_meta = strategy.crossing_meta(shapes.block_inputs[stage.first_block])
        self.output_meta = strategy.crossing_meta(shapes.block_outputs[stage.first_block + stage.block_count - 1])

    def run(self, meter: Meter) -> None:
        stage, k, recorder = self.stage, self.k, self.recorder
        recorder.classify_model(stage.model)
        recorder.phase("step")  # the optimizer's construction
        optimizer = self.task.make_optimizer(stage.model)
        arrivals, grads_in = self.receive_buffers()
        for _ in range(OPTIMIZER_STEPS):
            recorder.phase("inputs")
            with self.strategy.step_batches(self.task, self.micro_batch, k, self.device) as batches:
                if self.schedule == "gpipe":
                    self._gpipe(batches, arrivals, grads_in)
                else:
                    self._one_f_one_b(batches, arrivals, grads_in)
                del batches
                # Within the step (torchtitan's train context wraps schedule.step, which reduces and scales them).
                self._backwards_ended()
            meter.checkpoint(FORWARD_BACKWARD)
            recorder.phase("step")
            # --offload params: the step runs on the host; a compiled step (torchao's) runs eagerly on fake tensors.
            with step_on_host(self.task.offload, optimizer), _fake_step(self.task, meter):
                optimizer.step()
                recorder.classify_optimizer(optimizer)
                optimizer.zero_grad(set_to_none=self.task.zero_grad_to_none)
            meter.checkpoint(STEP)

    def receive_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """PipelineStage's receive buffers, one per micro-batch, made once and kept for the schedule's life: the
        activations arriving from the previous stage and the gradients from the next (what the pipeline adds to a
        rank, its ``collectives`` in a breakdown)."""
        arrivals = [] if self.stage.first else [self._buffer(self.input_meta, fill="normal") for _ in range(self.k)]
        grads_in = [] if self.stage.last else [self._buffer(self.output_meta, fill="zero") for _ in range(self.k)]
        self.recorder.classify([*arrivals, *grads_in], "collectives")
        return arrivals, grads_in

    def _backwards_ended(self) -> None:
        """After the stage's last backward of the step: its gradients reduced by the strategy (FSDP2's
        reduce-scatter), then divided by K, as the schedule scales them before the step."""
        self.recorder.phase("step")
        self.strategy.grads_reduced(self.stage.model)
        with torch.no_grad():
            for param in self.stage.model.parameters():
                if param.grad is not None:
                    param.grad.div_(self.k)
        self.recorder.classify_gradients(self.stage.model)

    def _buffer(self, meta: tuple[torch.Size, torch.dtype], fill: str) -> torch.Tensor:
        shape, dtype = meta
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        with torch.no_grad():
            if fill == "normal" and buffer.is_floating_point():
                buffer.normal_()
            else:
                buffer.zero_()
        return buffer

    def _forward(self, index: int, batches: list[Any], arrivals: list[torch.Tensor]) -> tuple[Any, Any]:
        """One forward: (what the stage keeps for its backward, its output)."""
        stage, flow = self.stage, self.stage.flow
        self.recorder.phase("forward")
        if not stage.first:
            flow.arrival = self.strategy.arriving(arrivals[index].requires_grad_(True))
        flow.output = None
        loss = None
        try:
            with (
                self.strategy.loss_context(),
                self.strategy.autocast(self.task.precision, self.device),
                warnings.catch_warnings(),
            ):
                # Under tp a stage's output (a block's, or the gathered logits) is a DTensor's local view, as the real
                # stage returns it; FSDP2 warns of in-place ops on such a view, which the replay does not run.
                warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
                try:
                    loss = self.task.compute_loss(stage.model, batches[index])
                except StageExit as stop:
                    stop.output = self.strategy.forward_ended(stage.model, stop.output)
                    raise
        except StageExit as stop:
            output = first_tensor(stop.output)
            if output is not None:
                output = self.strategy.leaving(output)
        else:
            output = flow.output
        finally:
            flow.arrival = None
            flow.output = None
        return (output, loss), output

    def _backward(self, index: int, cache: dict[int, Any], arrivals: list[torch.Tensor], grads_in: list[torch.Tensor]):
        """One backward: the gradient of the stage's input (None on the first stage)."""
        (output, loss) = cache.pop(index)
        self.recorder.phase("backward")
        self.strategy.backward_begins(self.stage.model)
        if self.stage.last:
            with self.strategy.loss_context():
                torch.autograd.backward([loss])
        else:
            torch.autograd.backward([output], grad_tensors=[grads_in[index]])
        del output, loss
        self.recorder.classify_gradients(self.stage.model)
        if self.stage.first:
            return None
        grad = arrivals[index].grad
        arrivals[index].grad = None
        return grad

    def _gpipe(self, batches: list[Any], arrivals: list[torch.Tensor], grads_in: list[torch.Tensor]) -> None:
        cache: dict[int, Any] = {}
        losses: list[Any] = []
        sent_outputs: list[torch.Tensor] = []  # every forward send is waited on after the forward phase
        output = None
        for index in range(self.k):
            kept, output = self._forward(index, batches, arrivals)
            cache[index] = kept
            losses.append(kept[1])
            if not self.stage.last:
                sent_outputs.append(output.detach())
        sent_grads: list[torch.Tensor] = []  # and every backward send after the backward phase
        for index in range(self.k):
            grad = self._backward(index, cache, arrivals, grads_in)
            if grad is not None:
                sent_grads.append(grad)
            del grad
        del losses, sent_outputs, sent_grads, output

    def _one_f_one_b(self, batches: list[Any], arrivals: list[torch.Tensor], grads_in: list[torch.Tensor]) -> None:
        stage, k = self.stage, self.k
        cache: dict[int, Any] = {}
        losses: list[Any] = []
        warmup = min(k, stage.stages - stage.index)
        send_work: list[torch.Tensor] = []
        fwd_sends: list[torch.Tensor] = []
        bwd_sends: list[torch.Tensor] = []
        output = None
        forward = backward = 0
        for _ in range(warmup):
            kept, output = self._forward(forward, batches, arrivals)
            cache[forward] = kept
            losses.append(kept[1])
            del kept
            fwd_sends = [] if stage.last else [output.detach()]
            if forward != warmup - 1:
                send_work = list(fwd_sends)
            forward += 1
        while True:
            grad = self._backward(backward, cache, arrivals, grads_in)
            bwd_sends = [] if grad is None else [grad]
            del grad
            backward += 1
            if forward == k:
                break
            kept, output = self._forward(forward, batches, arrivals)
            cache[forward] = kept
            losses.append(kept[1])
            del kept
            fwd_sends = [] if stage.last else [output.detach()]
            forward += 1
        send_work = list(bwd_sends)
        while backward < k:
            grad = self._backward(backward, cache, arrivals, grads_in)
            bwd_sends = [] if grad is None else [grad]
            del grad
            send_work = list(bwd_sends)
            backward += 1
        del losses, send_work, fwd_sends, bwd_sends, output


class InterleavedReplay:
    """One rank's steps under interleaved 1F1B: its V stages (chunks) built side by side, each with its receive
    buffers and its own optimizer (torchtitan builds one per model part), the actions in the schedule's order.
    The runtime of torch's multi-stage schedules waits on every send only when the step ends: every output
    and every input gradient sent in a step stays referenced until then.

    Over FSDP2 the runtime (``_PipelineScheduleRuntime``, lowered by ``_add_unshard_reshard`` and
    ``_add_reduce_grad``) adds its own actions, replayed through the strategy's hooks: every chunk's units are
    gathered when the step starts (UNSHARD, asynchronously, in the order the chunks first compute; waited on before
    the chunk's first compute), and right after a chunk's last backward its gradients are reduce-scattered and
    divided by K (REDUCE_GRAD, ``perform_reduce_grad``), then its units resharded (RESHARD), while the other chunk
    may still run backwards."""

    def __init__(self, chunks: list[Replay], ranks: int) -> None:
        self.chunks, self.ranks = chunks, ranks

    def run(self, meter: Meter) -> None:
        chunks = self.chunks
        task, k, strategy = chunks[0].task, chunks[0].k, chunks[0].strategy
        recorder = chunks[0].recorder
        for chunk in chunks:
            recorder.classify_model(chunk.stage.model)
        recorder.phase("step")  # the optimizers' construction
        optimizers = [task.make_optimizer(chunk.stage.model) for chunk in chunks]
        buffers = [chunk.receive_buffers() for chunk in chunks]
        arrivals = [arriving for arriving, _ in buffers]
        grads_in = [grads for _, grads in buffers]
        del buffers
        rank = chunks[0].stage.index
        actions = interleaved_actions(rank, self.ranks, k, len(chunks))
        first_computes = list(dict.fromkeys(local for _, local, _ in actions))
        last_backward = {local: position for position, (kind, local, _) in enumerate(actions) if kind == "B"}
        for _ in range(OPTIMIZER_STEPS):
            recorder.phase("inputs")
            with strategy.step_batches(task, chunks[0].micro_batch, k, chunks[0].device) as batches:
                pending = {local: strategy.unshard_begins(chunks[local].stage.model) for local in first_computes}
                caches: list[dict[int, Any]] = [{} for _ in chunks]
                losses: list[Any] = []
                sent: list[torch.Tensor] = []
                for position, (kind, local, index) in enumerate(actions):
                    chunk = chunks[local]
                    strategy.unshard_waited(pending.pop(local, []))
                    if kind == "F":
                        kept, output = chunk._forward(index, batches, arrivals[local])
                        caches[local][index] = kept
                        if chunk.stage.last:
                            losses.append(kept[1])
                        else:
                            sent.append(output.detach())
                        del kept, output
                        continue
                    grad = chunk._backward(index, caches[local], arrivals[local], grads_in[local])
                    if grad is not None:
                        sent.append(grad)
                    del grad
                    if position == last_backward[local]:
                        chunk._backwards_ended()
                        strategy.stage_resharded(chunk.stage.model)
                del batches
            del sent, losses, caches, pending
            meter.checkpoint(FORWARD_BACKWARD)
            recorder.phase("step")
            for optimizer in optimizers:
                # --offload params: the step runs on the host; a compiled step runs eagerly on fake tensors.
                with step_on_host(task.offload, optimizer), _fake_step(task, meter):
                    optimizer.step()
                    recorder.classify_optimizer(optimizer)
                    optimizer.zero_grad(set_to_none=task.zero_grad_to_none)
            meter.checkpoint(STEP)


@contextmanager
def hooks_removed(stages: list[Stage]) -> Iterator[None]:
    try:
        yield
    finally:
        for stage in stages:
            for handle in stage.handles:
                handle.remove()
