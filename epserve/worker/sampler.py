"""Per-row token sampling and logprobs on the runner's device, from float32 logits.

Invariants: a row's draw depends only on (its ``RowSampling``, its output index, its logits),
never on the other rows or their order: each random row gets its own generator seeded with
``mix_seed(seed, output_index)``. Greedy is argmax with ties to the lowest id. Banned ids are
never picked (greedy included). Logprobs are of the raw logits (before banning, temperature
and filters), as vLLM's default; ties in a top-k list keep the lower id first.
"""

from __future__ import annotations

from typing import Sequence

import torch

from epserve.models.traits import PromptTokenLogprob, RowSampling, SampledToken

_MASK64 = (1 << 64) - 1

#: Rows at or below this temperature are greedy (same threshold as the head's SamplingParams).
GREEDY_TEMPERATURE_EPS = 1e-5


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(seed: int, output_index: int) -> int:
    """The 64-bit generator seed for a row's ``output_index``-th draw (counter-based)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (output_index & _MASK64))


def _ban(x: torch.Tensor, banned: Sequence[Sequence[int]]) -> None:
    """Set ``x[i, banned[i]]`` to -inf in place (one scatter for all rows): x: [N, V] f32."""
    v = x.shape[1]
    rows = [i for i, ids in enumerate(banned) for t in ids if 0 <= t < v]
    cols = [t for ids in banned for t in ids if 0 <= t < v]
    if rows:
        idx_r = torch.tensor(rows, device=x.device, dtype=torch.long)
        idx_c = torch.tensor(cols, device=x.device, dtype=torch.long)
        x[idx_r, idx_c] = float("-inf")


def _filter_sorted(sorted_x: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """Apply top-k, then top-p, then min-p to temperature-scaled logits sorted descending
    (sorted_x: [N, V] f32); returns them with removed entries at -inf. Position 0 (the max)
    always survives, so every row keeps at least one token."""
    n, v = sorted_x.shape
    dev = sorted_x.device
    pos = torch.arange(v, device=dev).unsqueeze(0)
    ks = torch.tensor([r.top_k if r.top_k > 0 else v for r in rows], device=dev).unsqueeze(1)
    x = sorted_x.masked_fill(pos >= ks, float("-inf"))
    top_p = torch.tensor([r.top_p for r in rows], device=dev, dtype=torch.float32).unsqueeze(1)
    if bool((top_p < 1.0).any()):
        probs = torch.softmax(x, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        # Rows with top_p == 1 skip this: rounding can push the tail's mass_before to 1.0.
        drop = (mass_before >= top_p) & (top_p < 1.0)
        drop[:, 0] = False
        x = x.masked_fill(drop, float("-inf"))
    min_p = torch.tensor([r.min_p for r in rows], device=dev, dtype=torch.float32).unsqueeze(1)
    if bool((min_p > 0.0).any()):
        # p_i / p_max is unchanged by renormalisation, so min-p can use the logit gap.
        gap = x - x[:, :1]
        drop = gap < torch.log(min_p)
        drop[:, 0] = False
        x = x.masked_fill(drop, float("-inf"))
    return x


def _draw(x: torch.Tensor, rows: Sequence[RowSampling], output_indices: Sequence[int]) -> torch.Tensor:
    """Sample one id per row of filtered, scaled logits x: [N, V] f32 -> [N] long.

    Exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) picks i with probability p_i. The
    E_i come from the row's own counter-seeded generator, one [V] vector per row."""
    probs = torch.softmax(x, dim=-1)
    noise = torch.empty_like(probs)
    for j, (r, idx) in enumerate(zip(rows, output_indices)):
        g = torch.Generator(device=x.device)
        g.manual_seed(mix_seed(r.seed, idx))
        noise[j].exponential_(generator=g)
    # An exact 0 from the generator would turn p/0 into inf (or NaN for p == 0).
    noise.clamp_(min=torch.finfo(torch.float32).tiny)
    return torch.argmax(probs / noise, dim=-1)


def _stable_topk(lp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of lp: [N, V] highest first, ties to the lower id (a stable sort; topk's tie order
    is unspecified). Returns (values, ids), each [N, k]."""
    vals, ids = torch.sort(lp, dim=-1, descending=True, stable=True)
    return vals[:, :k], ids[:, :k]


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: Sequence[RowSampling],
              want: list[int]) -> dict[int, tuple[float, tuple[tuple[int, float], ...]]]:
    """Raw logprobs of the chosen tokens and top-k, for the rows in ``want`` (one log_softmax)."""
    if not want:
        return {}
    w = torch.tensor(want, device=logits.device, dtype=torch.long)
    lp = torch.log_softmax(logits.index_select(0, w), dim=-1)
    chosen = lp.gather(1, tokens.index_select(0, w).unsqueeze(1)).squeeze(1).tolist()
    kmax = max(rows[i].logprobs or 0 for i in want)
    top_v, top_i = _stable_topk(lp, kmax) if kmax else (None, None)
    top_v = top_v.tolist() if top_v is not None else None
    top_i = top_i.tolist() if top_i is not None else None
    out = {}
    for j, i in enumerate(want):
        k = rows[i].logprobs or 0
        top = tuple(zip(top_i[j][:k], top_v[j][:k])) if k else ()
        out[i] = (chosen[j], top)
    return out


def sample_rows(logits: torch.Tensor, rows: Sequence[RowSampling],
                output_indices: Sequence[int]) -> list[SampledToken]:
    """One sampled token per row.

    logits: [R, V] float32 (other float dtypes are upcast); rows: R ``RowSampling``;
    output_indices: R ints, each row's count of tokens sampled before this one (the
    generator's counter). Greedy rows are one batched argmax; random rows are filtered in one
    batch and drawn with one generator per row.
    """
    n = logits.shape[0]
    if len(rows) != n or len(output_indices) != n:
        raise ValueError(f"sample_rows: {n} logit rows, {len(rows)} RowSampling, "
                         f"{len(output_indices)} output indices")
    logits = logits.float()
    tokens = torch.empty(n, dtype=torch.long, device=logits.device)
    greedy = [i for i, r in enumerate(rows) if r.temperature <= GREEDY_TEMPERATURE_EPS]
    rand = [i for i, r in enumerate(rows) if r.temperature > GREEDY_TEMPERATURE_EPS]
    for group, is_greedy in ((greedy, True), (rand, False)):
        if not group:
            continue
        g_idx = torch.tensor(group, device=logits.device, dtype=torch.long)
        x = logits.index_select(0, g_idx)  # a copy: banning below must not touch the raw logits
        g_rows = [rows[i] for i in group]
        _ban(x, [r.banned_token_ids for r in g_rows])
        if is_greedy:
            tokens[g_idx] = torch.argmax(x, dim=-1)
            continue
        temps = torch.tensor([r.temperature for r in g_rows], device=x.device, dtype=torch.float32)
        sorted_x, order = torch.sort(x / temps.unsqueeze(1), dim=-1, descending=True, stable=True)
        filtered = torch.full_like(x, float("-inf")).scatter_(1, order, _filter_sorted(sorted_x, g_rows))
        tokens[g_idx] = _draw(filtered, g_rows, [output_indices[i] for i in group])
    lps = _logprobs(logits, tokens, rows, [i for i, r in enumerate(rows) if r.logprobs is not None])
    out = []
    for i, t in enumerate(tokens.tolist()):
        lp, top = lps.get(i, (0.0, ()))
        out.append(SampledToken(token_id=t, logprob=lp, top=top))
    return out


def prompt_logprobs_rows(logits: torch.Tensor, targets: Sequence[int], k: int) -> list[PromptTokenLogprob]:
    """Score prompt positions: row p of logits: [P, V] float32 predicts ``targets[p]``.

    Returns P ``PromptTokenLogprob`` with the target's raw logprob (-inf for an id outside the
    vocab, like ``logprob_of``) and the top ``k`` alternatives, highest first."""
    p, v = logits.shape
    if len(targets) != p:
        raise ValueError(f"prompt_logprobs_rows: {p} logit rows, {len(targets)} targets")
    if p == 0:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    tgt = torch.tensor([t if 0 <= t < v else 0 for t in targets], device=lp.device, dtype=torch.long)
    chosen = lp.gather(1, tgt.unsqueeze(1)).squeeze(1).tolist()
    top_v, top_i = _stable_topk(lp, k) if k > 0 else (None, None)
    top_v = top_v.tolist() if top_v is not None else None
    top_i = top_i.tolist() if top_i is not None else None
    out = []
    for j, t in enumerate(targets):
        lpj = chosen[j] if 0 <= t < v else float("-inf")
        top = tuple(zip(top_i[j], top_v[j])) if k > 0 else ()
        out.append(PromptTokenLogprob(token_id=int(t), logprob=lpj, top=top))
    return out
