"""``train/formats/parallel_read.py``: byte ranges read by a pool of threads, in pieces, a bounded window ahead."""
import pytest
import torch

from train.formats import parallel_read
from train.formats.parallel_read import Span, read_in_order


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 7 bytes and a window of 40: every span crosses pieces, and most requests wait on the window."""
    monkeypatch.setattr(parallel_read, "PIECE_BYTES", 7)
    monkeypatch.setattr(parallel_read, "WINDOW_BYTES", 40)


def test_spans_come_back_whole_and_in_the_order_asked(tmp_path, small_pieces):
    """Requests of one and two spans over two files, overlapping, empty and up to a file's last byte, against the
    files' bytes sliced directly. Planted and caught: a piece read at the span's start instead of its own offset, the
    window handing back the newest request first, a request's second span read from the first one's file."""
    g = torch.Generator().manual_seed(0)
    data = {name: torch.randint(0, 256, (size,), generator=g, dtype=torch.uint8) for name, size in (("a", 300),
                                                                                                   ("b", 97))}
    for name, values in data.items():
        (tmp_path / name).write_bytes(values.numpy().tobytes())
    asked = [[("a", 0, 300)], [("b", 5, 92), ("a", 299, 1)], [("a", 100, 0)], [("a", 10, 50), ("b", 0, 97)],
             [("b", 96, 1)]] * 3
    requests = [[Span(tmp_path / name, start, size) for name, start, size in spans] for spans in asked]
    got = list(read_in_order(requests, threads=3))
    assert len(got) == len(asked)
    for spans, buffers in zip(asked, got):
        assert [b.dtype for b in buffers] == [torch.uint8] * len(spans)
        for (name, start, size), buffer in zip(spans, buffers):
            assert torch.equal(buffer, data[name][start:start + size])


def test_a_span_past_the_end_of_its_file_names_the_file(tmp_path, small_pieces):
    """A header that places a tensor past the end of a file changed after it was checked: one clear line."""
    (tmp_path / "short").write_bytes(bytes(20))
    with pytest.raises(ValueError, match=r"short ended at byte 20, inside a tensor"):
        list(read_in_order([[Span(tmp_path / "short", 10, 30)]]))
