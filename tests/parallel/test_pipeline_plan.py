"""Stage split, payload schema and plan printout (single process)."""
import pytest
import torch

from model import ModelArgs, layout_from_config
from model.cli import compose
from model.state import FIELDS
from parallel.partition import PartitionError, partition
from parallel.payload import Field, Payload, _PackFloats, _UnpackFloats, boundary_fields
from parallel.batch import plan_batch
from parallel.plan import describe
from parallel.stage import shadow_sources


@pytest.fixture(scope="module")
def tiny():
    cfg = compose([])
    return ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)


@pytest.fixture(scope="module")
def v41():
    cfg = compose(["model=v41_flash", "layout=v41"])
    return ModelArgs.from_config(cfg.model), layout_from_config(cfg.layout)


def fields(args, layout, last_layer, index_k="shadow"):
    return {(f.name, f.source) for f in boundary_fields(args, layout, last_layer, 2, 64, torch.float32, index_k)}


def test_payload_carries_exactly_the_live_fields(tiny):
    args, layout = tiny
    # Full 2 | Reuse 3: the Reuse layer needs layer 2's KV and selection, and the KL needs its logits/target.
    assert fields(args, layout, 2) == {("h", None), ("doc_ids", None), ("kv", 2), ("topk", 2),
                                       ("index_logits", 2), ("index_target", 2)}
    # 6,7 | 8: layer 6's selection is finished (its KL travels), its KV and candidates are still needed.
    assert fields(args, layout, 7) == {("h", None), ("doc_ids", None), ("kv", 6), ("candidates", 6),
                                       ("indexer_loss", 2), ("indexer_loss", 4), ("indexer_loss", 6)}
    assert ("index_k", 6) in fields(args, layout, 7, "payload")
    # Reindex 8 | Reuse 9
    assert {("topk", 8), ("index_logits", 8), ("index_target", 8), ("kv", 6)} <= fields(args, layout, 8)
    assert ("candidates", 6) not in fields(args, layout, 8)


def test_shadow_indexers_where_index_keys_are_needed(tiny, v41):
    assert shadow_sources(tiny[1], range(8, 10)) == [6]
    assert shadow_sources(tiny[1], range(3, 8)) == []
    assert shadow_sources(v41[1], range(21, 31)) == [20]


ROUND_TRIP_BOUNDARIES = [(2, "shadow"), (7, "payload")]  # after Full 2 (its selection in flight), after 7


def test_round_trip_boundaries_carry_every_field_kind(tiny):
    args, layout = tiny
    kinds = {f.name for last, index_k in ROUND_TRIP_BOUNDARIES
             for f in boundary_fields(args, layout, last, 2, 64, torch.float32, index_k)}
    assert kinds == {"h", "doc_ids", "indexer_loss", *FIELDS}  # kv, index_k, topk, candidates, index logits/target


@pytest.mark.parametrize("last_layer, index_k", ROUND_TRIP_BOUNDARIES)
def test_payload_round_trip_is_exact(tiny, last_layer, index_k):
    """Every field a stage packs is unpacked bitwise by the next, with its dtype: float fields through the
    differentiable tensor, selections, candidate blocks and indexer targets through the bytes."""
    args, layout = tiny
    payload = Payload(boundary_fields(args, layout, last_layer, 2, 64, torch.float32, index_k))
    from model.transformer import Transformer

    model = Transformer(args, layout, range(0, last_layer + 1))
    doc_ids = torch.zeros(2, 64, dtype=torch.long)
    doc_ids[:, 30:] = 1
    state = model.new_state(doc_ids)
    h, pre = model.run_layers(*model.embed_tokens(torch.randint(0, args.vocab_size, (2, 64))), state)
    floats, raw = payload.pack(h, pre, state)
    assert floats.dtype == torch.float32 and raw.dtype == torch.uint8
    h2, _, state2 = Payload(payload.fields).unpack(floats, raw, model.new_state)
    assert torch.equal(h2, h) and torch.equal(state2.geometry.doc_ids, doc_ids)
    for (name, source) in {(f.name, f.source) for f in payload.fields} - {("h", None), ("doc_ids", None)}:
        got = state2.indexer_losses[source] if name == "indexer_loss" else getattr(state2, name)[source]
        want = state.indexer_losses[source] if name == "indexer_loss" else getattr(state, name)[source]
        assert got.dtype == want.dtype and torch.equal(got, want), (name, source)
    if "topk" in {f.name for f in payload.fields}:
        assert (state.topk[2] == -1).any() and (state.topk[2] >= 0).any()  # empty slots cross as -1 too


def test_bf16_fields_travel_as_their_bits(tiny):
    """Under bf16 autocast the m = 1 latent and the index keys are bf16 in the model: they travel as bf16 bits (half
    an fp32 slot each), the m = 2 latent and the residual stream as fp32; values round trip bitwise."""
    args, layout = tiny
    from model.transformer import Transformer

    for last, index_k in ((2, "shadow"), (7, "payload")):
        payload = Payload(boundary_fields(args, layout, last, 2, 64, torch.bfloat16, index_k))
        model = Transformer(args, layout, range(0, last + 1))
        state = model.new_state(torch.zeros(2, 64, dtype=torch.long))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h, pre = model.run_layers(*model.embed_tokens(torch.randint(0, args.vocab_size, (2, 64))), state)
            floats, raw = payload.pack(h, pre, state)
        wire = {(f.name, f.source): f.wire_dtype for f in payload.float_fields}
        assert wire[("h", None)] == torch.float32
        assert wire[("kv", last - 1 if last == 7 else last)] == (torch.bfloat16 if last == 7 else torch.float32)
        assert last == 2 or wire[("index_k", 6)] == torch.bfloat16
        assert floats.dtype == torch.float32
        assert floats.numel() == sum(-(-f.numel * f.wire_dtype.itemsize // 4) for f in payload.float_fields)
        h2, _, state2 = Payload(payload.fields).unpack(floats, raw, model.new_state)
        assert torch.equal(h2, h)
        for f in payload.float_fields[1:]:
            got = state2.indexer_losses[f.source] if f.name == "indexer_loss" else getattr(state2, f.name)[f.source]
            want = state.indexer_losses[f.source] if f.name == "indexer_loss" else getattr(state, f.name)[f.source]
            assert got.dtype == want.dtype and torch.equal(got.view(-1).view(torch.uint8),
                                                          want.reshape(-1).view(torch.uint8)), f.name


def test_packed_gradients_only_move_bits():
    """The gradient of a bf16 field crosses the boundary bit for bit, through unpack and pack: -0.0, subnormals and
    NaN payloads included, next to an unused field (zero gradient) and with an odd element count (padded slot)."""
    fields = [Field("h", None, (3,), torch.float32, torch.float32, True),
              Field("kv", 1, (3, 5), torch.bfloat16, torch.bfloat16, True),
              Field("index_k", 1, (2,), torch.bfloat16, torch.bfloat16, True)]
    payload = Payload(fields)
    special = torch.tensor([-0.0, 0.0, 1e-40, -1e-40, float("nan"), 1.0, -2.5, 3e38], dtype=torch.bfloat16)
    values = [torch.randn(3, requires_grad=True), special.repeat(2)[:15].view(3, 5).clone().requires_grad_(),
              torch.ones(2, dtype=torch.bfloat16, requires_grad=True)]
    sent = _PackFloats.apply(payload, *values)
    assert sent.numel() == 3 + 8 + 1
    received = sent.detach().requires_grad_()
    h, kv, _ = _UnpackFloats.apply(payload, received)
    grad_kv = special.flip(0).repeat(2)[:15].view(3, 5)
    torch.autograd.backward([h, kv], [torch.ones(3), grad_kv])  # index_k unused: zero gradient
    sent.backward(received.grad)
    assert torch.equal(values[1].grad.view(torch.int16), grad_kv.view(torch.int16))
    assert torch.equal(values[2].grad, torch.zeros(2, dtype=torch.bfloat16))
    assert torch.equal(values[0].grad, torch.ones(3))


def test_payload_schema_mismatch_is_caught(tiny):
    args, layout = tiny
    sender = Payload(boundary_fields(args, layout, 7, 2, 64, torch.float32, "payload"))
    receiver = Payload(boundary_fields(args, layout, 7, 2, 64, torch.float32, "shadow"))
    floats = torch.zeros(sum(f.numel for f in sender.float_fields))
    raw = torch.zeros(8 + sum(f.padded_bytes for f in sender.byte_fields), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="pipeline payload mismatch"):
        receiver.unpack(floats, raw, None)


def test_partition_rules(tiny, v41):
    args, layout = tiny
    assert partition(args, layout, 256, 4, [3, 8, 9]).stages == (range(0, 3), range(3, 8), range(8, 9), range(9, 10))
    assert len(partition(*v41, 65536, 8).stages) == 8
    with pytest.raises(PartitionError, match="more stages than the model's 10 layers"):
        partition(args, layout, 256, 11)
    with pytest.raises(PartitionError, match="stage 1 empty"):
        partition(args, layout, 256, 3, [4, 4])
    with pytest.raises(PartitionError, match="gives 3 stages"):
        partition(args, layout, 256, 2, [3, 5])
    with pytest.raises(PartitionError, match=r"parallel.cuts='None': give a list of layer ids"):
        partition(args, layout, 256, 2, "None")  # `parallel.cuts=None` on the command line (null was meant)


def test_balanced_split_evens_the_cost(v41):
    from parallel.partition import layer_costs

    args, layout = v41
    costs = layer_costs(args, layout, 65536)
    stages = partition(args, layout, 65536, 4).stages
    loads = [sum(costs[i] for i in s) for s in stages]
    assert max(loads) / (sum(costs) / 4) < 1.1


def test_plan_printout_names_every_boundary_field(v41):
    args, layout = v41
    plan = partition(args, layout, 65536, 4, [11, 21, 31])
    batch = plan_batch(micro_batch=1, stages=4, world_size=8, global_batch=16)
    text = describe(args, layout, plan, 1, 65536, torch.bfloat16, "shadow", batch)
    assert "boundary 1->2" in text and "candidates[20]" in text and "int16" in text
    assert "shadow indexers for Full layer(s) [20]" in text and "index K of layer 20" in text
    # the header names the compute dtype as such: the payload rows below show their own wire dtypes
    assert "compute bfloat16 autocast over float32 weights" in text.splitlines()[0]
    assert "16 rows per step = 1 rows x 8 microbatch(es) x 2 data-parallel replica(s)" in text
    assert "1F1B bubble 27%" in text  # (4-1)/(8+4-1)
