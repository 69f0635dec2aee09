"""Engram (SPEC §5.3): a hashed n-gram memory written into the residual stream before a few blocks.

The n-grams of sizes 2..``max_ngram_size`` ending at every position are hashed, per Engram layer and n-gram size,
into ``n_heads`` disjoint prime-sized bucket ranges of that layer's table; the rows found there are projected to a
key per stream copy and one value, and each copy takes the value through a gate that scores its key against it.

- ``compressed_token_map(tokenizer)``: token ids to normalised ids (" The", "the" and "THE" hash alike).
- ``EngramHash``: one per model: the table rows of every position, for every Engram layer at once.
- ``Engram``: one per Engram layer (``layers.N.engram.*``): its table (``EngramTable``) and the gated update.

The table's rows are split over the ranks of a process group; the lookup goes through an ``exchange``
(``LocalRows`` here, ``parallel.rows.RowExchange`` across processes), so this file holds no distributed code. Its
gradient is sparse (only the looked-up rows): a 384 M-row table cannot have a dense one.

Where SPEC §5.3 says "gate 0 where no n-gram exists", this follows the reference: look-back slots before a
document's first token hold the pad token's normalised id (the reference does so before the sequence start), so
every position has its n-grams and every text position is gated; ``token_mask`` alone closes the gate.
"""
import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Regex, normalizers
from torch import nn

from model.config import EngramArgs
from model.engram_layout import bucket_primes, layer_rows

_ONE_SPACE = "\ue000"  # private-use stand-in, so that a token of only whitespace survives Strip() as " "
_NORMALIZE = normalizers.Sequence([
    normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
    normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), _ONE_SPACE),
    normalizers.Strip(), normalizers.Replace(_ONE_SPACE, " ")])
_PROJECT_TOKENIZER = ("vocab_size", "token_text", "token")  # train/data/tokenizer.py's Tokenizer
_HF_TOKENIZER = ("get_vocab_size", "decode", "id_to_token")  # tokenizers.Tokenizer


def _token_forms(tokenizer):
    """(number of ids, one id's decoded text with special tokens included, one id's raw vocabulary form)."""
    if all(hasattr(tokenizer, name) for name in _PROJECT_TOKENIZER):
        return tokenizer.vocab_size, tokenizer.token_text, tokenizer.token
    if all(hasattr(tokenizer, name) for name in _HF_TOKENIZER):
        return (tokenizer.get_vocab_size(with_added_tokens=True),
                lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False), tokenizer.id_to_token)
    missing = [name for name in _PROJECT_TOKENIZER if not hasattr(tokenizer, name)]
    raise ValueError(f"the Engram token map needs every token's text: {type(tokenizer).__name__} lacks "
                     f"{', '.join(missing)}; give it vocab_size, token_text(id) (decoded text, special tokens "
                     f"included) and token(id) (raw vocabulary form), or pass a tokenizers.Tokenizer")


def compressed_token_map(tokenizer) -> tuple[list[int], int]:
    """Every token id's normalised id, and the number of normalised ids (every hash multiplier depends on it).

    A token's decoded text is normalised (NFKC, NFD, accents stripped, lowercase, whitespace runs to one space,
    stripped; a token of only whitespace stays one space); tokens that normalise alike share an id, numbered in
    order of first appearance. A token whose text holds U+FFFD (a partial UTF-8 byte) is keyed by its raw form, and
    one whose text normalises to nothing by its text, so that neither merges with unrelated tokens.

    ``tokenizer``: this project's tokenizers (``train/data/tokenizer.py``: ``vocab_size``, ``token_text(id)``,
    ``token(id)``) or a ``tokenizers.Tokenizer``; anything else is a ValueError naming what it lacks."""
    n_ids, text_of, raw_of = _token_forms(tokenizer)
    normalised: dict[str, int] = {}
    token_map = []
    for token_id in range(n_ids):
        text = text_of(token_id)
        key = raw_of(token_id) if "\ufffd" in text else (_NORMALIZE.normalize_str(text) or text)
        token_map.append(normalised.setdefault(key, len(normalised)))
    return token_map, len(normalised)


class EngramHash(nn.Module):
    """Maps each position to its table rows in every Engram layer: ``[B,T,n_layers,(max_ngram_size-1)*n_heads]``.

    Per Engram layer ``l`` (``args.layers`` order) and look-back ``s``, an odd multiplier ``m[l,s]`` (numpy's
    ``default_rng(10007 * layer_id)``, bounded so that ``id * m`` fits int64); the n-gram of size n ending at t
    hashes to ``XOR_{s<n} (c[t-s] * m[l,s])`` of the normalised ids ``c``, modulo its (n, head) bucket's prime, plus
    the bucket's first row (buckets laid out in order within the layer's table)."""

    def __init__(self, args: EngramArgs, token_map: list[int], map_size: int):
        super().__init__()
        if not 0 <= args.pad_id < len(token_map):
            raise ValueError(f"model.engram.pad_id={args.pad_id} is not a token id of the tokenizer (0.."
                             f"{len(token_map) - 1})")
        if max(token_map) >= map_size:
            raise ValueError(f"the token map holds id {max(token_map)} >= its size {map_size}: pass the size "
                             "compressed_token_map returned with it")
        n_layers, size, heads = len(args.layers), args.max_ngram_size, args.n_heads
        found = bucket_primes(args.vocab_size, n_layers * (size - 1) * heads)
        rows = layer_rows(args, found)
        primes = torch.tensor(found).view(n_layers, -1)
        self.layers, self.rows, self.pad = args.layers, dict(zip(args.layers, rows)), token_map[args.pad_id]
        bound = max(1, np.iinfo(np.int64).max // map_size // 2)
        multipliers = [np.random.default_rng(10007 * layer).integers(0, bound, size=size, dtype=np.int64) * 2 + 1
                       for layer in args.layers]
        self.register_buffer("token_map", torch.tensor(token_map), persistent=False)
        self.register_buffer("multipliers", torch.tensor(np.stack(multipliers)), persistent=False)  # [L, size]
        self.register_buffer("primes", primes.view(n_layers, size - 1, heads), persistent=False)
        self.register_buffer("offsets", primes.cumsum(1) - primes, persistent=False)  # [L, (size-1)*heads]

    def table_rows(self, layer: int) -> int:
        """Rows of Engram layer ``layer``'s table (by layer id): the sum of its buckets' primes."""
        return self.rows[layer]

    def forward(self, input_ids: torch.Tensor, doc_start: torch.Tensor) -> torch.Tensor:
        """input_ids, doc_start [B,T] (``doc_start``: the index of each token's document's first token, as
        ``TokenGeometry`` has it): look-back stops there, the slots before it holding the pad's normalised id, so
        no n-gram crosses a document."""
        T, size = input_ids.shape[1], self.multipliers.shape[1]
        back = torch.arange(T, device=input_ids.device)[:, None] - torch.arange(size, device=input_ids.device)
        tokens = self.token_map[input_ids][:, back.clamp_min(0)]  # [B,T,size]: token t - s
        tokens = tokens.masked_fill(back < doc_start.unsqueeze(-1), self.pad)
        products = tokens.unsqueeze(2) * self.multipliers  # [B,T,L,size]
        rolling, ids = products[..., 0], []
        for n in range(1, size):  # rolling is the hash of the (n+1)-gram
            rolling = rolling ^ products[..., n]
            ids.append(rolling.unsqueeze(-1) % self.primes[:, n - 1])
        return torch.cat(ids, dim=-1) + self.offsets


class LocalRows:
    """The exchange of a table that one process holds whole: an embedding lookup with a sparse gradient."""
    rank, world = 0, 1

    @staticmethod
    def lookup(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, weight, sparse=True)


class EngramTable(nn.Module):
    """An Engram layer's table, rows split into contiguous ranges of ``ceil(rows / world)`` over the ranks (the
    last range padded); ``weight`` is this rank's range, from row ``start``. ``forward(ids)`` returns the rows of
    ``ids`` (any rank's) through the exchange (``lookup(weight, ids)``; its ``rank``, ``world`` must be these),
    and the gradient of ``weight`` is sparse: this rank's looked-up rows, summed over every rank that read them."""

    def __init__(self, rows: int, dim: int, exchange=None, rank: int = 0, world: int = 1):
        super().__init__()
        self.exchange = exchange or LocalRows()
        if (self.exchange.rank, self.exchange.world) != (rank, world):
            raise ValueError(f"the Engram table of rank {rank} of {world} got an exchange of rank "
                             f"{self.exchange.rank} of {self.exchange.world}: build it on the same process group")
        self.rows, self.part_rows = rows, -(-rows // world)
        self.start = rank * self.part_rows
        self.weight = nn.Parameter(torch.empty(self.part_rows, dim))  # values: the checkpoint's or the model's init

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.exchange.lookup(self.weight, ids)


class Engram(nn.Module):
    """The Engram update of the stream ``x [B,T,hc,dim]`` before its block (SPEC §5.3), in fp32 (or x's wider
    dtype): the rows of a position, flattened, are projected (``wkv``) to one key per copy and one value, and
    copy c takes ``gate_c * value`` with ``gate_c = σ(sign(dot_c)·√max(|dot_c|, 1e-6))``, ``dot_c`` the scaled
    dot product of ``x_c`` and ``key_c``, each normalised over ``dim`` on its own (per copy, not over copies)."""

    def __init__(self, dim: int, hc: int, args: EngramArgs, rows: int, norm_eps: float, exchange=None,
                 rank: int = 0, world: int = 1):
        super().__init__()
        self.dim, self.hc, self.eps = dim, hc, norm_eps
        self.embed = EngramTable(rows, args.head_dim, exchange, rank, world)
        self.embed.weight.requires_grad_(args.train)
        self.wkv = nn.Linear((args.max_ngram_size - 1) * args.n_heads * args.head_dim, dim * (hc + 1), bias=False)
        self.q_weight = nn.Parameter(torch.ones(hc, dim))
        self.k_weight = nn.Parameter(torch.ones(hc, dim))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """ids [B,T,n_cols]: this layer's rows from ``EngramHash``; token_mask [B,T]: False keeps x unchanged."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        kv = self.wkv(self.embed(ids).flatten(-2)).to(dtype)
        key, value = kv.split([self.hc * self.dim, self.dim], dim=-1)
        key, h = key.unflatten(-1, (self.hc, self.dim)), x.to(dtype)
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * (self.q_weight * self.k_weight).to(dtype) * key).sum(-1) * rstd * self.dim ** -0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))  # [B,T,hc]
        if token_mask is not None:
            gate = gate.masked_fill(~token_mask.unsqueeze(-1), 0)
        return (h + gate.unsqueeze(-1) * value.unsqueeze(-2)).to(x.dtype)
