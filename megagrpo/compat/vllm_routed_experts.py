"""The experts vLLM's MoE routers choose for every token an engine forwards, captured by megagrpo.

Verified with vllm 0.32.0 (CPU build). vLLM returns routed experts itself (``enable_return_routed_experts``)
only through Model Runner V2, which needs Triton; the CPU build has no Triton backend, so there it
refuses ("AuxOutput Connector requires Model Runner V2", then "Model Runner V2 requires Triton"). The
hook vLLM's own capture uses does not depend on the runner: every MoE layer's router
(``BaseRouter.select_experts``) hands the top-k expert ids it chose, one row per token of the forward,
to ``router.capture_fn`` when one is set (``set_capture_fn``). What a row belongs to is the model
runner's: it lays a step's tokens out by its persistent batch (``input_batch.req_ids``, private
state), request after request, each with ``scheduler_output.num_scheduled_tokens[id]`` rows for
positions from ``input_batch.num_computed_tokens_cpu``. So, inside a vLLM worker (the functions
below are called through ``LLM.collective_rpc``):

- :func:`install` sets a capture fn on every MoE router and wraps the runner's ``execute_model`` (an
  instance attribute over the class's method) so that each forward's rows are split by request, with
  the position of their first token; :func:`uninstall` takes both away again.
- :func:`start` clears what was recorded and records; :func:`take` stops, and returns (worker rank 0;
  the others ``{}``: every TP rank routes the same tokens alike) ``{vLLM request id: [(first
  position, rows [n, MoE layers, k])]}`` in step order; given request ids (an engine stepped request
  by request, as multi-turn episodes run), it returns theirs and records on.
- :func:`request_key`: vLLM 0.32 names a request ``"<id>-<8 random characters>"``, and the
  completions of a request with ``n > 1`` ``"<index>_<id>-<8 random>"`` (``input_processor.
  assign_request_id``, ``parallel_sampling.get_child_info``); ``LLM.generate`` numbers its requests
  (digits only), which the caller's ``RequestOutput.request_id`` and ``CompletionOutput.index`` name.

Only tokens that are forwarded get rows: prompt tokens found in the prefix cache are not, so the engine
must run with ``enable_prefix_caching=False``. A request vLLM preempts is forwarded again from
position 0: its later rows are for the same positions and replace the earlier ones (the caller places
rows by position). A CUDA graph replays its kernels without calling the capture fn: this is for the
CPU build (eager); on GPUs vLLM's own capture serves. :func:`moe_layer_ids` lists the model's MoE
layers (vLLM's own capture returns every decoder layer, the dense ones included).
"""

from __future__ import annotations

__all__ = ["install", "moe_layer_ids", "request_key", "start", "take", "uninstall"]

_ATTR = "megagrpo_routed_experts"  # where the recorder lives on the worker


def _moe_runners(model):
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    return [m for m in model.modules() if isinstance(m, MoERunner)]


def moe_layer_ids(worker) -> list[int]:
    """The decoder layers (``layer_id``) of the worker's model that are MoE layers, in order."""
    return sorted(m.layer_id for m in _moe_runners(worker.model_runner.model))


class _Recorder:
    """Per forward step: the batch's layout (request, first position, rows) and each MoE layer's
    top-k ids; once the step's forward is done, its rows go to the requests, ``[n, layers, k]``."""

    def __init__(self, runner, dtype):
        self.runner, self.dtype = runner, dtype
        self.recording = False
        self.requests: dict[str, list] = {}  # vLLM request id -> [(first position, rows)]
        self.original = runner.execute_model
        self._scheduled = None  # the scheduler output of the step being executed, while recording
        self._step: tuple[list, dict] | None = None  # (layout, {layer id: top-k ids}) of its forward

    def execute_model(self, scheduler_output, *args, **kwargs):
        self._scheduled = scheduler_output if self.recording else None
        try:
            return self.original(scheduler_output, *args, **kwargs)
        finally:
            self._scheduled = None
            self._close_step()

    def capture(self, layer_id: int, topk_ids) -> None:
        if self._scheduled is None:  # not recording, or a warm-up / profiling forward
            return
        if self._step is None:  # the step's first MoE layer: the batch as the forward lays it out
            batch, counts = self.runner.input_batch, self._scheduled.num_scheduled_tokens
            layout = [
                (req_id, int(batch.num_computed_tokens_cpu[i]), counts[req_id])
                for i, req_id in enumerate(batch.req_ids)
                if counts.get(req_id, 0) > 0
            ]
            self._step = (layout, {})
        if layer_id in self._step[1]:  # a step split into several forwards (vLLM's micro-batching)
            raise RuntimeError(f"routed experts: MoE layer {layer_id} routed twice in one step")
        self._step[1][layer_id] = topk_ids.detach().to("cpu", self.dtype, copy=True)

    def _close_step(self) -> None:
        if self._step is None:
            return
        import torch

        layout, by_layer = self._step
        self._step = None
        rows = torch.stack([by_layer[layer] for layer in sorted(by_layer)], dim=1)  # [tokens, layers, k]
        scheduled = sum(count for _, _, count in layout)
        if scheduled > rows.shape[0]:
            raise RuntimeError(
                f"routed experts: {scheduled} tokens were scheduled, the routers saw {rows.shape[0]}"
            )
        at = 0
        for req_id, first, count in layout:
            self.requests.setdefault(req_id, []).append((first, rows[at : at + count]))
            at += count


def install(worker, dtype) -> list[int]:
    """Capture the routers of the worker's model from now on (rows of ``dtype``, a torch dtype); returns
    the MoE layers (``layer_id``), [] for a dense model (nothing installed)."""
    runners = _moe_runners(worker.model_runner.model)
    if not runners:
        return []
    uninstall(worker)
    recorder = _Recorder(worker.model_runner, dtype)
    for runner in runners:
        runner.router.set_capture_fn(lambda ids, layer=runner.layer_id: recorder.capture(layer, ids))
    worker.model_runner.execute_model = recorder.execute_model
    setattr(worker, _ATTR, recorder)
    return sorted(r.layer_id for r in runners)


def uninstall(worker) -> None:
    recorder = getattr(worker, _ATTR, None)
    if recorder is None:
        return
    for runner in _moe_runners(worker.model_runner.model):
        runner.router.set_capture_fn(None)
    del worker.model_runner.execute_model  # the class's method again
    delattr(worker, _ATTR)


def start(worker) -> None:
    recorder = getattr(worker, _ATTR)
    recorder.requests = {}
    recorder.recording = True


def take(worker, request_ids=None) -> dict[str, list]:
    """What was recorded, and recording stops; with ``request_ids`` (the caller's ids of finished
    requests), those requests' rows only, and recording goes on for the others."""
    recorder = getattr(worker, _ATTR)
    if request_ids is None:
        recorder.recording = False
        requests, recorder.requests = recorder.requests, {}
    else:
        wanted = set(request_ids)
        finished = [r for r in recorder.requests if request_key(r)[0] in wanted]
        requests = {r: recorder.requests.pop(r) for r in finished}
    return requests if worker.rank == 0 else {}


def request_key(vllm_request_id: str) -> tuple[str, int]:
    """(``RequestOutput.request_id``, ``CompletionOutput.index``) of a vLLM request id."""
    base, dash, suffix = vllm_request_id.rpartition("-")
    if not dash or len(suffix) != 8:
        raise ValueError(f"unexpected vLLM request id {vllm_request_id!r} (vLLM 0.32: '<id>-<8 random>')")
    index, underscore, parent = base.partition("_")
    return (parent, int(index)) if underscore else (base, 0)
