"""The gated delta rule: token-by-token reference and the chunked (WY / UT-transform) form.

Shapes: q, k [B, T, H, Dk] (already L2-normalised), v [B, T, H, Dv], log_decay and beta [B, T, H],
state [B, H, Dk, Dv]. Per token, in order:

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,   a_t = exp(log_decay_t)
    o_t = S_t^T q_t / sqrt(Dk)

The chunked form groups whole blocks into chunks of at most `chunk_size` tokens. Inside a chunk the
delta-rule corrections are one unit-lower-triangular solve, so the cost is a Python loop over chunks,
not tokens. It also returns, for an optional second set of queries (the noisy stream of block
diffusion), the read-out of the state *before* each query's block: S_{start(b)-1}^T q / sqrt(Dk).
Everything runs in fp32 whatever the input dtype: the decays compound over thousands of tokens.

`two_stream_gated_delta_rule` is what the memory layer calls. On CUDA with flash-linear-attention it
runs both streams through fla's fused kernel in one causal pass (`interleaved_two_stream`: noisy
blocks placed before their clean blocks with beta = 0 and log-decay = 0); elsewhere, the chunked
form above. The interleaved formulation is checked on CPU against the chunked form with
`reference_kernel` standing in for fla.
"""

from __future__ import annotations

import functools

import torch


def recurrent_gated_delta_rule(q, k, v, log_decay, beta, initial_state=None):
    """Reference: one token at a time. Returns (o [B,T,H,Dv], final_state [B,H,Dk,Dv])."""
    out_dtype = v.dtype
    q, k, v, log_decay, beta = (x.float() for x in (q, k, v, log_decay, beta))
    batch, length, heads, dk = k.shape
    state = (
        torch.zeros(batch, heads, dk, v.shape[-1], device=v.device)
        if initial_state is None
        else initial_state.float()
    )
    scale = dk**-0.5
    outputs = []
    for t in range(length):
        state = state * log_decay[:, t].exp()[..., None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = beta[:, t, :, None] * (v[:, t] - predicted)
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]) * scale)
    return torch.stack(outputs, dim=1).to(out_dtype), state


def chunk_layout(block_sizes: list[int], chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack consecutive whole blocks into chunks of at most `chunk_size` tokens.

    Returns (index [N, C]: token position per slot, -1 for padding; block_of_slot [N, C]: the
    block number of each slot, padding slots numbered past every real block).
    """
    if any(s < 1 or s > chunk_size for s in block_sizes):
        raise ValueError(f"block sizes must be in 1..{chunk_size}, got {sorted(set(block_sizes))}")
    chunks: list[list[tuple[int, int]]] = [[]]
    filled = 0
    position = 0
    for block, size in enumerate(block_sizes):
        if filled + size > chunk_size:
            chunks.append([])
            filled = 0
        chunks[-1].extend((position + i, block) for i in range(size))
        filled += size
        position += size
    pad_block = len(block_sizes)
    index = torch.full((len(chunks), chunk_size), -1, dtype=torch.long)
    block_of_slot = torch.full((len(chunks), chunk_size), pad_block, dtype=torch.long)
    for c, slots in enumerate(chunks):
        index[c, : len(slots)] = torch.tensor([p for p, _ in slots])
        block_of_slot[c, : len(slots)] = torch.tensor([b for _, b in slots])
    return index, block_of_slot


def chunk_gated_delta_rule(
    q,
    k,
    v,
    log_decay,
    beta,
    *,
    block_sizes: list[int] | None = None,
    chunk_size: int = 64,
    initial_state=None,
    q_noisy=None,
):
    """Chunked gated delta rule over a sequence cut into blocks.

    block_sizes: the partition of the T tokens (default: blocks of `chunk_size`, the last shorter).
    Returns (o, final_state, o_noisy, chunk_states) where o is the ordinary causal output,
    o_noisy (None unless q_noisy is given) reads the state before each token's block, and
    chunk_states [B, N+1, H, Dk, Dv] holds the state at every chunk boundary.
    """
    out_dtype = v.dtype
    batch, length, heads, dk = k.shape
    dv = v.shape[-1]
    if block_sizes is None:
        block_sizes = [chunk_size] * (length // chunk_size) + ([length % chunk_size] if length % chunk_size else [])
    if sum(block_sizes) != length:
        raise ValueError(f"block sizes sum to {sum(block_sizes)}, but the sequence has {length} tokens")
    index, block_of_slot = chunk_layout(block_sizes, chunk_size)
    index, block_of_slot = index.to(k.device), block_of_slot.to(k.device)
    n_chunks, size = index.shape

    def to_chunks(x):
        # [B, T, H, ...] -> [B, H, N, C, ...] with zero rows in padding slots: a zero key, beta and
        # log-decay leave the state untouched, so padding is invisible.
        x = x.float()
        x = torch.cat([x, x.new_zeros(x[:, :1].shape)], dim=1)
        x = x[:, torch.where(index >= 0, index, length)]
        return x.movedim(3, 1)

    qc, kc, vc = to_chunks(q), to_chunks(k), to_chunks(v)
    gc = to_chunks(log_decay).cumsum(-1)  # [B, H, N, C] log of the decay product up to each slot
    bc = to_chunks(beta)
    scale = dk**-0.5

    causal = torch.ones(size, size, dtype=torch.bool, device=k.device).tril()
    strict = causal.tril(-1)
    # exp(g_i - g_j) for j <= i; masked before exp so that large decays cannot overflow.
    decay_diff = (gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, float("-inf")).exp()

    # Delta-rule corrections inside a chunk: (I + L) u = beta v, (I + L) w = beta k exp(g).
    kk = kc @ kc.transpose(-1, -2)
    lower = (bc[..., None] * kk * decay_diff).masked_fill(~strict, 0.0)
    eye = torch.eye(size, device=k.device)
    system = eye + lower
    u = torch.linalg.solve_triangular(system, bc[..., None] * vc, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, bc[..., None] * kc * gc.exp()[..., None], upper=False, unitriangular=True
    )
    qk = (qc @ kc.transpose(-1, -2)) * decay_diff

    if q_noisy is not None:
        qn = to_chunks(q_noisy)
        # A noisy query reads the state at its block's start: sources are slots of earlier blocks
        # in the chunk, decayed up to that start.
        earlier = block_of_slot[:, None, :] < block_of_slot[:, :, None]  # [N, C(query), C(source)]
        first_slot = (block_of_slot[:, :, None] == block_of_slot[:, None, :]).float().argmax(-1)  # [N, C]
        g_exclusive = gc - to_chunks(log_decay)
        g_start = torch.gather(g_exclusive, -1, first_slot.expand_as(g_exclusive))
        noisy_decay = (g_start[..., :, None] - gc[..., None, :]).masked_fill(~earlier, float("-inf")).exp()
        qk_noisy = (qn @ kc.transpose(-1, -2)) * noisy_decay

    state = (
        torch.zeros(batch, heads, dk, dv, device=v.device) if initial_state is None else initial_state.float()
    )
    # Everything that does not depend on the state is computed for all chunks at once, and the loop takes
    # each chunk's slice from one unbind: a slice taken inside the loop would, in the backward, fill a
    # zero tensor of all chunks for every chunk (quadratic in the chunks; most of a CPU step's time).
    g_last = gc[..., -1:]
    u_c, w_c, qk_c = u.unbind(2), w.unbind(2), qk.unbind(2)
    q_decayed = (qc * gc.exp()[..., None]).unbind(2)  # q_i exp(g_i): reads the state at the chunk's start
    k_decayed = (kc * (g_last - gc).exp()[..., None]).transpose(-1, -2).unbind(2)  # k_i decayed to the end
    chunk_decay = g_last.exp()[..., None].unbind(2)  # [B, H, 1, 1] per chunk
    if q_noisy is not None:
        qn_decayed = (qn * g_start.exp()[..., None]).unbind(2)
        qk_noisy_c = qk_noisy.unbind(2)
    outputs, noisy_outputs, states = [], [], [state]
    for c in range(n_chunks):
        new_values = u_c[c] - w_c[c] @ state  # delta_i = u_i - w_i S0
        outputs.append(q_decayed[c] @ state + qk_c[c] @ new_values)
        if q_noisy is not None:
            noisy_outputs.append(qn_decayed[c] @ state + qk_noisy_c[c] @ new_values)
        state = state * chunk_decay[c] + k_decayed[c] @ new_values
        states.append(state)

    def from_chunks(chunked):
        # [B, H, N, C, Dv] -> [B, T, H, Dv], dropping padding slots.
        flat = torch.stack(chunked, dim=2).reshape(batch, heads, n_chunks * size, dv)
        valid = (index >= 0).reshape(-1)
        order = index.reshape(-1)[valid]
        out = flat.new_empty(batch, heads, length, dv)
        out[:, :, order] = flat[:, :, valid]
        return (out * scale).transpose(1, 2).to(out_dtype)

    o = from_chunks(outputs)
    o_noisy = from_chunks(noisy_outputs) if q_noisy is not None else None
    return o, state, o_noisy, torch.stack(states, dim=1)


def gated_delta_readout(q, state):
    """Read memory without writing it: S^T q / sqrt(Dk) for every token of a block being denoised."""
    dk = q.shape[-1]
    return (torch.einsum("bhkv,bthk->bthv", state.float(), q.float()) * dk**-0.5).to(q.dtype)


# ----------------------------------------------------------------------------------------------
# Both streams in one causal pass (docs/design.md section 3), and the dispatch to a fused kernel.


def interleave_order(block_sizes: list[int], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, inverse): order lists the rows of [noisy ; clean] (2L rows) as [x_t^1, x_0^1, x_t^2, ...];
    inverse puts them back."""
    return _interleave_order(tuple(block_sizes), str(device or "cpu"))


@functools.lru_cache(maxsize=16)
def _interleave_order(block_sizes: tuple[int, ...], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    # Every memory layer of a forward asks for the same partition: build it (and copy it to the
    # device) once.
    length = sum(block_sizes)
    order, start = [], 0
    for size in block_sizes:
        order += list(range(start, start + size)) + list(range(length + start, length + start + size))
        start += size
    order = torch.tensor(order, dtype=torch.long, device=device)
    return order, torch.argsort(order)


def reference_kernel(q, k, v, log_decay, beta, initial_state=None):
    """The pure-PyTorch chunked rule in a fused kernel's shape: one causal pass, (o, final_state)."""
    o, state, _, _ = chunk_gated_delta_rule(q, k, v, log_decay, beta, chunk_size=64, initial_state=initial_state)
    return o, state


def interleaved_two_stream(q, k, v, log_decay, beta, q_noisy, block_sizes: list[int], kernel, initial_state=None):
    """The two streams of every block through one causal kernel call over 2L tokens.

    Noisy block b is placed right before clean block b, with beta = 0 and log-decay = 0: the state
    passes it unchanged, so its queries read S_{b-1}, and the clean tokens after it see exactly the
    clean history. Returns (o_clean, final_state, o_noisy) as `chunk_gated_delta_rule` does.
    kernel(q, k, v, log_decay, beta, initial_state) -> (o, final_state) is any exact causal gated delta
    rule: fla's on CUDA, `reference_kernel` to check the formulation on CPU.
    """
    length = q.shape[1]
    order, inverse = interleave_order(block_sizes, q.device)

    def weave(noisy, clean):
        return torch.cat([noisy, clean.to(noisy.dtype)], dim=1)[:, order]

    # Zero keys and values at noisy positions as well: with beta = 0 they are never written, and zeros
    # keep the kernel's intermediate products finite whatever the noisy projections hold.
    o, state = kernel(
        weave(q_noisy.to(q.dtype), q),
        weave(torch.zeros_like(k), k),
        weave(torch.zeros_like(v), v),
        weave(torch.zeros_like(log_decay), log_decay),
        weave(torch.zeros_like(beta), beta),
        initial_state,
    )
    o = o[:, inverse]
    return o[:, length:], state, o[:, :length]


def two_stream_gated_delta_rule(
    q, k, v, log_decay, beta, *, block_sizes: list[int], chunk_size: int, q_noisy=None, initial_state=None
):
    """The memory layer's call: (o_clean, final_state, o_noisy or None).

    With CUDA tensors and flash-linear-attention installed, one fused kernel call (both streams
    interleaved); otherwise the pure-PyTorch chunked rule, which stays the reference.
    """
    from cloverlm.ops.fla_backend import kernel_for

    kernel = kernel_for(q)
    if kernel is None:
        o, state, o_noisy, _ = chunk_gated_delta_rule(
            q, k, v, log_decay, beta, block_sizes=block_sizes, chunk_size=chunk_size,
            initial_state=initial_state, q_noisy=q_noisy,
        )
        return o, state, o_noisy
    if q_noisy is None:
        o, state = kernel(q, k, v, log_decay, beta, initial_state)
        return o, state, None
    return interleaved_two_stream(q, k, v, log_decay, beta, q_noisy, block_sizes, kernel, initial_state)
