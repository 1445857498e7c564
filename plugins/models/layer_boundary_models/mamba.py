"""A Mamba-2 mixer in plain torch, its heads split over the attention-TP group.

Each rank keeps whole SSM heads and whole B/C groups (`n_groups` must be divisible by attention
TP), so the convolution, the scan and the grouped gated RMSNorm run without communication; only
`out_proj` is row-parallel, and its sum obeys the exit's flags like any `RowParallelLinear`.

The arithmetic follows Hugging Face's PyTorch path for Nemotron-H step by step, including where
it drops to float32 (the chunked scan, the decay factors, the gated norm) and the shapes it
computes with (one request at a time), so a float64 run reproduces HF's float32 intermediates bit
for bit and the logits agree to ~1e-15. That rests on the CPU kernels giving each head the same
bits whatever the number of heads beside it, which holds for the shapes tested (the preset keeps
two 16-channel norm groups per rank up to attention TP 4); with a single small group per rank the
float32 norm statistic can round differently, and float64 agreement drops to ~1e-7.

Two Hugging Face details are kept on purpose: the chunked (prefill) form clamps dt below at
`time_step_min` while the recurrent (decode) step does not, and a first chunk shorter than the
convolution is left-padded with zeros to the kernel width before convolving.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from layer_boundary import RowParallelLinear

__all__ = ["MambaStates", "TPMamba2Mixer", "chunked_scan", "recurrent_step", "segment_sum"]


class MambaStates:
    """Per layer and request: the convolution window and the SSM state (float32, as HF keeps it)."""

    def __init__(self):
        self.conv: dict[tuple, torch.Tensor] = {}
        self.ssm: dict[tuple, torch.Tensor] = {}

    def clear(self) -> None:
        self.conv.clear()
        self.ssm.clear()


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T]: out[..., i, j] = x[j+1] + ... + x[i] below the diagonal, 0 on it,
    -inf above (so exp() of it is the causal decay matrix)."""
    size = x.size(-1)
    grid = x[..., None].expand(*x.size(), size)
    strictly_lower = torch.ones(size, size, dtype=torch.bool, device=x.device).tril(-1)
    grid = grid.masked_fill(~strictly_lower, 0)
    sums = torch.cumsum(grid, dim=-2)
    lower = torch.ones(size, size, dtype=torch.bool, device=x.device).tril(0)
    return sums.masked_fill(~lower, -torch.inf)


def _pad_time(x: torch.Tensor, pad: int) -> torch.Tensor:
    """Zero-pad dim 1 (time) of a [b, t, h] or [b, t, h, p] tensor at the end."""
    spec = (0, 0, 0, 0, 0, pad, 0, 0) if x.dim() == 4 else (0, 0, 0, pad, 0, 0)
    return F.pad(x, spec, mode="constant", value=0)


def _chunks(x: torch.Tensor, pad: int, chunk: int) -> torch.Tensor:
    x = _pad_time(x, pad)
    return x.reshape(x.shape[0], -1, chunk, *x.shape[2:])


def chunked_scan(x, dt, A, B, C, *, chunk: int, D, dt_bias, dt_min: float, initial: Optional[torch.Tensor] = None):
    """The state-space-dual chunked scan of one sequence batch.

    x [b, t, h, p], dt [b, t, h], A [h] (float32), B/C [b, t, g, n], D/dt_bias [h]; `initial`
    [b, h, p, n] or None. Returns (y [b, t, h, p], final state [b, h, p, n] float32).
    """
    b, t, h, p = x.shape
    g = B.shape[2]
    dt = F.softplus(dt + dt_bias.to(dt.dtype))
    dt = torch.clamp(dt, min=dt_min, max=float("inf"))
    x = x.float()
    B = B.float().repeat_interleave(h // g, dim=2, output_size=h)
    C = C.float().repeat_interleave(h // g, dim=2, output_size=h)
    pad = (chunk - t % chunk) % chunk
    skip = D[..., None] * _pad_time(x, pad)

    x = x * dt[..., None].float()
    A = A.to(x.dtype) * dt.float()
    x, A, B, C = (_chunks(v, pad, chunk) for v in (x, A, B, C))
    A = A.permute(0, 3, 1, 2)  # [b, h, chunks, l]
    A_cum = torch.cumsum(A, dim=-1)

    # within a chunk: causal "attention" weights C.B scaled by the decay between positions
    decay = torch.exp(segment_sum(A))
    scores = torch.einsum("bclhn,bcshn->bclsh", C, B)
    weighted = scores * decay.permute(0, 2, 3, 4, 1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", weighted, x)

    # each chunk's own end state, then the recurrence across chunks
    to_end = torch.exp(A_cum[:, :, :, -1:] - A_cum)
    B_to_end = B * to_end.permute(0, -2, -1, 1)[..., None]
    states = torch.einsum("bclhn,bclhp->bchpn", B_to_end, x)
    first = initial[:, None].to(dtype=states.dtype, device=states.device) if initial is not None else torch.zeros_like(states[:, :1])
    states = torch.cat([first, states], dim=1)
    across = torch.exp(segment_sum(F.pad(A_cum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    carried = torch.einsum("bzch,bzhpn->bchpn", across, states)
    states, final = carried[:, :-1], carried[:, -1]

    # what each chunk's start state contributes to its positions
    from_start = torch.exp(A_cum)
    y_off = torch.einsum("bclhn,bchpn->bclhp", C, states) * from_start.permute(0, 2, 3, 1)[..., None]

    y = (y_diag + y_off).contiguous().reshape(b, -1, h, p)
    y = y + skip
    if pad > 0:
        y = y[:, :t]
    return y, final


def recurrent_step(state, x, dt, A, B, C, D, dt_bias):
    """One decode token: updates `state` [b, h, p, n] in place and returns y [b, h, p].

    x [b, h, p]; dt/dt_bias/D [b|., h, p] (per-head values expanded over p); A [h, p, n];
    B/C [b, g, n].
    """
    b, h, p = x.shape
    g, n = B.shape[1], B.shape[-1]
    dt = F.softplus(dt + dt_bias.to(dt.dtype))[..., None]
    dA = torch.exp(dt.float() * A.float()).to(device=state.device)
    B = B.reshape(b, g, 1, n).expand(b, g, h // g, n).contiguous().reshape(b, h, 1, n)
    dBx = (dt * B * x[..., None]).to(device=state.device)
    new_state = state * dA + dBx
    state.copy_(new_state.to(state.dtype))
    C = C.reshape(b, g, 1, n).expand(b, g, h // g, n).contiguous().reshape(b, h, n)
    new_state = new_state.to(device=C.device, dtype=C.dtype)
    y = torch.bmm(new_state.view(b * h, p, n), C.view(b * h, n, 1)).view(b, h, p)
    y = (y + x * D).to(y.dtype)
    return y.to(x.dtype)


class GatedGroupRMSNorm(nn.Module):
    """RMSNorm of `x * silu(gate)` over groups of `group_size` channels (float32 statistics)."""

    def __init__(self, channels: int, group_size: int, eps: float, *, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels, dtype=dtype, device=device))
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32) * F.silu(gate.to(torch.float32))
        *lead, width = x.shape
        grouped = x.view(*lead, width // self.group_size, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.view(*lead, width).to(dtype)


class TPMamba2Mixer(nn.Module):
    """Mamba-2 with this rank's heads `[r*h/tp, (r+1)*h/tp)` and their B/C groups.

    The local `in_proj` keeps Hugging Face's row order (gate | x | B | C | dt), each part cut to
    this rank's heads or groups, so one projection feeds the same split as the unsharded layer.
    """

    def __init__(self, config, layer: int, group, *, dtype=None, device=None):
        super().__init__()
        tp, rank = group.size, group.rank
        self.layer = layer
        self.rank = rank
        self.full_heads = config.mamba_num_heads
        self.heads = config.mamba_num_heads // tp
        self.head_dim = config.mamba_head_dim
        self.full_groups = config.n_groups
        self.groups = config.n_groups // tp
        self.state_size = config.ssm_state_size
        self.kernel = config.conv_kernel
        self.chunk = config.chunk_size
        self.dt_min = config.time_step_min
        self.width = self.heads * self.head_dim  # local intermediate channels
        self.bc_width = self.groups * self.state_size  # local B (or C) channels
        self.conv_dim = self.width + 2 * self.bc_width
        H = config.hidden_size
        proj = 2 * self.width + 2 * self.bc_width + self.heads
        self.in_proj = nn.Parameter(torch.empty(proj, H, dtype=dtype, device=device))
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, 1, self.kernel, dtype=dtype, device=device))
        self.conv_bias = nn.Parameter(torch.empty(self.conv_dim, dtype=dtype, device=device)) if config.use_conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(self.heads, dtype=dtype, device=device))
        self.A_log = nn.Parameter(torch.empty(self.heads, dtype=dtype, device=device))
        self.D = nn.Parameter(torch.empty(self.heads, dtype=dtype, device=device))
        group_size = config.mamba_num_heads * config.mamba_head_dim // config.n_groups
        self.norm = GatedGroupRMSNorm(self.width, group_size, config.layer_norm_epsilon, dtype=dtype, device=device)
        self.out_proj = RowParallelLinear(
            config.mamba_num_heads * config.mamba_head_dim, H, group, reduce_results=True, dtype=dtype, device=device
        )

    @torch.no_grad()
    def load_full(self, *, in_proj, conv_weight, conv_bias, dt_bias, A_log, D, norm, out_proj) -> None:
        """Take this rank's part of the unsharded Hugging Face tensors."""
        I, GN = self.full_heads * self.head_dim, self.full_groups * self.state_size
        x_part = slice(self.rank * self.width, (self.rank + 1) * self.width)
        bc_part = slice(self.rank * self.bc_width, (self.rank + 1) * self.bc_width)
        heads = slice(self.rank * self.heads, (self.rank + 1) * self.heads)

        def channels(t):  # x | B | C of the convolution's channels
            x, B, C = t.split([I, GN, GN])
            return torch.cat((x[x_part], B[bc_part], C[bc_part]))

        gate, xBC, dt = in_proj.split([I, I + 2 * GN, self.full_heads])
        self.in_proj.copy_(torch.cat((gate[x_part], channels(xBC), dt[heads])))
        self.conv_weight.copy_(channels(conv_weight))
        if self.conv_bias is not None:
            self.conv_bias.copy_(channels(conv_bias))
        self.dt_bias.copy_(dt_bias[heads])
        self.A_log.copy_(A_log[heads])
        self.D.copy_(D[heads])
        self.norm.weight.copy_(norm[x_part])
        self.out_proj.load_full(out_proj)

    # compute ---------------------------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, step, states: Optional[MambaStates]) -> torch.Tensor:
        """hidden [tokens, H] of the requests in `step`; returns out_proj's output [tokens, H]."""
        dtype = hidden.dtype
        projected = F.linear(hidden, self.in_proj)
        A = -torch.exp(self.A_log.float())
        scanned = hidden.new_empty(hidden.shape[0], self.width)
        for rid, start, count in zip(step.rids, step.starts, step.counts):
            zxbcdt = projected[start : start + count][None]
            scanned[start : start + count] = self._sequence(zxbcdt, A, rid, states)[0]
        return self.out_proj(scanned.to(dtype))

    def _sequence(self, zxbcdt: torch.Tensor, A: torch.Tensor, rid, states: Optional[MambaStates]) -> torch.Tensor:
        """One request's tokens [1, t, proj] -> gated, normed scan output [1, t, width]."""
        t = zxbcdt.shape[1]
        key = (self.layer, rid)
        conv_state = states.conv.get(key) if states is not None else None
        ssm_state = states.ssm.get(key) if states is not None else None
        gate, xBC, dt = zxbcdt.split([self.width, self.conv_dim, self.heads], dim=-1)
        xBC = xBC.transpose(1, 2)  # [1, channels, t]
        if conv_state is not None and t == 1:
            xBC = self._conv_step(xBC, conv_state)
        else:
            xBC = self._conv_sequence(xBC, conv_state, key, states)
        x, B, C = torch.split(xBC.transpose(1, 2), [self.width, self.bc_width, self.bc_width], dim=-1)
        if ssm_state is not None and t == 1:
            y = self._recurrent(x, dt, A, B, C, ssm_state)
        else:
            y, final = chunked_scan(
                x.view(1, t, self.heads, self.head_dim),
                dt,
                A,
                B.view(1, t, self.groups, self.state_size),
                C.view(1, t, self.groups, self.state_size),
                chunk=self.chunk,
                D=self.D,
                dt_bias=self.dt_bias,
                dt_min=self.dt_min,
                initial=ssm_state,
            )
            if states is not None:
                if ssm_state is None:
                    states.ssm[key] = final.clone()
                else:
                    ssm_state.copy_(final)
            y = y.reshape(1, t, -1)
        return self.norm(y, gate)

    def _conv_sequence(self, xBC, conv_state, key, states):
        """Causal depthwise convolution of a whole sequence, recording the last `kernel` inputs.

        With a cache, a first chunk shorter than the kernel is left-padded to the kernel width, and
        a later chunk is convolved after the stored window (as Hugging Face's cache does)."""
        t = xBC.shape[-1]
        full = xBC
        if states is not None:
            if conv_state is None:
                if t < self.kernel:
                    full = F.pad(xBC, (self.kernel - t, 0), value=0)
                states.conv[key] = full[..., -self.kernel :].clone()
            else:
                full = torch.cat([conv_state, xBC], dim=-1)
                conv_state.copy_(full[..., -self.kernel :])
        out = F.conv1d(full.to(self.conv_weight.dtype), self.conv_weight, self.conv_bias, padding=self.kernel - 1, groups=self.conv_dim)
        out = F.silu(out[:, :, : full.shape[-1]]).to(xBC.dtype)
        return out[:, :, -t:]

    def _conv_step(self, xBC, conv_state):
        """One token through the stored window; the window slides by one."""
        window = torch.cat([conv_state, xBC], dim=-1).to(self.conv_weight.dtype)
        conv_state.copy_(window[:, :, -conv_state.shape[-1] :])
        out = F.conv1d(window, self.conv_weight, self.conv_bias, padding=0, groups=self.conv_dim)
        return F.silu(out[:, :, -1:]).to(xBC.dtype)

    def _recurrent(self, x, dt, A, B, C, ssm_state):
        p, n = self.head_dim, self.state_size
        y = recurrent_step(
            ssm_state,
            x.view(1, self.heads, p),
            dt.transpose(1, 2).expand(-1, -1, p),
            A[:, None, None].expand(-1, p, n),
            B.view(1, self.groups, n),
            C.view(1, self.groups, n),
            self.D[:, None].expand(-1, p),
            self.dt_bias[:, None].expand(-1, p),
        )
        return y.view(1, 1, -1)
