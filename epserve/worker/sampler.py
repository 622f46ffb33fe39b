"""Per-row token sampling and logprobs on the runner's device, from float logits.

Invariants: a row's draw depends only on (its ``RowSampling``, its output index, its logits),
never on the other rows or their order: its noise is a counter-based hash of
``mix_seed(seed, output_index)`` and the vocab id (``epserve.kernels.sampling_noise``), so the
CPU reference and the CUDA kernel draw the same token from the same logits. A row's
``logit_bias`` is added to its logits first (greedy and sampled alike), then its penalties
(``worker.penalties``) apply; a step with neither copies nothing. Greedy is argmax with ties to the lowest id. Banned ids are never picked
(greedy included). Random rows draw by Gumbel-max on ``logits / temperature`` restricted to the
top-k / top-p / min-p kept set (a prefix of the stable descending sort). Logprobs are of the raw
logits (before biases, banning, temperature and filters), as vLLM's default; ties in a top-k
list keep the lower id first. A logprobs-wanting row's (or a scored prompt position's) token
also gets its rank as vLLM's: the count of vocabulary tokens whose logprob is at least its own
(itself included, so 1 + the strictly more likely ones when nothing ties with it).

Device work: one batched launch for all rows (plus one sort over the rows with filters, and one
indexed add into a copy of the logits when a row has a bias); the per-row parameters travel in
two host tensors (pinned, non-blocking on CUDA); the only host
sync is the final read-back of tokens, logprobs and ranks (one flat float64 buffer).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from epserve.kernels.sampling_noise import apply_bans, gumbel_argmax
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
    """The 64-bit noise key for a row's ``output_index``-th draw (counter-based)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (output_index & _MASK64))


def _ship(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on ``device`` without a host sync (pinned, non-blocking on CUDA)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _as_int64(u: int) -> int:
    """The int64 with the bits of the uint64 ``u``."""
    return u - (1 << 64) if u >= 1 << 63 else u


def _is_filtered(r: RowSampling, v: int) -> bool:
    return 0 < r.top_k < v or r.top_p < 1.0 or r.min_p > 0.0


def _cutoffs(s: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, log_min_p: torch.Tensor,
             use_p: bool, use_min_p: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each row's kept set ends: top-k, then top-p, then min-p, on temperature-scaled,
    banned logits s: [F, V] f32 in stable descending order. Each filter keeps a prefix of that
    order (at least its first entry), so the kept set is the first L entries; returns the L-th
    entry's (value [F] f32, id [F] int64), the ``thr, tid`` of ``gumbel_argmax``.

    top_k: [F] int64 (V = off); top_p: [F] f32 (1 = off); log_min_p: [F] f32 (-inf = off);
    use_p / use_min_p: whether any row has that filter (decided on the host, no sync)."""
    v = s.shape[1]
    sorted_s, order = torch.sort(s, dim=-1, descending=True, stable=True)
    keep = top_k.clamp(1, v)
    if use_p:
        pos = torch.arange(v, device=s.device)
        probs = torch.softmax(sorted_s.masked_fill(pos >= keep.unsqueeze(1), float("-inf")), dim=-1)
        cum = torch.cumsum(probs, dim=-1, dtype=torch.float64)  # float64: CPU and CUDA agree
        mass_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)
        # Rows with top_p == 1 keep everything: rounding can leave the tail's mass_before at 1.0.
        n_p = torch.where(top_p < 1.0, (mass_before < top_p.unsqueeze(1)).sum(-1), v)
        keep = torch.minimum(keep, n_p.clamp(min=1))
    if use_min_p:
        # p_i / p_max is unchanged by renormalisation, so min-p can use the logit gap.
        n_m = (sorted_s - sorted_s[:, :1] >= log_min_p.unsqueeze(1)).sum(-1)
        keep = torch.minimum(keep, n_m.clamp(min=1))
    last = (keep - 1).unsqueeze(1)
    return sorted_s.gather(1, last).squeeze(1), order.gather(1, last).squeeze(1)


def _ranks(lp: torch.Tensor, tok_lp: torch.Tensor) -> torch.Tensor:
    """vLLM's rank of each row's token: lp [N, V], tok_lp [N] its logprob; [N] int64 counts of
    the entries >= it (a NaN logprob gives 0, read back as no rank)."""
    return (lp >= tok_lp.unsqueeze(1)).sum(-1)


def _rank_or_none(x: float) -> int | None:
    return int(x) or None


def _stable_topk(lp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of lp: [N, V] highest first, ties to the lower id (a stable sort; topk's tie order
    is unspecified). Returns (values, ids), each [N, k]."""
    vals, ids = torch.sort(lp, dim=-1, descending=True, stable=True)
    return vals[:, :k], ids[:, :k]


class PendingSample:
    """Sampled rows still on the device: ``tokens`` [R] int64 can feed the next forward before
    the host reads them; ``result()`` reads them back (the one host sync) as ``SampledToken``s.
    ``copy_async()`` starts that read-back early (pinned, non-blocking, with an event), so work
    queued after it on the stream does not delay ``result()``."""

    def __init__(self, tokens: torch.Tensor, flat: torch.Tensor, rows: Sequence[RowSampling],
                 want: list[int], kmax: int):
        self.tokens, self._flat, self._rows, self._want, self._kmax = tokens, flat, rows, want, kmax
        self._host: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None

    def copy_async(self) -> None:
        if self._flat.device.type != "cuda" or self._host is not None:
            return
        self._host = torch.empty(self._flat.shape, dtype=self._flat.dtype, pin_memory=True)
        self._host.copy_(self._flat, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def result(self) -> list[SampledToken]:
        if self._event is not None:  # copy_async ran: wait for that copy only
            self._event.synchronize()
            flat = self._host.tolist()
        else:
            flat = self._flat.tolist()  # the one host sync
        n, want, kmax = len(self._rows), self._want, self._kmax
        out = [SampledToken(token_id=int(t)) for t in flat[:n]]
        nw = len(want)
        for j, i in enumerate(want):  # layout: tokens, logprobs, ranks, top ids, top values
            k = min(self._rows[i].logprobs or 0, kmax)  # kmax: the largest k, capped at V
            ids0, vals0 = n + 2 * nw + j * kmax, n + 2 * nw + nw * kmax + j * kmax
            top = tuple(zip(map(int, flat[ids0:ids0 + k]), flat[vals0:vals0 + k]))
            out[i] = SampledToken(token_id=out[i].token_id, logprob=flat[n + j], top=top,
                                  rank=_rank_or_none(flat[n + nw + j]))
        return out


def sample_rows(logits: torch.Tensor, rows: Sequence[RowSampling],
                output_indices: Sequence[int]) -> list[SampledToken]:
    """One sampled token per row (``launch_sample`` then its ``result``)."""
    return launch_sample(logits, rows, output_indices).result()


def launch_sample(logits: torch.Tensor, rows: Sequence[RowSampling],
                  output_indices: Sequence[int], penalties: Any = None) -> PendingSample:
    """One sampled token per row, left on the device.

    logits: [R, V] float32 (other float dtypes are upcast); rows: R ``RowSampling``;
    output_indices: R ints, each row's count of tokens sampled before this one (the noise
    counter); penalties: the penalized rows' ``worker.penalties.PenaltyTable`` or None. Scaled
    logits are ``float32(logit) * float32(1 / temperature)``; rows with
    top-k / top-p / min-p are sorted once (together) to find where their kept set ends; then
    every row, greedy ones included, is drawn by one ``gumbel_argmax`` over the batch. A batch of
    plain greedy rows (no bans, bias, penalties or logprobs) takes ``argmax`` alone, the same
    token (the first maximum).
    """
    n = logits.shape[0]
    if len(rows) != n or len(output_indices) != n:
        raise ValueError(f"sample_rows: {n} logit rows, {len(rows)} RowSampling, "
                         f"{len(output_indices)} output indices")
    if n == 0:
        return PendingSample(torch.empty(0, dtype=torch.int64), torch.empty(0), rows, [], 0)
    v, dev = logits.shape[1], logits.device
    greedy = [r.temperature <= GREEDY_TEMPERATURE_EPS for r in rows]
    bans = [[t for t in r.banned_token_ids if 0 <= t < v] for r in rows]
    nb = max(len(b) for b in bans)
    filt = [i for i, r in enumerate(rows) if not greedy[i] and _is_filtered(r, v)]
    want = [i for i, r in enumerate(rows) if r.logprobs is not None]
    biased = [(i, t, b) for i, r in enumerate(rows) for t, b in r.logit_bias if 0 <= t < v]
    nf, nw, nbias = len(filt), len(want), len(biased)
    if all(greedy) and not (nb or nw or nbias) and penalties is None:
        # plain greedy rows: the draw below is the first maximum of each row, which is what
        # argmax returns; one reduction instead of ~8 launches (shipping the rows' settings,
        # the fills, the draw, the casts): the decode step's tail at batch 1
        tokens = torch.argmax(logits, dim=1)
        return PendingSample(tokens, tokens, rows, [], 0)
    ints = [0 if g else _as_int64(mix_seed(r.seed, o))
            for r, o, g in zip(rows, output_indices, greedy)]
    ints += [0 if g else 1 for g in greedy]
    ints += [t for b in bans for t in b + [-1] * (nb - len(b))]
    ints += filt + [rows[i].top_k if 0 < rows[i].top_k < v else v for i in filt] + want
    ints += [i for i, _, _ in biased] + [t for _, t, _ in biased]
    floats = [1.0 if g else 1.0 / r.temperature for r, g in zip(rows, greedy)]
    floats += [rows[i].top_p for i in filt]
    floats += [math.log(rows[i].min_p) if rows[i].min_p > 0 else -math.inf for i in filt]
    floats += [b for _, _, b in biased]
    it, ft = _ship(ints, torch.int64, dev), _ship(floats, torch.float32, dev)
    keys, noisy = it[:n], it[n:2 * n]
    banned = it[2 * n:2 * n + n * nb].view(n, nb)
    f_idx, f_k, w_idx, b_row, b_tok = it[2 * n + n * nb:].split([nf, nf, nw, nbias, nbias])
    inv_t, f_p, f_logmin, b_val = ft.split([n, nf, nf, nbias])
    x = logits  # what the rows sample from; the logprobs below read the raw logits
    if biased:  # each (row, token) once: a plain indexed add
        x = logits.to(torch.float32, copy=True)
        x[b_row, b_tok] += b_val
    if penalties is not None:
        x = _apply_penalties(logits if x is logits else x, penalties, x is logits)

    thr = torch.full((n,), float("-inf"), device=dev)
    tid = torch.full((n,), v, dtype=torch.int64, device=dev)
    if filt:
        s = x.index_select(0, f_idx).float() * inv_t.index_select(0, f_idx).unsqueeze(1)
        apply_bans(s, banned.index_select(0, f_idx))
        f_thr, f_tid = _cutoffs(s, f_k, f_p, f_logmin, any(rows[i].top_p < 1.0 for i in filt),
                                any(rows[i].min_p > 0.0 for i in filt))
        thr.index_copy_(0, f_idx, f_thr)
        tid.index_copy_(0, f_idx, f_tid)
    tokens = gumbel_argmax(x, keys, inv_t, noisy, thr, tid, banned)

    parts = [tokens.to(torch.float64)]
    kmax = min(max((rows[i].logprobs or 0 for i in want), default=0), v)
    if want:  # raw logprobs of the chosen tokens, their ranks and the top-k (one log_softmax)
        lp = torch.log_softmax(logits.index_select(0, w_idx).float(), dim=-1)
        tok_lp = lp.gather(1, tokens.index_select(0, w_idx).unsqueeze(1)).squeeze(1)
        parts += [tok_lp.double(), _ranks(lp, tok_lp).double()]
        if kmax:
            top_v, top_i = _stable_topk(lp, kmax)
            parts += [top_i.flatten().double(), top_v.flatten().double()]
    return PendingSample(tokens, torch.cat(parts), rows, want, kmax)


def _apply_penalties(x: torch.Tensor, t: Any, copy: bool) -> torch.Tensor:
    """vLLM's order: repetition (divide positive logits, multiply negative ones, at each
    row's prompt and output tokens), then the additive frequency and presence terms."""
    if copy:
        x = x.to(torch.float32, copy=True)
    dev = x.device
    if t.rep_rows:
        rows = _ship(t.rep_rows, torch.int64, dev)
        toks = _ship(t.rep_toks, torch.int64, dev)
        pen = _ship(t.rep_vals, torch.float32, dev)
        sel = x[rows, toks]
        x[rows, toks] = torch.where(sel > 0, sel / pen, sel * pen)
    if t.add_rows:
        x.index_put_((_ship(t.add_rows, torch.int64, dev), _ship(t.add_toks, torch.int64, dev)),
                     _ship(t.add_vals, torch.float32, dev), accumulate=True)
    return x


def prompt_logprobs_rows(logits: torch.Tensor, targets: Sequence[int],
                         k: int) -> list[PromptTokenLogprob]:
    """Score prompt positions: row p of logits: [P, V] float32 predicts ``targets[p]``.

    Returns P ``PromptTokenLogprob`` with the target's raw logprob (-inf for an id outside the
    vocab, like ``logprob_of``), its rank (vLLM's; None outside the vocab) and the top ``k``
    alternatives, highest first."""
    p, v = logits.shape
    if len(targets) != p:
        raise ValueError(f"prompt_logprobs_rows: {p} logit rows, {len(targets)} targets")
    if p == 0:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    tgt = _ship([t if 0 <= t < v else 0 for t in targets], torch.int64, lp.device)
    tok_lp = lp.gather(1, tgt.unsqueeze(1)).squeeze(1)
    parts = [tok_lp.double(), _ranks(lp, tok_lp).double()]
    kk = min(k, v) if k > 0 else 0
    if kk:
        top_v, top_i = _stable_topk(lp, kk)
        parts += [top_i.flatten().double(), top_v.flatten().double()]
    flat = torch.cat(parts).tolist()  # the one host sync
    out = []
    for j, t in enumerate(targets):  # layout: logprobs, ranks, top ids, top values
        inside = 0 <= t < v
        i0, v0 = 2 * p + j * kk, 2 * p + p * kk + j * kk
        top = tuple(zip(map(int, flat[i0:i0 + kk]), flat[v0:v0 + kk]))
        out.append(PromptTokenLogprob(token_id=int(t), logprob=flat[j] if inside else -math.inf,
                                      top=top, rank=_rank_or_none(flat[p + j]) if inside
                                      else None))
    return out
