"""Engram (model/engram.py) against references written here from SPEC §5.3 and the reference engram.py's formulas:
the token map against a Python (unicodedata) normaliser, the hash ids against plain-int n-gram hashes (those of
``tests/support/oracle.py``, which the whole-model oracle uses too), the update against a per-token, per-copy fp64 loop.
Each test names the planted bug it was seen to catch."""
import math
import re
import unicodedata

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from model.config import ModelArgs, EngramArgs
from model.engram import Engram, EngramHash, EngramTable, compressed_token_map
from train.data.tokenizer import ByteTokenizer, HFTokenizer

from tests.support.oracle import (engram_hash_ids,
                                  engram_primes)  # noqa: E402  (the plain-int hash, shared with the model oracle)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# --- the token map -----------------------------------------------------------------------------------------------


def reference_key(text: str, raw: str) -> str:
    """NFKC, NFD, drop nonspacing marks, lowercase, whitespace runs -> " ", strip unless exactly " "; an empty
    result keys by the text, a U+FFFD text by the raw form."""
    if "\ufffd" in text:
        return raw
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = re.sub(r"[ \t\r\n]+", " ", "".join(c for c in s if unicodedata.category(c) != "Mn").lower())
    return (s if s == " " else s.strip()) or text


def reference_map(texts: list[str], raws: list[str]) -> tuple[list[int], int]:
    ids: dict[str, int] = {}
    return [ids.setdefault(reference_key(t, r), len(ids)) for t, r in zip(texts, raws)], len(ids)


EXTRA = ["ĠThe", "the", "THE", "ĠĠ", "ĊĊ", "ĉĠ", "Ã©", "ĠÃ©cole", "Ecole", "ï¬ģ", "fi"]  # byte-level spellings


def byte_level_tokenizer() -> Tokenizer:
    """A byte-level BPE vocabulary: the 256 bytes (0xC3 alone is a partial UTF-8 byte), words, specials."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for token in EXTRA:
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|pad|>"])
    return tok


def test_token_map_of_a_tokenizers_tokenizer():
    """Planted: no one-space sentinel (" " and "\\n" keyed apart), U+FFFD tokens keyed by their text (0xC3 and 0xC4
    merge), no lowercase (" The" and "THE" apart): each fails."""
    tok = byte_level_tokenizer()
    token_map, size = compressed_token_map(tok)
    n = tok.get_vocab_size(with_added_tokens=True)
    texts = [tok.decode([i], skip_special_tokens=False) for i in range(n)]
    assert (token_map, size) == reference_map(texts, [tok.id_to_token(i) for i in range(n)])
    of = {t: token_map[tok.token_to_id(t)] for t in ["ĠThe", "the", "THE", "Ġ", "Ċ", "ĉ", "ĠĠ", "ĊĊ", "ĉĠ", "Ã",
                                                     "Ä", "Ã©", "e", "ĠÃ©cole", "Ecole", "ï¬ģ", "fi", "<|pad|>"]}
    assert of["ĠThe"] == of["the"] == of["THE"]  # " The", "the", "THE"
    assert of["Ġ"] == of["Ċ"] == of["ĉ"] == of["ĠĠ"] == of["ĊĊ"] == of["ĉĠ"]  # whitespace-only: one space
    assert of["Ã"] != of["Ä"] and len({of["Ã"], of["Ä"], of["Ġ"], of["e"]}) == 4  # partial bytes by raw form
    assert of["Ã©"] == of["e"] and of["ĠÃ©cole"] == of["Ecole"]  # "é" -> "e", " école" -> "ecole"
    assert of["ï¬ģ"] == of["fi"] and of["<|pad|>"] not in (of["Ġ"], of["the"])  # "ﬁ" -> "fi" (NFKC)


def test_token_map_of_the_project_tokenizers(tmp_path):
    """The byte tokenizer: 26 case pairs and the 4 whitespace bytes collapse, the 128 high bytes stay apart by raw
    form, the 3 specials by name: 259 ids, 230 normalised. The HF wrapper gives its tokenizer's map. Planted: the
    specials keyed by their (empty) decoded text: they merge, and the count is 228."""
    byte = ByteTokenizer()
    token_map, size = compressed_token_map(byte)
    assert len(token_map) == 259 and size == 128 - 26 - 3 + 128 + 3 == 230
    assert token_map[ord("A")] == token_map[ord("a")] and token_map[ord("A")] != token_map[ord("b")]
    assert token_map[ord(" ")] == token_map[ord("\n")] == token_map[ord("\t")] == token_map[ord("\r")]
    assert len({token_map[i] for i in range(128, 256)}) == 128
    assert len({token_map[i] for i in (256, 257, 258)}) == 3
    tok = byte_level_tokenizer()
    tok.save(str(tmp_path / "tokenizer.json"))
    assert compressed_token_map(HFTokenizer(str(tmp_path / "tokenizer.json"))) == compressed_token_map(tok)


def test_token_map_needs_token_texts():
    class Encoder:
        vocab_size = 10

        def decode(self, ids):
            return ""

    with pytest.raises(ValueError, match="lacks token_text, token;"):
        compressed_token_map(Encoder())


# --- the hash ----------------------------------------------------------------------------------------------------


SMALL = EngramArgs(layers=(1, 3), vocab_size=40, n_heads=2, max_ngram_size=3, pad_id=0)


def test_bucket_layout():
    """The row counts are the sums of the layers' primes as the reference draws them. Planted: primes reused
    across layers (each layer's search ignoring the other's draws): fails."""
    token_map = [0, 1, 2]
    primes = engram_primes(SMALL.vocab_size, 2, SMALL.max_ngram_size, SMALL.n_heads)
    engram_hash = EngramHash(SMALL, token_map, 3)
    assert [engram_hash.table_rows(layer) for layer in SMALL.layers] == [sum(map(sum, p)) for p in primes]


def test_released_row_counts():
    """V4.1's engram_num_embeddings from its config (vocab 16 M, 8 heads, n-grams 2..4, layers 1 and 14)."""
    args = EngramArgs(layers=(1, 14), vocab_size=16_000_000, n_heads=8, max_ngram_size=4)
    engram_hash = EngramHash(args, [0, 1, 2], 3)
    assert (engram_hash.table_rows(1), engram_hash.table_rows(14)) == (384006168, 384016682)
    engram = dict(layers=(1, 14), vocab_size=16_000_000, n_heads=8, max_ngram_size=4)
    ModelArgs(vocab_size=129280, engram=EngramArgs(num_embeddings=(384006168, 384016682), **engram))
    with pytest.raises(ValueError, match="model.engram.num_embeddings=.* disagrees"):  # checked with the config
        ModelArgs(vocab_size=129280, engram=EngramArgs(num_embeddings=(384006168, 384016681), **engram))


def test_hash_ids_by_hand():
    """Every id of two packed rows against plain-int hashes. Planted: look-back through the document start (only
    the sequence start stops it), the pad's raw id instead of its normalised one, XOR replaced by a sum, the
    offsets left out: each fails."""
    token_map, map_size = [5, 0, 1, 1, 2, 3, 4], 6  # raw ids 2, 3 normalise alike; the pad (0) -> 5
    tokens = [[1, 2, 3, 4, 5, 6, 1, 2], [3, 3, 6, 6, 6, 1, 2, 4]]
    doc_start = [[0, 0, 0, 3, 3, 3, 3, 7], [0, 1, 1, 1, 4, 4, 4, 4]]  # documents of lengths 3, 4, 1 / 1, 3, 4
    engram_hash = EngramHash(SMALL, token_map, map_size)
    ids = engram_hash(torch.tensor(tokens), torch.tensor(doc_start))
    assert ids.dtype == torch.int64 and ids.shape == (2, 8, 2, (SMALL.max_ngram_size - 1) * SMALL.n_heads)
    assert ids.tolist() == engram_hash_ids(tokens, doc_start, token_map, map_size, SMALL)
    rows = [engram_hash.table_rows(layer) for layer in SMALL.layers]
    assert all(0 <= v < r for layer, r in enumerate(rows) for v in ids[:, :, layer].flatten().tolist())


# --- the update --------------------------------------------------------------------------------------------------

DIM, HC, ROWS = 8, 3, 20
ARGS = EngramArgs(layers=(1,), max_ngram_size=3, n_heads=2, head_dim=4)
COLS = (ARGS.max_ngram_size - 1) * ARGS.n_heads
EPS = 1e-20


def reference_engram(x, table, ids, wkv, q, k, token_mask=None):
    """SPEC §5.3 per token and copy, fp64: kv = wkv · rows; key_c = kv[c], value = kv[hc]; the gate of the
    normalised dot product through a signed square root; x_c + gate_c · value."""
    B, T, hc, D = x.shape
    out = []
    for b in range(B):
        for t in range(T):
            kv = wkv @ table[ids[b, t]].flatten()
            value = kv[hc * D:]
            for c in range(hc):
                xc, key = x[b, t, c], kv[c * D:(c + 1) * D]
                dot = (xc * q[c] * k[c] * key).sum() / torch.sqrt((xc * xc).mean() + EPS) \
                    / torch.sqrt((key * key).mean() + EPS) / math.sqrt(D)
                gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(torch.clamp(dot.abs(), min=1e-6)))
                if token_mask is not None and not token_mask[b, t]:
                    gate = gate * 0
                out.append(xc + gate * value)
    return torch.stack(out).view(B, T, hc, D)


def make_engram(seed: int = 0, hc: int = HC) -> Engram:
    g = torch.Generator().manual_seed(seed)
    engram = Engram(DIM, hc, ARGS, ROWS, EPS).double()
    with torch.no_grad():
        engram.embed.weight.copy_(torch.randn(ROWS, ARGS.head_dim, generator=g, dtype=torch.float64))
        engram.wkv.weight.copy_(torch.randn(engram.wkv.weight.shape, generator=g, dtype=torch.float64) * 0.3)
        engram.q_weight.copy_(torch.randn(hc, DIM, generator=g, dtype=torch.float64))
        engram.k_weight.copy_(torch.randn(hc, DIM, generator=g, dtype=torch.float64))
    return engram


def stream(B=2, T=5, hc=HC, seed=1):
    """Copies of different scales, so that a norm over all copies differs from one per copy."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.3, 1.0, 4.0][:hc], dtype=torch.float64).view(hc, 1)
    x = torch.randn(B, T, hc, DIM, generator=g, dtype=torch.float64) * scale
    return x, torch.randint(0, 7, (B, T, COLS), generator=g)  # rows 0..6 of 20: duplicates and untouched rows


def reference_of(engram: Engram, x, ids, table=None, token_mask=None):
    table = engram.embed.weight.detach() if table is None else table
    return reference_engram(x, table, ids, engram.wkv.weight.detach(), engram.q_weight.detach(),
                            engram.k_weight.detach(), token_mask)


def test_update_matches_reference():
    """Planted: the stream's norm taken jointly over the copies, the gate without the signed square root, key and
    value split the other way round, q_weight left out: each fails."""
    engram, (x, ids) = make_engram(), stream()
    torch.testing.assert_close(engram(x, ids), reference_of(engram, x, ids), rtol=1e-12, atol=1e-12)


def test_token_mask_and_dtypes():
    """False in token_mask: the stream unchanged; a bf16 stream comes back bf16 (fp32 math inside)."""
    engram, (x, ids) = make_engram(), stream()
    mask = torch.tensor([[True, False, True, True, False], [False, True, True, True, True]])
    out = engram(x, ids, mask)
    torch.testing.assert_close(out, reference_of(engram, x, ids, token_mask=mask), rtol=1e-12, atol=1e-12)
    assert torch.equal(out[~mask], x[~mask])
    engram32 = make_engram().float()
    out16 = engram32(x.to(torch.bfloat16), ids)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.double(), reference_of(engram, x.to(torch.bfloat16).double(), ids),
                               rtol=2e-2, atol=2e-2)


def test_sparse_table_gradient():
    """The table's gradient is sparse, holds exactly the looked-up rows, each the sum over its duplicates (the
    reference's dense gradient). Planted: a dense gradient (``weight[ids]``): fails. (The duplicates' sum is
    torch's embedding backward here; the exchange's own sum is planted wrong in test_engram_shards.)"""
    engram, (x, ids) = make_engram(), stream()
    weights = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (engram(x, ids) * weights).sum().backward()
    grad = engram.embed.weight.grad
    assert grad.is_sparse
    grad = grad.coalesce()
    table = engram.embed.weight.detach().clone().requires_grad_()
    (reference_of(engram, x, ids, table) * weights).sum().backward()
    assert grad.indices()[0].tolist() == sorted(set(ids.flatten().tolist()))
    torch.testing.assert_close(grad.values(), table.grad[grad.indices()[0]], rtol=1e-12, atol=1e-12)
    frozen = Engram(DIM, HC, EngramArgs(layers=(1,), max_ngram_size=3, n_heads=2, head_dim=4, train=False), ROWS, EPS)
    assert not frozen.embed.weight.requires_grad and frozen.wkv.weight.requires_grad


def test_gradcheck_x_and_wkv():
    """fp64 gradcheck of the update w.r.t. the stream and wkv (hc 2; the autograd graph of the module itself)."""
    engram, (x, ids) = make_engram(hc=2), stream(B=1, T=3, hc=2)
    call = lambda x, w: torch.func.functional_call(engram, {"wkv.weight": w}, (x, ids))  # noqa: E731
    assert torch.autograd.gradcheck(call, (x.requires_grad_(), engram.wkv.weight.detach().clone().requires_grad_()))


def test_table_and_exchange_must_agree():
    class Exchange:
        rank, world = 1, 2

    with pytest.raises(ValueError, match="rank 0 of 2 got an exchange of rank 1 of 2"):
        EngramTable(ROWS, 4, Exchange(), rank=0, world=2)
    table = EngramTable(11, 4, Exchange(), rank=1, world=2)
    assert (table.part_rows, table.start, table.weight.shape) == (6, 6, (6, 4))
