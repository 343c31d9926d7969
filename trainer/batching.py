"""Episodes -> padded tensors, and the trainer-side token logprobs of the sampled tokens.

The G episodes of a group start with the same prompt. `token_logprobs` can run each distinct prompt
through the model once and let its G continuations attend to that one copy (prefix sharing): the prompt
is usually most of an episode's tokens, so the training forward and backward shrink by about that share,
with the same logprobs and gradients as the full forward.

Rows of a micro-batch differ in length, and padding each to the longest runs the decoder on positions that
hold nothing. `pack` lays them end to end instead, in rows as wide as the longest (`pack_layout`), with a 4D
attention mask that lets each row see only itself and positions counted from its own start: the same
attention, the same logprobs and gradients, no padding but each packed row's tail. With `share_prefix` a
packed unit is one copy of a prompt followed by as many of its continuations as fit, each attending to that
copy and to itself, which needs no KV cache and so shares prompts under gradient checkpointing too (where the
cache path cannot run). Either way the decoder's final hidden states go to the LM head only at the positions
that train, a chunk at a time (`trainer.logprobs`): full (batch, length, vocabulary) logits never exist.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from trainer.logprobs import LogitsFn, chunk_tokens, head_logprobs
from trainer.rollout.episodes import Episode


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, L) right-padded
    attention_mask: torch.Tensor  # (B, L)
    loss_mask: torch.Tensor  # (B, L-1): 1 where target token t+1 is the model's own
    sampler_logprobs: torch.Tensor  # (B, L-1)
    prompt_lens: torch.Tensor  # (B,) tokens of the row's prompt
    prompts: torch.Tensor  # (B,) rows with the same value share their first prompt_lens tokens

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: list[int]) -> Batch:
        """A micro-batch, trimmed to its own longest row."""
        width = int(self.attention_mask[idx].sum(dim=1).max())
        return Batch(self.input_ids[idx, :width], self.attention_mask[idx, :width], self.loss_mask[idx, : width - 1],
                     self.sampler_logprobs[idx, : width - 1], self.prompt_lens[idx], self.prompts[idx])


def collate(episodes: list[Episode], pad_id: int) -> Batch:
    width = max(len(ep.token_ids) for ep in episodes)
    n = len(episodes)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width - 1))
    sampler = torch.zeros((n, width - 1))
    prompt_ids: dict[tuple[int, ...], int] = {}
    prompts = []
    for i, ep in enumerate(episodes):
        k = len(ep.token_ids)
        input_ids[i, :k] = torch.tensor(ep.token_ids)
        attention[i, :k] = 1
        loss_mask[i, : k - 1] = torch.tensor(ep.mask[1:], dtype=torch.float)
        sampler[i, : k - 1] = torch.tensor(ep.sampler_logprobs[1:])
        # Keyed by the tokens themselves: two rounds of sampling may reuse group numbers.
        prompts.append(prompt_ids.setdefault(tuple(ep.token_ids[: ep.prompt_len]), len(prompt_ids)))
    return Batch(input_ids, attention, loss_mask, sampler, torch.tensor([ep.prompt_len for ep in episodes]),
                 torch.tensor(prompts))


def token_logprobs(model: torch.nn.Module, batch: Batch, temperature: float = 1.0, *, entropy: bool = False,
                   share_prefix: bool = False, pack: bool = False, chunk_size: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (B, L-1) of the tokens the model trains on (`loss_mask`) under `model` at the sampling
    temperature and, if asked, the entropy (B, L-1) of those distributions (no gradient); zeros elsewhere:
    prompts, observations and padding never reach the head. The head runs `chunk_size` tokens at a time
    (`trainer.logprobs`; default: about 128 MB of float32 logits a chunk). `share_prefix` computes each
    distinct prompt once; `pack` lays rows end to end instead of padding them (see the module docstring)."""
    lm = _causal_lm(model)
    rows, cols = batch.loss_mask.nonzero(as_tuple=True)
    if pack and packable(lm, int(batch.attention_mask.sum(dim=1).max())):
        hidden = _packed_hidden(lm, batch, rows, cols, share_prefix)
    elif share_prefix and len(batch.prompts.unique()) < len(batch) and _keeps_cache(lm):
        hidden = _shared_prefix_hidden(lm, batch, rows, cols)
    else:
        hidden = _full_hidden(lm, batch, rows, cols)
    device = hidden.device
    targets = batch.input_ids[rows, cols + 1].to(device)
    head = lm.get_output_embeddings()
    size = chunk_size or chunk_tokens(head.weight.shape[0])
    logp, ent = head_logprobs(hidden, targets, _logits_fn(lm, temperature), chunk_size=size, entropy=entropy)
    index = (rows.to(device), cols.to(device))
    zeros = torch.zeros(batch.loss_mask.shape, device=device)
    return zeros.index_put(index, logp), (zeros.index_put(index, ent) if ent is not None else None)


def _causal_lm(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers model under a PEFT wrapper (LoRA layers are injected into it in place)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _keeps_cache(lm: PreTrainedModel) -> bool:
    # Under gradient checkpointing a training-mode layer drops past_key_values (a replay in the backward would
    # write the cache twice), so the prompt's KV cache would never be built: no sharing then.
    return not (lm.training and lm.is_activation_checkpointing)


# Config fields with which a CausalLM's forward rescales its logits in ways the head below does not.
_UNSUPPORTED_LOGIT_TRANSFORMS = ("logits_scaling", "lm_head_multiplier", "output_multiplier")


def _logits_fn(lm: PreTrainedModel, temperature: float) -> LogitsFn:
    """Hidden states (N, H) -> the float32 logits the sampler drew from, as the model's own forward makes them
    (Gemma's soft-capping, Cohere's logit_scale), divided by the temperature."""
    config = lm.config.get_text_config()
    for name in _UNSUPPORTED_LOGIT_TRANSFORMS:
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise ValueError(f"{type(lm).__name__}: config.{name} rescales the logits; the trainer's head "
                             "does not support it")
    head = lm.get_output_embeddings()
    scale = getattr(config, "logit_scale", None)
    cap = getattr(config, "final_logit_softcapping", None)

    def logits(h: torch.Tensor) -> torch.Tensor:
        x = head(h).float()
        if scale is not None:
            x = x * scale
        if cap:
            x = torch.tanh(x / cap) * cap
        # In place: one chunk-sized tensor fewer; nothing before needs x for its backward (tanh keeps its output).
        return x.div_(temperature) if temperature != 1.0 else x

    return logits


def _full_hidden(lm: PreTrainedModel, batch: Batch, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Final hidden states (N, H) at the (rows, cols) positions, each row run in full."""
    device = lm.device
    out = lm.get_decoder()(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                           use_cache=False)
    return out.last_hidden_state[rows.to(device), cols.to(device)]


def _shared_prefix_hidden(lm: PreTrainedModel, batch: Batch, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Distinct prompts, left-padded, in one forward with a KV cache; the cache is then indexed out to
    every row and the rows' continuations attend to it. Autograd flows through the cache into the prompt.
    Final hidden states (N, H) at the (rows, cols) positions, which lie at or after each row's last prompt token."""
    device = lm.device
    decoder = lm.get_decoder()
    pad = 0  # any id: padding is masked out
    _, row_prompt = torch.unique(batch.prompts, return_inverse=True)  # row -> distinct prompt
    n_prompts = int(row_prompt.max()) + 1
    first = torch.zeros(n_prompts, dtype=torch.long).scatter_(0, row_prompt, torch.arange(len(batch)))
    plen = batch.prompt_lens
    lp = int(plen.max())
    pre_ids = torch.full((n_prompts, lp), pad, dtype=torch.long)
    pre_mask = torch.zeros((n_prompts, lp), dtype=torch.long)
    for u, i in enumerate(first.tolist()):
        p = int(plen[i])
        pre_ids[u, lp - p:] = batch.input_ids[i, :p]
        pre_mask[u, lp - p:] = 1
    out = decoder(input_ids=pre_ids.to(device), attention_mask=pre_mask.to(device),
                  position_ids=(pre_mask.cumsum(-1) - 1).clamp(min=0).to(device), use_cache=True)
    cache = out.past_key_values
    cache.batch_select_indices(row_prompt.to(device))

    lens = batch.attention_mask.sum(dim=1)
    slen = lens - plen
    ls = max(int(slen.max()), 1)
    suf_ids = torch.full((len(batch), ls), pad, dtype=torch.long)
    suf_mask = torch.zeros((len(batch), ls), dtype=torch.long)
    for i in range(len(batch)):
        p, s = int(plen[i]), int(slen[i])
        suf_ids[i, :s] = batch.input_ids[i, p:p + s]
        suf_mask[i, :s] = 1
    out2 = decoder(input_ids=suf_ids.to(device), attention_mask=torch.cat([pre_mask[row_prompt], suf_mask], 1).to(device),
                   position_ids=(plen[:, None] + torch.arange(ls)).to(device), past_key_values=cache, use_cache=True)
    # The prompt's last position predicts the first continuation token; continuation position j predicts j+1.
    # So row i's target column c reads the prompt's last hidden state at c = plen - 1, else continuation c - plen.
    k = cols - (plen[rows] - 1)
    if bool((k < 0).any()):
        raise ValueError("a loss_mask position lies inside its row's prompt; prompts never train")
    hidden = torch.cat([out.last_hidden_state[:, -1:][row_prompt.to(device)], out2.last_hidden_state[:, :-1]], dim=1)
    return hidden[rows.to(device), k.to(device)]


def packable(lm: PreTrainedModel, width: int) -> bool:
    """Whether `lm` takes the packed layout's own 4D attention mask as it is: sdpa or eager attention (flash
    attention reads no 4D mask), and no sliding window shorter than the longest row `width` (a given 4D mask
    replaces the model's own, sliding layers' included, and a row no longer than the window never meets it)."""
    config = lm.config.get_text_config()
    window = getattr(config, "sliding_window", None)
    return config._attn_implementation in ("sdpa", "eager") and (window is None or width <= window)


def pack_layout(batch: Batch, share_prefix: bool, width: int | None = None
                ) -> tuple[list[list[tuple[int, list[int]]]], int]:
    """Units laid end to end in packed rows (bins) `width` tokens wide (default: the longest row): a unit is one
    prompt and the continuations that follow it. With `share_prefix` a unit holds as many rows of one prompt as
    fit in the width, else one row. First fit, by decreasing length. Returns the bins, each a list of (the row
    whose prompt the unit starts with, the unit's rows), and the width."""
    lens = batch.attention_mask.sum(dim=1).tolist()
    plen = batch.prompt_lens.tolist()
    width = max(width or 0, *lens)
    units: list[list] = []  # [prompt row, rows, tokens]
    if share_prefix:
        open_unit: dict[int, list] = {}  # prompt -> its unit being filled
        for i, prompt in enumerate(batch.prompts.tolist()):
            u = open_unit.get(prompt)
            if u is not None and u[2] + lens[i] - plen[i] <= width:
                u[1].append(i)
                u[2] += lens[i] - plen[i]
            else:
                open_unit[prompt] = [i, [i], lens[i]]
                units.append(open_unit[prompt])
    else:
        units = [[i, [i], lens[i]] for i in range(len(batch))]
    bins: list[list[tuple[int, list[int]]]] = []
    room: list[int] = []
    for first, members, size in sorted(units, key=lambda u: -u[2]):
        b = next((k for k, r in enumerate(room) if r >= size), None)
        if b is None:
            bins.append([])
            room.append(width)
            b = len(bins) - 1
        bins[b].append((first, members))
        room[b] -= size
    return bins, width


def pack_costs(lm: PreTrainedModel) -> tuple[int, int]:
    """Multiply-adds of the decoder a position (2 x its parameters, embeddings left out) and a query-key pair
    of attention (4 x the attention width x the layers): what `pack_width` weighs."""
    config = lm.config.get_text_config()
    heads = config.num_attention_heads
    attention_width = (getattr(config, "head_dim", None) or config.hidden_size // heads) * heads
    per_position = 2 * sum(p.numel() for n, p in lm.get_decoder().named_parameters() if "embed" not in n)
    return per_position, 4 * attention_width * config.num_hidden_layers


# Packed rows grow no wider than this for sharing's sake (a row longer than it is packed at its own length): the
# mask is (rows, width, width), 16 MB a packed row here as booleans and 32 MB as sdpa's bf16 bias on a GPU.
PACK_MAX_WIDTH = 4096


def pack_width(batch: Batch, share_prefix: bool, costs: tuple[int, int]) -> int:
    """The packed rows' width. Without sharing, the longest row: wider rows would hold no fewer positions. With
    sharing, wider rows let a prompt serve more of its continuations (fewer positions through every layer) at the
    price of attention over the wider rows (sdpa runs every query against the whole packed row, masked or not).
    Each width from the longest row, doubling, up to the longest group's whole unit (at most `PACK_MAX_WIDTH`)
    is costed (`pack_costs`: per position, per query-key pair) and the cheapest wins."""
    return _cheapest_layout(batch, share_prefix, costs)[1]


def _cheapest_layout(batch: Batch, share_prefix: bool, costs: tuple[int, int]
                     ) -> tuple[list[list[tuple[int, list[int]]]], int]:
    """`pack_layout` at `pack_width`'s width: the bins and the width."""
    if not share_prefix:
        return pack_layout(batch, False)
    lens = batch.attention_mask.sum(dim=1)
    longest = int(lens.max())
    cont = lens - batch.prompt_lens
    whole = max(int(batch.prompt_lens[batch.prompts == p][0]) + int(cont[batch.prompts == p].sum())
                for p in batch.prompts.unique().tolist())
    per_position, per_pair = costs
    best, best_cost, width = None, None, longest
    while True:
        bins, w = pack_layout(batch, True, width)
        cost = len(bins) * w * (per_position + w * per_pair)
        if best_cost is None or cost < best_cost:
            best, best_cost = (bins, w), cost
        if width >= min(whole, PACK_MAX_WIDTH):
            return best
        width = min(2 * width, whole, max(PACK_MAX_WIDTH, longest))


def _packed_hidden(lm: PreTrainedModel, batch: Batch, rows: torch.Tensor, cols: torch.Tensor,
                   share_prefix: bool) -> torch.Tensor:
    """Rows laid end to end (`pack_layout` at `pack_width`), each continuation attending causally to itself and
    to its unit's prompt only, positions counted from its own prompt's start: the same attention as the padded
    forward, with no padding but the bins' tails. Final hidden states (N, H) at the (rows, cols) positions."""
    device = lm.device
    bins, width = _cheapest_layout(batch, share_prefix, pack_costs(lm))
    lens = batch.attention_mask.sum(dim=1).tolist()
    plen = batch.prompt_lens.tolist()
    ids = torch.zeros((len(bins), width), dtype=torch.long)
    pos = torch.zeros((len(bins), width), dtype=torch.long)
    # Which unit and which part of it (0: the prompt, k: the unit's k-th row) each position holds; the bins'
    # tails are units of one token each, attending to themselves only (a query that sees nothing is NaN in sdpa).
    unit = -torch.arange(1, len(bins) * width + 1).view(len(bins), width)
    part = torch.zeros((len(bins), width), dtype=torch.long)
    # Where row i's position c lies: its prompt's copy for c < prompt length, else its continuation.
    prompt_at = torch.zeros(len(batch), dtype=torch.long)  # flat index of the row's unit's prompt start
    cont_at = torch.zeros(len(batch), dtype=torch.long)  # flat index of the row's continuation start
    n_units = 0
    for b, units in enumerate(bins):
        at = 0
        for first, members in units:
            p = plen[first]
            ids[b, at:at + p] = batch.input_ids[first, :p]
            pos[b, at:at + p] = torch.arange(p)
            unit[b, at:at + p + sum(lens[i] - plen[i] for i in members)] = n_units
            start = at
            at += p
            for k, i in enumerate(members, 1):
                s = lens[i] - plen[i]
                ids[b, at:at + s] = batch.input_ids[i, p:p + s]
                pos[b, at:at + s] = torch.arange(p, p + s)
                part[b, at:at + s] = k
                prompt_at[i], cont_at[i] = b * width + start, b * width + at
                at += s
            n_units += 1
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = ((unit[:, :, None] == unit[:, None, :]) & causal
               & ((part[:, None, :] == 0) | (part[:, :, None] == part[:, None, :])))[:, None]
    if lm.config.get_text_config()._attn_implementation == "eager":  # an additive mask
        dtype = next(lm.parameters()).dtype
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min).to(device)
    else:
        mask = allowed.to(device)
    out = lm.get_decoder()(input_ids=ids.to(device), attention_mask=mask, position_ids=pos.to(device),
                           use_cache=False)
    p_rows = batch.prompt_lens[rows]
    flat = torch.where(cols < p_rows, prompt_at[rows] + cols, cont_at[rows] + cols - p_rows)
    return out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])[flat.to(device)]
