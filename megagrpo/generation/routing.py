"""Routed experts per completion, for rollout routing replay (``grpo.routing_replay``).

An engine asked for them returns, with each completion, the experts its MoE routers chose for every
token it forwarded: ``Completion.routed_experts``, ``[P + N - 1, MoE layers, k]`` (prompt tokens, then
response tokens; the last response token is never fed forward). The trainer replays them, so that its
forwards of a rollout route every token as the engine that sampled it did. Two ways to the same result,
picked by :func:`routing_capture`:

- :class:`EngineRouting` (GPUs): vLLM's own capture, ``enable_return_routed_experts`` (Model Runner V2,
  prefix caching on: a cached prompt's rows are kept per KV block), which returns with a finished
  request ``CompletionOutput.routed_experts`` ``[tokens, decoder layers, k]`` (uint8, uint16 past 256
  experts); the MoE layers' rows are kept. Rows kept for cached blocks were routed by the weights that
  computed them: a weight sync resets the prefix cache (``VLLMEngine.receive_weights``), which
  also starts a new namespace of vLLM's routing store. Written from vLLM 0.32's code, not run: this
  machine has no GPU.
- :class:`HookedRouting` (vLLM's CPU build, which cannot run vLLM's own capture): megagrpo's hook on
  every MoE router (``compat.vllm_routed_experts``) with prefix caching off, rows placed by position,
  so a request vLLM preempted and computed again keeps the rows of its last computation.

Multi-turn episodes (``env.environment``): each turn is a request whose prompt is the episode so far,
so its rows cover every position before its last sampled token. The episode keeps, per position, the
rows of the first turn that forwarded it (``megagrpo.envs.episodes``): the computation that gave the
sampled tokens of that turn their logprobs, and whose keys and values later turns reuse where vLLM
caches prefixes (vLLM's own capture then returns the cached rows itself). A later turn that computes a
position again and routes it otherwise is counted (``moe/episode_rerouted_frac``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from megagrpo.compat import vllm_routed_experts

if TYPE_CHECKING:
    from megagrpo.config import Config


def routed_experts_dtype(num_experts: int) -> torch.dtype:
    """uint8 up to 256 experts, as vLLM stores them; int16 past that (torch's uint16 has few ops)."""
    return torch.uint8 if num_experts <= 256 else torch.int16


def place_rows(chunks: Sequence[tuple[int, torch.Tensor]], length: int, what: str) -> torch.Tensor:
    """``[length, layers, k]`` from ``(first position, rows)`` chunks, later chunks replacing earlier ones
    at the same positions (a recomputed request); every position must be covered."""
    ends = [first + rows.shape[0] for first, rows in chunks]
    if [first for first, _ in chunks] == [0, *ends[:-1]] and ends[-1] == length:
        return torch.cat([rows for _, rows in chunks])  # end to end, once each: the usual request
    first_rows = chunks[0][1]
    out = first_rows.new_zeros((length, *first_rows.shape[1:]))
    covered = torch.zeros(length, dtype=torch.bool)
    for first, rows in chunks:
        end = first + rows.shape[0]
        if end > length:
            raise RuntimeError(f"routed experts of {what}: rows up to position {end}, expected {length}")
        out[first:end] = rows
        covered[first:end] = True
    if not bool(covered.all()):
        missing = int((~covered).sum())
        raise RuntimeError(f"routed experts of {what}: {missing} of {length} positions were not routed")
    return out


def merge_rows(
    known: torch.Tensor | None, chunks: Sequence[tuple[int, torch.Tensor]], what: str
) -> torch.Tensor:
    """A request stream's rows so far (``generation.stream``): ``known`` (positions ``0..len(known)``, or
    None) then ``chunks`` ``(first position, rows)`` in the order they were forwarded, each position
    keeping its *first* row: the forward that sampled the next token, under the weights that sampled it
    (a ``"recompute"`` swap or a continuation forwards the positions so far again, with newer weights; a
    preemption again, with the same). Positions must be covered from 0 without a gap."""
    parts = [known] if known is not None and known.shape[0] else []
    end = parts[0].shape[0] if parts else 0
    for first, rows in chunks:
        if first > end:
            raise RuntimeError(
                f"routed experts of {what}: rows from position {first}, none for {end}..{first}"
            )
        if first + rows.shape[0] > end:
            parts.append(rows[end - first :])
            end = first + rows.shape[0]
    if not parts:
        raise RuntimeError(f"routed experts of {what}: no rows were recorded")
    return torch.cat(parts)


class HookedRouting:
    """vLLM's CPU build: megagrpo's capture hook on every MoE router (``compat.vllm_routed_experts``)."""

    def __init__(self, num_experts: int):
        self.dtype = routed_experts_dtype(num_experts)

    def engine_args(self) -> dict:
        # Prompt tokens found in the prefix cache are never forwarded: they would have no rows.
        return {"enable_prefix_caching": False}

    def install(self, llm) -> None:
        if not llm.collective_rpc(vllm_routed_experts.install, args=(self.dtype,))[0]:
            raise ValueError("routed experts were asked of a model without mixture-of-experts layers")

    def start(self, llm) -> None:
        llm.collective_rpc(vllm_routed_experts.start)

    def stop(self, llm) -> None:
        llm.collective_rpc(vllm_routed_experts.take)

    def collect(self, llm, outputs, *, running: bool = False) -> list[list[torch.Tensor]]:
        """Per ``RequestOutput`` of ``outputs``, per completion: its ``[P + N - 1, layers, k]``.
        ``running``: other requests are still running (their rows stay, recording goes on)."""
        ids = [out.request_id for out in outputs] if running else None
        recorded: dict = {}
        for worker in llm.collective_rpc(vllm_routed_experts.take, args=(ids,)):
            recorded.update(worker)
        chunks = {vllm_routed_experts.request_key(req_id): c for req_id, c in recorded.items()}
        result = []
        for out in outputs:
            per = []
            for comp in out.outputs:
                length = len(out.prompt_token_ids) + len(comp.token_ids) - 1
                what = f"request {out.request_id} completion {comp.index}"
                if (out.request_id, comp.index) not in chunks:
                    raise RuntimeError(f"routed experts of {what} were not recorded")
                per.append(place_rows(chunks[out.request_id, comp.index], length, what))
            result.append(per)
        return result

    def take_chunks(self, llm, outputs: dict) -> dict[str, list[tuple[int, torch.Tensor]]]:
        """A request stream's requests named by ``outputs`` (our request id -> its finished
        ``RequestOutput``, or None for one still running): the rows recorded for each since the last
        call, ``[(first position, rows)]`` in step order (recording goes on for the others)."""
        recorded: dict = {}
        for worker in llm.collective_rpc(vllm_routed_experts.take, args=(list(outputs),)):
            recorded.update(worker)
        chunks: dict[str, list] = {rid: [] for rid in outputs}
        for req_id, got in recorded.items():
            chunks[vllm_routed_experts.request_key(req_id)[0]].extend(got)
        return chunks


class EngineRouting:
    """vLLM's own capture (``enable_return_routed_experts``, GPUs); not run here (no GPU)."""

    def __init__(self, num_experts: int):
        self.dtype = routed_experts_dtype(num_experts)
        self.moe_layers: list[int] = []

    def engine_args(self) -> dict:
        return {"enable_return_routed_experts": True}

    def install(self, llm) -> None:
        self.moe_layers = llm.collective_rpc(vllm_routed_experts.moe_layer_ids)[0]
        if not self.moe_layers:
            raise ValueError("routed experts were asked of a model without mixture-of-experts layers")

    def start(self, llm) -> None:
        pass

    def stop(self, llm) -> None:
        pass

    def collect(self, llm, outputs, *, running: bool = False) -> list[list[torch.Tensor]]:
        """As :meth:`HookedRouting.collect`; each finished request carries its own rows."""
        result = []
        for out in outputs:
            per = []
            for comp in out.outputs:
                length = len(out.prompt_token_ids) + len(comp.token_ids) - 1
                routed = comp.routed_experts  # numpy [tokens, decoder layers, k], the finished request's
                if routed is None or routed.shape[0] < length:
                    rows = None if routed is None else routed.shape[0]
                    raise RuntimeError(
                        f"vLLM returned {rows} routed-expert rows for request {out.request_id} completion "
                        f"{comp.index}, expected {length}"
                    )
                moe = routed[:length, self.moe_layers].astype("int32")
                per.append(torch.from_numpy(moe).to(self.dtype))
            result.append(per)
        return result

    def take_chunks(self, llm, outputs: dict) -> dict[str, list[tuple[int, torch.Tensor]]]:
        """As :meth:`HookedRouting.take_chunks`; vLLM hands rows only with a finished request, for every
        position of the engine's request (a continuation's prompt holds the tokens so far: the stream
        keeps their earlier rows, ``merge_rows``; a snapshot taken here has no rows), so a running
        request's positions get the rows of their last forward here. Not run here (no GPU)."""
        chunks: dict[str, list] = {}
        for rid, out in outputs.items():
            if out is None:
                chunks[rid] = []
                continue
            routed = out.outputs[0].routed_experts  # the stream checks the count (its outputs are deltas)
            if routed is None:
                raise RuntimeError(f"vLLM returned no routed experts for request {rid}")
            moe = routed[:, self.moe_layers].astype("int32")
            chunks[rid] = [(0, torch.from_numpy(moe).to(self.dtype))]
        return chunks


def routing_capture(num_experts: int, *, on_cpu: bool) -> HookedRouting | EngineRouting:
    """How an engine returns routed experts: vLLM's own capture, or on its CPU build megagrpo's hook."""
    return HookedRouting(num_experts) if on_cpu else EngineRouting(num_experts)


def engine_routing(cfg: Config, model_dir: str) -> HookedRouting | EngineRouting | None:
    """An engine's capture of routed experts: with grpo.routing_replay "rollout" (the model at
    ``model_dir`` has experts: the config checks it at load), on this machine's vLLM; else None."""
    if cfg.grpo.routing_replay != "rollout":
        return None
    from vllm.platforms import current_platform

    from megagrpo.models.registry import load_hf_config, shape_from_hf_config

    _, shape = shape_from_hf_config(load_hf_config(model_dir), f"{model_dir}/config.json")
    return routing_capture(shape.num_experts, on_cpu=current_platform.is_cpu())
