"""A checkpoint's GPU tensors staged in host memory of exactly their size, page-locked once and reused by every save.

A save copies the GPU's tensors into host memory before a background thread writes them (``checkpoint.stage``).
For the device-to-host copies to run asynchronously that memory must be page-locked. Torch's caching host allocator
(``pin_memory=True``) rounds every block up to a power of two (``allocate`` in ATen/core/CachingHostAllocator.h), so
the staged state could hold up to twice its bytes of pinned memory. ``StagingArea`` holds one flat ``uint8`` buffer of
exactly the bytes the tensors need (``layout``), allocated by ``torch.empty`` (not rounded) and page-locked by one
``cudaHostRegister``; each tensor is copied into its place. The next save whose tensors need the same bytes (every
save of a run: the same parameters and optimizer state) reuses the buffer as it is, neither allocating nor
registering; other sizes replace it.

What torch 2.13 offers, read in its installed headers (the CUDA host allocator's own code, which the wheel does not
ship, in torch's source: aten/src/ATen/cuda/CachingHostAllocator.cpp), and why this is still written here:

- ``PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True`` (c10/cuda/CUDAAllocatorConfig.h): the allocator
  takes its blocks from ``malloc`` and ``cudaHostRegister`` instead of ``cudaHostAlloc``, of the same rounded size.
- ``pinned_reserve_segment_size_mb``: one segment pinned up front and never given back, carved into blocks of the
  same rounded sizes.
- ``PYTORCH_ALLOC_CONF=pinned_max_round_threshold_mb:N`` (c10/core/AllocatorConfig.h): blocks above N MiB keep
  their exact size. Not used: it changes every pinned allocation of the process (DeepSpeed's, the loader's), not the
  checkpoint's alone; blocks below N MiB (norms, biases, small tables) still round; a save is still one pinned
  allocation a tensor. And an exact-size block is either not cached (above ``pinned_max_cached_size_mb``: page-locked
  afresh every save) or filed in the free list of its power-of-two ceiling, whose ``get_free_block`` hands out the
  list's last block without comparing its size with the request (as the header reads; not tried on a GPU here).
- ``torch.distributed.checkpoint._state_dict_stager.StateDictStager(pin_memory=True)``: exact-size copies
  registered with ``cudaHostRegister`` and reused, but one registration per source storage, each copied whole (a
  saved slice brings its whole tensor), reused only while that storage object lives, in a private module.

Each tensor starts at a multiple of ``ALIGNMENT`` (64 bytes) in the buffer: the alignment of torch's CPU allocator
(c10/core/alignment.h, for AVX-512), so that a staged tensor starts where a tensor of its own would and the writer's
serialising and hashing read it alike; every dtype's element size divides it. A page (4 KiB) would buy nothing:
``torch.empty`` promises 64 bytes, not a page, so the offsets would not be page-aligned, and the one registration
locks every page of the buffer whatever the offsets. The padding costs at most 63 bytes a tensor.

Each staged tensor has a storage of its own over its bytes of the buffer (``torch.from_numpy`` of a slice), not a
view of the buffer's storage: ``torch.save`` writes a tensor's whole storage, so a view would put the whole area
into every file of the checkpoint.
"""
from collections.abc import Callable, Sequence

import torch

ALIGNMENT = 64


def register_with_cuda(pointer: int, nbytes: int) -> None:
    """Page-lock ``nbytes`` of host memory at ``pointer`` for the GPU's copies (``cudaHostRegisterDefault``)."""
    code = int(torch.cuda.cudart().cudaHostRegister(pointer, nbytes, 0))
    if code != 0:
        raise RuntimeError(f"page-locking the {nbytes:,}-byte checkpoint staging area (cudaHostRegister): "
                           f"{torch.cuda.CudaError(code)}")


def unregister_with_cuda(pointer: int) -> None:
    """Undo ``register_with_cuda`` for the memory at ``pointer``."""
    code = int(torch.cuda.cudart().cudaHostUnregister(pointer))
    if code != 0:
        raise RuntimeError(f"unlocking the checkpoint staging area (cudaHostUnregister): {torch.cuda.CudaError(code)}")


def layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where tensors of ``sizes`` bytes go in one buffer: each one's offset, the next multiple of ``ALIGNMENT`` after
    the one before it (a tensor of no bytes takes none), and the buffer's bytes, up to the end of the last tensor."""
    offsets, end = [], 0
    for size in sizes:
        start = (end + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT if size else end
        offsets.append(start)
        end = start + size
    return offsets, end


class StagingArea:
    """One page-locked host buffer of exactly the bytes of the tensors staged in it, kept from one save to the next.

    A staging overwrites the previous one's copies: the caller has written them first (``Trainer.save`` waits for
    the writer before it stages). ``register(pointer, nbytes)`` and ``unregister(pointer)`` page-lock and release the
    buffer: CUDA's by default; a test passes its own, the one call that needs a GPU."""

    def __init__(self, register: Callable[[int, int], None] = register_with_cuda,
                 unregister: Callable[[int], None] = unregister_with_cuda):
        self._register, self._unregister = register, unregister
        self._buffer: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """The bytes held page-locked (0: none)."""
        return 0 if self._buffer is None else self._buffer.numel()

    def copy(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Contiguous host copies of ``tensors``, in their order, each in its place of the buffer. The copies from a
        GPU are queued (``non_blocking``): synchronise before reading them."""
        sizes = [tensor.numel() * tensor.element_size() for tensor in tensors]
        offsets, total = layout(sizes)
        if total != self.nbytes:
            self._replace(total)
        flat = self._buffer.numpy() if self._buffer is not None else None
        staged = []
        for tensor, offset, size in zip(tensors, offsets, sizes):
            if size == 0:
                staged.append(torch.empty(tensor.shape, dtype=tensor.dtype))
                continue
            place = torch.from_numpy(flat[offset:offset + size]).view(tensor.dtype).view(tensor.shape)
            staged.append(place.copy_(tensor, non_blocking=True))
        return staged

    def release(self) -> None:
        """Unlock the buffer and let it go; the copies staged in it stay readable, no longer page-locked."""
        if self._buffer is not None:
            self._unregister(self._buffer.data_ptr())
            self._buffer = None

    def _replace(self, nbytes: int) -> None:
        self.release()
        if nbytes:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            self._register(buffer.data_ptr(), nbytes)
            self._buffer = buffer
