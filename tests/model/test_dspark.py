"""DSpark (``model/dspark.py``) against an fp64 reference written here from SPEC §5.4 and the reference code's
``DSparkAttention``/``DSparkBlock``/``forward_spec``, anchor by anchor and slot by slot with explicit lists.

The reference's stream mechanics are ``tests/support/oracle.py``'s per-token reference (``ref_block``, ``ref_collapse``)
and its RoPE is ``tests/support/oracle.py``'s; it shares no code with ``model/``. The FFN is an input of DSpark (the
integrator's factory): the reference calls the same module. Each test names the planted bug it caught when tried once.
"""

import pytest
import torch
import torch.nn.functional as F

from model.config import DSparkArgs, ModelArgs
from model.dspark import IGNORE, Anchors, DSpark, DSparkAttention
from model.geometry import Geometry
from model.transformer import FeedForward

from tests.support.oracle import ref_block, ref_collapse, rope, rope_freqs

f64 = torch.float64
NOISE = 39


def tiny_args(hc_mult=2, **dspark) -> ModelArgs:
    dspark = dict(dict(blocks=2, block_size=3, target_layers=(0, 1), markov_rank=8, noise_token_id=NOISE), **dspark)
    return ModelArgs(vocab_size=40, dim=32, n_heads=4, head_dim=16, rope_head_dim=8, q_lora_rank=16, o_groups=2,
                     o_lora_rank=8, window_size=3, index_n_heads=2, index_head_dim=16, index_topk=4, inter_dim=24,
                     hc_mult=hc_mult, hc_sinkhorn_iters=4, hc_eps=1e-3, norm_eps=1e-6, kernel_backend="torch",
                     dspark=DSparkArgs(**dspark))


def build(args: ModelArgs, seed: int = 0) -> DSpark:
    """DSpark in fp64 with every parameter random (sinks, norms and mix biases too, so none is at a neutral value)."""
    model = DSpark(args, lambda: FeedForward(args.dim, args.inter_dim, args.kernel_backend))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith(("norm.weight", "hc_attn_scale", "hc_ffn_scale")):
                p.copy_(1 + 0.3 * noise)
            elif p.dim() == 1:  # sinks, mix biases
                p.copy_(noise)
            else:
                p.copy_(noise * (0.3 if name.endswith("_fn") else p.shape[-1] ** -0.5))
    return model.double()


# a packed batch: row 0 holds documents of 3, 4 and 3 tokens, row 1 one document of 10
DOCS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [5] * 10])


def batch(seed: int, T: int = 10):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, NOISE, (2, T), generator=g)
    return input_ids, Geometry(DOCS[:, :T], window=3)


# ------------------------------------------------------------------------------------------------------------------
# reference, per anchor and slot
# ------------------------------------------------------------------------------------------------------------------
def rms(v, w, eps):
    return v / torch.sqrt(v.square().mean(-1, keepdim=True) + eps) * w


def doc_of(b, p):
    return int(DOCS[b, p])


def doc_pos(b, p):
    """Position of token p in its document."""
    return p - min(q for q in range(p + 1) if doc_of(b, q) == doc_of(b, p))


def window_positions(b, i, window):
    """The main positions an anchor's draft queries read: the last ``window`` ending at i, in i's document."""
    return [p for p in range(max(0, i - window + 1), i + 1) if doc_of(b, p) == doc_of(b, i)]


def token_at(ids, b, p):
    return int(ids[b, p]) if p < ids.shape[1] else NOISE


def ref_target(ids, b, i, j):
    p = i + 2 + j
    return int(ids[b, p]) if p < ids.shape[1] and doc_of(b, p) == doc_of(b, i) else IGNORE


def ref_attention(P: dict, args: ModelArgs, xn, main_x, causal: bool = False):
    """xn [B,T,bs,D] the normed draft stream, main_x [B,T,D] -> [B,T,bs,D]; ``causal`` masks later slots (the
    bug the test must tell apart)."""
    B, T, bs, D = xn.shape
    H, Dh, G = args.n_heads, args.head_dim, args.o_groups
    freqs = rope_freqs(args.rope_head_dim, args.rope_theta, False, {})

    def at(v, pos):
        return rope(v.unsqueeze(0), torch.tensor([pos]), freqs)[0]

    def kv(v, pos):
        return at(rms(P["wkv.weight"] @ v, P["kv_norm.weight"], args.norm_eps), pos)

    out = torch.zeros(B, T, bs, D, dtype=f64)
    for b in range(B):
        for i in range(T):
            slot_pos = [doc_pos(b, i) + 1 + j for j in range(bs)]
            keys = [kv(main_x[b, p], doc_pos(b, p)) for p in window_positions(b, i, args.window_size)]
            n_main = len(keys)
            keys += [kv(xn[b, i, j], slot_pos[j]) for j in range(bs)]
            for j in range(bs):
                q = P["wq_b.weight"] @ rms(P["wq_a.weight"] @ xn[b, i, j], P["q_norm.weight"], args.norm_eps)
                heads = []
                for h in range(H):
                    qh = at(q[h * Dh:(h + 1) * Dh], slot_pos[j])
                    seen = keys[:n_main + j + 1] if causal else keys
                    e = torch.stack([torch.exp(qh @ k * Dh ** -0.5) for k in seen])
                    o = sum(w * k for w, k in zip(e, seen)) / (e.sum() + torch.exp(P["attn_sink"][h]))
                    heads.append(rope(o.unsqueeze(0), torch.tensor([slot_pos[j]]), freqs, inverse=True)[0])
                o = torch.cat(heads).view(G, -1)
                R = args.o_lora_rank
                low = torch.cat([P["wo_a.weight"][g * R:(g + 1) * R] @ o[g] for g in range(G)])
                out[b, i, j] = P["wo_b.weight"] @ low
    return out


def ref_forward(model: DSpark, args: ModelArgs, features, ids, embed, head, main_logits):
    """Logits [B,T,bs,V], confidence [B,T,bs], targets [B,T,bs] and the loss parts, from the parameters."""
    P = [{k: v.detach() for k, v in block.named_parameters()} for block in model]
    B, T = ids.shape
    bs, hc, eps = args.dspark.block_size, args.hc_mult, args.norm_eps
    main_x = rms(torch.cat(features, -1) @ P[0]["main_proj.weight"].T, P[0]["main_norm.weight"], eps)
    draft_ids = [[[token_at(ids, b, i + 1)] + [NOISE] * (bs - 1) for i in range(T)] for b in range(B)]
    x = embed[torch.tensor(draft_ids)].unsqueeze(-2).repeat(1, 1, 1, hc, 1).view(B * T, bs, hc, -1)
    pre = torch.zeros(B * T, bs, hc, dtype=f64)
    pre[..., 0] = 1
    for block, p in zip(model, P):
        attn = (lambda h, p=p: ref_attention({k[5:]: v for k, v in p.items() if k.startswith("attn.")}, args,
                                             rms(h, p["attn_norm.weight"], eps).view(B, T, bs, -1),
                                             main_x).view(B * T, bs, -1))
        ffn = (lambda h, block=block, p=p: block.ffn(rms(h, p["ffn_norm.weight"], eps)))
        x, pre = ref_block(p, x, pre, attn, ffn, args.hc_sinkhorn_iters, eps, args.hc_eps)
    last = P[-1]
    hidden = ref_collapse(x, pre).view(B, T, bs, -1)
    logits = rms(hidden, last["norm.weight"], eps) @ head.T
    prev = torch.tensor([[[token_at(ids, b, i + 1 + j) for j in range(bs)] for i in range(T)] for b in range(B)])
    markov = last["markov_head.embed.weight"][prev]
    logits = logits + markov @ last["markov_head.head.weight"].T
    confidence = torch.cat([hidden, markov], -1) @ last["confidence_head.proj.weight"][0]
    targets = torch.tensor([[[ref_target(ids, b, i, j) for j in range(bs)] for i in range(T)] for b in range(B)])
    ce = l1 = bce = 0.0
    n = 0
    for b in range(B):
        for i in range(T):
            for j in range(bs):
                y = int(targets[b, i, j])
                if y == IGNORE:
                    continue
                n += 1
                logp = logits[b, i, j].log_softmax(-1)
                ce -= logp[y]
                l1 += (logp.exp() - main_logits[b, i + 1 + j].softmax(-1)).abs().sum()  # main at i+1+j: t_{i+2+j}
                hit = float(int(logits[b, i, j].argmax()) == y)
                c = confidence[b, i, j]
                bce -= hit * F.logsigmoid(c) + (1 - hit) * F.logsigmoid(-c)
    return logits, confidence, targets, {"ce": ce / n, "l1": l1 / n, "confidence": bce / n}


def inputs(args: ModelArgs, seed: int):
    g = torch.Generator().manual_seed(seed + 100)
    ids, geometry = batch(seed)
    features = [torch.randn(2, 10, args.dim, generator=g, dtype=f64) * 2 for _ in args.dspark.target_layers]
    embed = torch.randn(args.vocab_size, args.dim, generator=g, dtype=f64)
    head = torch.randn(args.vocab_size, args.dim, generator=g, dtype=f64) / args.dim ** 0.5
    main_logits = torch.randn(2, 10, args.vocab_size, generator=g, dtype=f64) * 2
    return ids, geometry, features, embed, head, main_logits


# ------------------------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------------------------
def test_anchors_across_packed_documents():
    """Written out for row 0 (documents [0..2], [3..6], [7..9], tokens 10..19, bs 3): draft inputs, the tokens
    before the slots, targets, slot positions; then every anchor of both rows against the reference's lists.
    Caught: targets t_{i+1+j} (off by one); no document check (anchor 2's slot 0 would target token 4, of the
    next document); slot positions pos_i + j; row positions instead of document positions."""
    ids = torch.stack([torch.arange(10, 20), torch.arange(20, 30)])
    a = Anchors.of(Geometry(DOCS, window=3), ids, 3, NOISE)
    X = IGNORE
    assert a.targets[0].tolist() == [[12, X, X], [X, X, X], [X, X, X], [15, 16, X], [16, X, X], [X, X, X],
                                     [X, X, X], [19, X, X], [X, X, X], [X, X, X]]
    assert a.inputs[0, :, 0].tolist() == [11, 12, 13, 14, 15, 16, 17, 18, 19, NOISE]
    assert (a.inputs[..., 1:] == NOISE).all()
    assert a.prev[0, 7].tolist() == [18, 19, NOISE] and a.prev[0, 0].tolist() == [11, 12, 13]
    assert a.slots.pos[0].view(10, 3)[:, 0].tolist() == [1, 2, 3, 1, 2, 3, 4, 1, 2, 3]
    assert a.slots.pos[1].view(10, 3)[9].tolist() == [10, 11, 12]
    ids, _ = batch(seed=1)
    a = Anchors.of(Geometry(DOCS, window=3), ids, 3, NOISE)
    for b in range(2):
        for i in range(10):
            assert a.targets[b, i].tolist() == [ref_target(ids, b, i, j) for j in range(3)]
            assert a.prev[b, i].tolist() == [token_at(ids, b, i + 1 + j) for j in range(3)]
            assert a.slots.pos[b, 3 * i:3 * i + 3].tolist() == [doc_pos(b, i) + 1 + j for j in range(3)]


def test_attention_reads_the_main_window_and_the_whole_block():
    """DSparkAttention against the per-slot reference (window positions of the anchor's document ending at i,
    all bs slots of its block, slot j at pos_i + 1 + j). The reference with a causal mask inside the block
    differs. Caught: only the block's first slot visible; the main window ending at i - 1; slot positions
    pos_i + j; no inverse RoPE on the output; the sink of head 0 for every head."""
    args = tiny_args()
    attn = build(args)[0].attn
    ids, geometry = batch(seed=2)
    a = Anchors.of(geometry, ids, 3, NOISE)
    g = torch.Generator().manual_seed(3)
    xn, main_x = torch.randn(20, 3, args.dim, generator=g, dtype=f64), torch.randn(2, 10, args.dim, generator=g,
                                                                                    dtype=f64)
    got = attn(xn, main_x, a, geometry).view(2, 10, 3, -1)
    P = {k: v.detach() for k, v in attn.named_parameters()}
    want = ref_attention(P, args, xn.view(2, 10, 3, -1), main_x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    causal = ref_attention(P, args, xn.view(2, 10, 3, -1), main_x, causal=True)
    assert (got[:, :, :2] - causal[:, :, :2]).abs().amax() > 1e-3  # slots 0, 1 see later slots


def test_forward_matches_the_reference():
    """Logits, confidence, targets and the three loss parts of two blocks (hc 2) against the reference. Caught:
    the Markov bias from the slot's own target t_{i+2+j} (off by one) and from t_{i+j}; the confidence head on
    the normed stream; the teacher at position i+2+j; the draft input t_i; slots of invalid anchors counted."""
    args = tiny_args()
    model = build(args, seed=4)
    ids, geometry, features, embed, head, main_logits = inputs(args, seed=5)
    out = model(features, ids, geometry, embed, head, main_logits)
    with torch.no_grad():
        logits, confidence, targets, losses = ref_forward(model, args, features, ids, embed, head, main_logits)
    assert out.logits.shape == (20, 3, args.vocab_size) and out.logits.dtype == f64
    torch.testing.assert_close(out.logits, logits.flatten(0, 1), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(out.confidence, confidence.flatten(0, 1), rtol=1e-9, atol=1e-9)
    assert out.targets.tolist() == targets.flatten(0, 1).tolist()
    for name, value in losses.items():
        torch.testing.assert_close(out.losses[name], value, rtol=1e-9, atol=1e-10)
    assert model(features, ids, geometry, embed, head).losses is None


def test_embedding_and_head_are_frozen_and_features_detached():
    """Every DSpark parameter gets a gradient from the loss parts; the shared embedding and head, the features and
    the teacher logits none. Caught: the embedding, the head, the features or the teacher used without detach."""
    args = tiny_args(hc_mult=4, blocks=3)
    model = build(args, seed=6)
    ids, geometry, features, embed, head, main_logits = inputs(args, seed=7)
    leaves = [t.requires_grad_() for t in (*features, embed, head, main_logits)]
    out = model(features, ids, geometry, embed, head, main_logits)
    sum(out.losses.values()).backward()
    assert all(t.grad is None for t in leaves)
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


def test_runs_under_bf16_autocast():
    """The bf16 training path (CPU autocast): fp32 logits and confidence, the loss parts near the fp32 run's."""
    args = tiny_args(hc_mult=4)
    model = build(args, seed=8).float()
    ids, geometry, *rest = inputs(args, seed=9)
    features, embed, head, main_logits = [t.float() for t in rest[0]], *(t.float() for t in rest[1:])
    plain = model(features, ids, geometry, embed, head, main_logits)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = model(features, ids, geometry, embed, head, main_logits)
    assert cast.logits.dtype == cast.confidence.dtype == torch.float32
    for name, value in plain.losses.items():
        torch.testing.assert_close(cast.losses[name], value, rtol=2e-2, atol=2e-2)
    sum(cast.losses.values()).backward()


def test_parameter_names_are_the_checkpoint_names():
    args = tiny_args(blocks=3)
    model = DSpark(args, lambda: FeedForward(args.dim, args.inter_dim))
    shapes = {f"mtp.{name}": tuple(p.shape) for name, p in model.named_parameters()}
    D, r, V = args.dim, args.dspark.markov_rank, args.vocab_size
    assert shapes["mtp.0.main_proj.weight"] == (D, 2 * D) and "mtp.0.main_norm.weight" in shapes
    assert shapes["mtp.2.markov_head.embed.weight"] == (V, r) and shapes["mtp.2.markov_head.head.weight"] == (V, r)
    assert shapes["mtp.2.confidence_head.proj.weight"] == (1, D + r) and "mtp.2.norm.weight" in shapes
    assert shapes["mtp.1.hc_ffn_fn"] == (8, 2 * D) and shapes["mtp.1.hc_attn_scale"] == (3,)
    attn = {n.split(".attn.")[1] for n in shapes if n.startswith("mtp.1.attn.")}
    assert attn == {"wq_a.weight", "q_norm.weight", "wq_b.weight", "wkv.weight", "kv_norm.weight", "wo_a.weight",
                    "wo_b.weight", "attn_sink"}
    assert not any(n.startswith(("mtp.1.main", "mtp.0.markov", "mtp.1.norm")) for n in shapes)
    assert {n for n in shapes if n.endswith(("embed.weight", "head.weight"))} == {  # the main ones are not here
        "mtp.2.markov_head.embed.weight", "mtp.2.markov_head.head.weight"}
    assert isinstance(model[0].attn, DSparkAttention) and model[0].attn.rotary.key == (8, args.rope_theta)


def test_bad_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^model.dspark.noise_token_id=40 is outside the vocabulary \[0, "):
        tiny_args(noise_token_id=40)
