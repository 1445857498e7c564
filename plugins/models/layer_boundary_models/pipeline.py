"""Pipeline stages of the reference models: which layers a stage holds, and the handoff of the
residual stream from one stage to the next.

Stage s holds a contiguous run of layers and its ranks are `s * tp ... s * tp + tp - 1` (see
`Topology`), so under torchrun with one node per stage a handoff is the only traffic between
nodes. The sender exports its stream with `residual_batch.to_pp()` (a sum still declared at
the cut travels as the partial, and the receiver's TP group completes it: TP rank r of stage
s + 1 receives TP rank r's partial of stage s); the receiver's first stage rebuilds it with
`from_pp()`.

The transport is the pipeline group's all_gather (gloo and NCCL have it, and it needs no
point-to-point pairing): handoff s is one all_gather every stage joins in order, the sender
contributing (hidden, residual, owes_declared_sum) flattened and the others zeros; stage s + 1
keeps the sender's part. A stage joins the handoffs before its own compute, then its own, then
the later ones.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from layer_boundary import residual_batch

from .parts import output_head

__all__ = ["pipeline_layers", "PipelineHandoff", "place_stage", "place_head", "enter_stage", "leave_stage"]


def pipeline_layers(num_layers: int, pp: int, stage: int) -> range:
    """The layers of pipeline stage `stage`: stage s starts at ceil(n * s / pp)."""
    start = math.ceil(num_layers * stage / pp)
    end = math.ceil(num_layers * (stage + 1) / pp)
    return range(start, end)


class PipelineHandoff:
    """The handoffs of one rank's pipeline group (`parallel.groups["pp"]`)."""

    def __init__(self, parallel, hidden_size: int, dtype: torch.dtype):
        self.parallel = parallel
        self.hidden_size = hidden_size
        self.dtype = dtype

    def _handoff(self, index: int, rows: int, device, payload: Optional[torch.Tensor]) -> torch.Tensor:
        size = 2 * rows * self.hidden_size + 1
        mine = payload if payload is not None else torch.zeros(size, dtype=self.dtype, device=device)
        return self.parallel.groups["pp"].all_gather(mine.reshape(1, size))[index]

    def receive(self, rows: int, device) -> dict:
        """What the previous stage's `to_pp()` exported, for this stage's first `from_pp()`."""
        got = None
        for index in range(self.parallel.pp_rank):
            got = self._handoff(index, rows, device, None)
        pair = got[:-1].reshape(2, rows, self.hidden_size)
        return {"hidden_states": pair[0], "residual": pair[1], "owes_declared_sum": bool(got[-1] != 0)}

    def send(self, tensors: dict) -> None:
        """Hand `to_pp()`'s tensors to the next stage (and join the later stages' handoffs)."""
        if tensors["residual"] is None:
            raise RuntimeError("a reference model's pipeline handoff always carries a residual (every layer leaves a contribution)")
        hidden = tensors["hidden_states"]
        flag = hidden.new_full((1,), float(tensors["owes_declared_sum"]))
        payload = torch.cat((hidden.reshape(-1), tensors["residual"].reshape(-1).to(hidden.dtype), flag))
        stage, pp = self.parallel.pp_rank, self.parallel.topology.pp
        self._handoff(stage, hidden.shape[0], hidden.device, payload)
        for index in range(stage + 1, pp - 1):
            self._handoff(index, hidden.shape[0], hidden.device, None)


def place_stage(model: nn.Module, config, parallel, *, dtype=None, device=None) -> None:
    """What every pipeline stage of a reference decoder holds, on `model`: its config and
    parallel (the topology checked first), `layer_ids` (this stage's layers), `is_first` /
    `is_last`, the embedding on the first stage (None elsewhere) and the handoff between stages
    (None without pipeline stages)."""
    config.check_topology(parallel.topology)
    model.config, model.parallel = config, parallel
    pp, stage = parallel.topology.pp, parallel.pp_rank
    model.layer_ids = pipeline_layers(config.num_layers, pp, stage)
    model.is_first, model.is_last = stage == 0, stage == pp - 1
    model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device) if model.is_first else None
    model.handoff = PipelineHandoff(parallel, config.hidden_size, dtype or torch.get_default_dtype()) if pp > 1 else None


def place_head(model: nn.Module, make_norm, *, dtype=None, device=None) -> None:
    """The final norm (`make_norm()`) and the LM head on the last stage, None on the others (a
    tied head shares the embedding, or keeps its own copy on a stage without it)."""
    model.norm = model.lm_head = None
    if model.is_last:
        model.norm = make_norm()
        model.lm_head = output_head(model.config, model.embed_tokens, dtype=dtype, device=device)


def enter_stage(model, input_ids: torch.Tensor, forward, step) -> torch.Tensor:
    """The hidden states this pipeline stage starts from: the embedding on the first stage
    (`model.embed(ids)`, the residual stream started), else the previous stage's handoff into
    the first layer's attention boundary."""
    if model.is_first:
        residual_batch.start(forward)
        return model.embed(input_ids)
    tensors = model.handoff.receive(step.num_tokens, input_ids.device)
    return model.layers[0].attn_boundary.from_pp(tensors, forward)


def leave_stage(model, hidden_states, forward, final_norm, **norm_options) -> Optional[torch.Tensor]:
    """Leave this stage: hand the stream to the next stage (None), or on the last stage leave
    the stack through `final_norm` and return the LM head's logits."""
    if not model.is_last:
        model.handoff.send(residual_batch.to_pp(hidden_states, forward))
        return None
    return model.lm_head(residual_batch.norm(hidden_states, forward, final_norm, skip_empty=True, **norm_options))
