"""The checkpoint's staging area (``train/formats/staging.py``) on CPU tensors: exact copies in one buffer of exactly
their aligned bytes, page-locked once and reused while the bytes stay the same.

The one call that needs a GPU, page-locking, is replaced by a recorder (``PageLocks``); the CPU tensors go through
the same carving and copying as a GPU's. Each test names the bug planted to check that it fails."""
import io

import torch

from train.formats import checkpoint
from train.formats.staging import ALIGNMENT, StagingArea


class PageLocks:
    """Records the area's ``cudaHostRegister`` and ``cudaHostUnregister`` calls instead of making them."""

    def __init__(self):
        self.calls: list[tuple] = []  # ("register", pointer, bytes) and ("unregister", pointer), in their order

    def area(self) -> StagingArea:
        return StagingArea(register=lambda pointer, nbytes: self.calls.append(("register", pointer, nbytes)),
                           unregister=lambda pointer: self.calls.append(("unregister", pointer)))

    @property
    def registered(self) -> list[tuple[int, int]]:
        return [call[1:] for call in self.calls if call[0] == "register"]

    @property
    def unregistered(self) -> list[int]:
        return [call[1] for call in self.calls if call[0] == "unregister"]


def sources() -> list[torch.Tensor]:
    """Several dtypes and shapes, a NaN (equal only bit for bit), an empty tensor, a scalar and two non-contiguous
    views; odd byte counts, so that packing them end to end would misalign the next one."""
    generator = torch.Generator().manual_seed(0)
    fp32 = torch.randn(7, 5, generator=generator)
    fp32[0, 0] = float("nan")
    matrix = torch.randn(6, 4, generator=generator)
    return [fp32, torch.randn(3, 3, generator=generator).to(torch.bfloat16),
            torch.randint(-2**40, 2**40, (5,), generator=generator), torch.empty(0, 3),
            torch.tensor(True), torch.randint(0, 255, (3,), dtype=torch.uint8, generator=generator),
            matrix.t(), matrix[::2, 1::2]]


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().numpy().tobytes() if tensor.dtype != torch.bfloat16 else \
        tensor.contiguous().view(torch.int16).numpy().tobytes()


def span(tensor: torch.Tensor) -> tuple[int, int]:
    return tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()


def test_copies_equal_their_sources_bit_for_bit():
    """Dtype, shape and every byte of each copy are its source's, a non-contiguous source's in its logical order.
    Planted: each offset one byte short of the end of the tensor before (the places overlap, a later copy
    overwrites an earlier one's last byte): fails."""
    tensors = sources()
    copies = PageLocks().area().copy(tensors)
    for source, copy in zip(tensors, copies):
        assert (copy.dtype, copy.shape) == (source.dtype, source.shape)
        assert copy.is_contiguous() and raw(copy) == raw(source)


def test_copies_do_not_follow_their_sources():
    """Training goes on changing the live tensors while the copies are written. Planted: the area handing back
    views of the sources (``tensor.detach()``) instead of copies: fails."""
    tensors = sources()
    before = [raw(t) for t in tensors]
    copies = PageLocks().area().copy(tensors)
    for tensor in tensors:
        tensor.zero_()
    assert [raw(c) for c in copies] == before


def test_places_are_aligned_disjoint_and_inside_the_buffer():
    """Each copy starts ``ALIGNMENT`` bytes on from a multiple of it past the buffer's start, no two copies share a
    byte, all lie inside the registered bytes. Planted: no alignment (each tensor right after the one before):
    fails; the off-by-one of the first test: fails."""
    locks = PageLocks()
    copies = [c for c in locks.area().copy(sources()) if c.numel()]
    [(start, nbytes)] = locks.registered
    spans = sorted(span(c) for c in copies)
    assert all((begin - start) % ALIGNMENT == 0 for begin, _ in spans)
    assert all(end <= next_begin for (_, end), (next_begin, _) in zip(spans, spans[1:]))
    assert spans[0][0] >= start and spans[-1][1] <= start + nbytes


def test_the_buffer_is_the_exact_aligned_total():
    """40 bytes at 0, 6 at 64, nothing for the empty tensor, 40 at 128: 168 bytes registered, not the power of two
    above (256) nor padded to the alignment (192). Planted: the buffer rounded up to a power of two: fails;
    a tail of padding after the last tensor: fails."""
    locks = PageLocks()
    area = locks.area()
    copies = area.copy([torch.ones(10), torch.ones(3, dtype=torch.bfloat16), torch.ones(0),
                        torch.ones(5, dtype=torch.int64)])
    [(start, nbytes)] = locks.registered
    assert nbytes == area.nbytes == 168
    assert [c.data_ptr() - start for c in copies if c.numel()] == [0, 64, 128]


def test_the_same_bytes_reuse_the_buffer_registered_once():
    """Every save of a run stages the same tensors: the second copies go to the same places of the same buffer,
    registered once and never released, and hold the new values. Planted: a new buffer registered every save:
    fails."""
    locks = PageLocks()
    area = locks.area()
    first = area.copy(sources())
    later = [t + 1 if t.dtype != torch.bool else ~t for t in sources()]
    second = area.copy(later)
    assert [c.data_ptr() for c in second if c.numel()] == [c.data_ptr() for c in first if c.numel()]
    assert len(locks.registered) == 1 and locks.unregistered == []
    assert [raw(c) for c in second] == [raw(t) for t in later]


def test_other_bytes_replace_the_buffer():
    """Tensors of other sizes get a buffer of their own exact size (400 bytes; then 400 and 240 at 448); the old one
    is unlocked before the new one is locked, and a release unlocks the new one. Planted: the old buffer never
    unregistered: fails."""
    locks = PageLocks()
    area = locks.area()
    area.copy([torch.ones(100)])
    area.copy([torch.ones(100), torch.ones(30, dtype=torch.float64)])
    (first, _), (second, _) = locks.registered
    assert locks.calls == [("register", first, 400), ("unregister", first), ("register", second, 688)]
    area.release()
    assert locks.unregistered == [pointer for pointer, _ in locks.registered] and area.nbytes == 0


def test_a_saved_file_holds_only_its_own_tensors():
    """``torch.save`` writes a tensor's whole storage: a file of the small copy must not carry the large one beside
    it in the buffer. Planted: copies carved as views of the buffer's storage (``buffer[offset:offset + size]``):
    the file holds the whole area and fails."""
    small, large = PageLocks().area().copy([torch.ones(16), torch.ones(64 * 1024)])
    file = io.BytesIO()
    torch.save({"small": small}, file)
    assert len(file.getvalue()) < 64 * 1024
    file.seek(0)
    assert torch.load(file, weights_only=True)["small"].untyped_storage().nbytes() == 16 * 4


def test_host_copies_keep_the_files_nesting():
    """``checkpoint.host_copies`` puts every copy back where its source was, strings and numbers untouched, the
    picked tensors in the area. Planted: the area's copies put back in reverse order: fails."""
    locks = PageLocks()
    tensors = sources()
    files = {"layer_000.pt": {"w": tensors[0], "b": tensors[1]},
             "resume_state.pt": {"rng": {"numpy": ("MT19937", tensors[2], 3, 0, 0.0)}, "rows": [tensors[6]]},
             "trainer_state.json": '{"step": 1}'}
    staged = checkpoint.host_copies(files, locks.area(), into_area=lambda tensor: True)
    [(start, nbytes)] = locks.registered
    assert staged["trainer_state.json"] == '{"step": 1}'
    numpy = staged["resume_state.pt"]["rng"]["numpy"]
    assert numpy[0] == "MT19937" and numpy[2:] == (3, 0, 0.0)
    for copy, source in [(staged["layer_000.pt"]["w"], tensors[0]), (staged["layer_000.pt"]["b"], tensors[1]),
                         (numpy[1], tensors[2]), (staged["resume_state.pt"]["rows"][0], tensors[6])]:
        assert raw(copy) == raw(source) and start <= copy.data_ptr() < start + nbytes


def test_a_cpu_run_touches_no_cuda_call():
    """Without a GPU no tensor reaches the area: nothing is page-locked, CUDA's own registration (which fails on
    torch without CUDA) is never called, and each tensor is cloned. Planted: every tensor sent to the area: fails."""
    source = torch.arange(6.0)
    staged = checkpoint.host_copies({"layer_000.pt": {"w": source}}, StagingArea())
    copy = staged["layer_000.pt"]["w"]
    assert torch.equal(copy, source) and copy.data_ptr() != source.data_ptr()
