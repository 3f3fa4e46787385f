"""TensorFlow's BFC allocator, modelled: the bytes a step's tensors hold as chunks.

The simulator sums the bytes each live tensor asks for.  TensorFlow's
measured peak is its BFC ("best-fit with coalescing") allocator's peak
*bytes in use*, which counts whole chunks: a request is rounded up to 256
bytes and, when the best-fitting free chunk is less than twice the rounded
request, the whole chunk is handed out unsplit, so one tensor can hold up
to about twice its bytes.  This module replays allocations and frees
through a model of that allocator, as TensorFlow configures it for the CPU
with ``TF_CPU_ALLOCATOR_USE_BFC=true`` (growth allowed: the first region of
memory is 2 MiB and later ones double), and reports the chunk bytes in use
and their peak.

The rules modelled (TensorFlow's ``tsl/framework/bfc_allocator.cc``):

* a request of ``n`` bytes is rounded up to a multiple of 256 (``n == 0``
  allocates nothing);
* the chunk given is the smallest free chunk at least that large, the
  lowest address first among equal sizes (the allocator's bins, searched
  from the request's bin upwards, each sorted by size then address);
* the chunk is split, the tail staying free, when it is at least twice the
  rounded request or exceeds it by at least 128 MiB; otherwise the request
  gets all of it;
* a freed chunk merges with free neighbours in the same region (regions,
  each one block from the system, never merge on the CPU);
* when no free chunk fits, a new region is added: the current region size,
  doubled until the request fits (then not doubled again), else doubled
  after it is used; none past the memory limit (64 GiB unless
  ``TF_CPU_BFC_MEM_LIMIT_IN_MB`` says otherwise);
* bytes in use are the sizes of the chunks in use; the peak is their
  largest sum since the statistics were last reset.

Which free chunk an equal-sized tie gives depends on where regions lie in
memory: the system hands out large blocks at decreasing addresses (mmap),
so by default each new region lies below the previous ones.

Replayed over every allocation and free a TensorFlow process made since it
started (its profiler's events, ``experiments/allocator_trace.py``), the
model gives each allocation the chunk TensorFlow gave and reaches the
measured peak to the byte (``tests/test_allocator_trace.py``); with regions
placed in ascending order instead, an attention encoder's and an LSTM's
traces went wrong at 9 and 669 allocations.

Examples
--------
>>> bfc = Allocator()
>>> bfc.allocate("a", 1000), bfc.allocate("b", 3000)  # rounded to 256 bytes
(1024, 3072)
>>> bfc.free("a"); bfc.free("b")  # the two merge back with the region's rest
>>> bfc.allocate("c", 600_000), bfc.allocate("d", 400_000)
(600064, 400128)
>>> bfc.free("c")  # a free hole of 600,064 bytes, below "d"
>>> bfc.allocate("e", 400_000)  # less than twice the request: taken whole
600064
>>> bfc.in_use, bfc.peak
(1000192, 1000192)
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Dict, Hashable, List, Optional, Tuple

from memsaving.model.buffers import ALLOCATE, FREE, AllocationEvents

MIN_ALLOCATION = 256
"""Every request is rounded up to a multiple of this (``kMinAllocationSize``)."""

FIRST_REGION = 2 << 20
"""The first region's bytes when growth is allowed."""

SPLIT_EXCESS = 128 << 20
"""A chunk is split when it exceeds the request by this much, whatever the ratio."""

DEFAULT_LIMIT = 64 << 30
"""The CPU allocator's memory limit when ``TF_CPU_BFC_MEM_LIMIT_IN_MB`` is unset."""

_SPAN = 1 << 52
"""Free chunks are kept sorted as one integer each, ``size * _SPAN + address``:
addresses stay below it, so the order is by size, then address."""

_TOP = 1 << 50
"""The model's addresses: regions lie below this, descending by default."""

_GAP = MIN_ALLOCATION
"""Bytes between neighbouring regions, so that no two regions' chunks touch."""


class AllocatorExhausted(MemoryError):
    """No free chunk fits a request and a new region would pass the memory limit."""


@dataclass(frozen=True)
class Chunk:
    """One chunk of a region: where it starts (the model's own addresses, in
    the order TensorFlow's would be), its bytes, and the key it was
    allocated for (None: free)."""

    region: int
    address: int
    size: int
    owner: Optional[Hashable]


def rounded(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`MIN_ALLOCATION`.

    Examples
    --------
    >>> rounded(1), rounded(256), rounded(257)
    (256, 256, 512)
    """
    return -(-nbytes // MIN_ALLOCATION) * MIN_ALLOCATION


class Allocator:
    """A BFC allocator's chunks, regions and statistics, driven by
    :meth:`allocate` and :meth:`free` (see the module's docstring for the
    rules).

    Parameters
    ----------
    limit
        the memory limit in bytes: no region is added past it
        (:class:`AllocatorExhausted`).
    first_region
        the first region's bytes (2 MiB, or the limit when smaller).
    descending
        each new region lies below the previous ones (the system's mmap
        order, the default); False: above.

    Examples
    --------
    >>> bfc = Allocator(first_region=4096)
    >>> bfc.allocate("x", 1000), bfc.pool_bytes  # nothing held yet: a 4 KiB region, split
    (1024, 4096)
    >>> bfc.allocate("y", 5000), bfc.pool_bytes  # no free chunk fits: an 8 KiB region, taken whole
    (8192, 12288)
    """

    def __init__(self, limit: int = DEFAULT_LIMIT, first_region: int = FIRST_REGION, descending: bool = True):
        if limit <= 0 or first_region <= 0:
            raise ValueError(f"Allocator(limit={limit}, first_region={first_region}): both must be positive byte counts")
        self.limit = limit
        self.descending = descending
        self.next_region = rounded(min(limit, first_region))
        """The bytes the next region gets when the request fits in them."""
        self.pool_bytes = 0
        """Bytes of all regions."""
        self.in_use = 0
        """Bytes of the chunks in use."""
        self.peak = 0
        """The largest :attr:`in_use` since the last :meth:`reset_peak`."""
        self.regions: List[Tuple[int, int]] = []
        """Each region's first address and bytes, in the order they were added."""
        self._free: List[int] = []  # free chunks, size * _SPAN + address, sorted
        self._free_size: Dict[int, int] = {}  # free chunk's address -> bytes
        self._free_end: Dict[int, int] = {}  # free chunk's end address -> its address
        self._used: Dict[Hashable, Tuple[int, int]] = {}  # key -> (address, bytes) of its chunk
        self._bottom = _TOP  # the lowest (or, ascending, highest) address the regions reach

    def allocate(self, key: Hashable, nbytes: int) -> int:
        """Give ``key`` a chunk for ``nbytes`` and return the chunk's bytes
        (0 for a request of 0 bytes, which holds nothing)."""
        if key in self._used:
            raise ValueError(f"allocate({key!r}): the key holds a chunk already; free it first")
        if nbytes < 0:
            raise ValueError(f"allocate({key!r}, {nbytes}): a request is a byte count, 0 or more")
        if nbytes == 0:
            return 0
        request = rounded(nbytes)
        found = bisect_left(self._free, request * _SPAN)
        if found == len(self._free):
            self._add_region(request)
            found = bisect_left(self._free, request * _SPAN)
        size, address = divmod(self._free.pop(found), _SPAN)
        del self._free_size[address], self._free_end[address + size]
        if size >= 2 * request or size - request >= SPLIT_EXCESS:
            self._insert_free(address + request, size - request)
            size = request
        self._used[key] = (address, size)
        self.in_use += size
        if self.in_use > self.peak:
            self.peak = self.in_use
        return size

    def free(self, key: Hashable) -> None:
        """Free ``key``'s chunk, merged with the free chunks next to it in
        its region.  A key that holds nothing (a request of 0 bytes, or
        never allocated) frees nothing."""
        held = self._used.pop(key, None)
        if held is None:
            return
        address, size = held
        self.in_use -= size
        following = self._free_size.get(address + size)
        if following is not None:
            self._remove_free(address + size, following)
            size += following
        preceding = self._free_end.get(address)
        if preceding is not None:
            before = self._free_size[preceding]
            self._remove_free(preceding, before)
            address, size = preceding, size + before
        self._insert_free(address, size)

    def hand_over(self, key: Hashable, taker: Hashable) -> None:
        """``key``'s chunk now belongs to ``taker`` (a kernel writing its
        output in place of a dying input keeps the input's chunk, whatever
        its size).  A key that holds nothing hands over nothing."""
        if taker in self._used:
            raise ValueError(f"hand_over({key!r}, {taker!r}): the taker holds a chunk already; free it first")
        held = self._used.pop(key, None)
        if held is not None:
            self._used[taker] = held

    def reset_peak(self) -> None:
        """Start the peak afresh from what is in use now, as TensorFlow's
        ``reset_memory_stats`` does."""
        self.peak = self.in_use

    def holds(self, key: Hashable) -> bool:
        """Whether ``key`` holds a chunk."""
        return key in self._used

    def chunk_bytes(self, key: Hashable) -> int:
        """The bytes of ``key``'s chunk (0 when it holds none)."""
        return self._used.get(key, (0, 0))[1]

    def chunks(self) -> List[Chunk]:
        """Every chunk, free or in use, by region (in the order they were
        added), then by address: for checks and pictures, not for speed."""
        owners = {address: key for key, (address, _) in self._used.items()}
        sizes = dict(self._free_size)
        sizes.update(self._used.values())
        found = []
        for number, (start, nbytes) in enumerate(self.regions):
            address = start
            while address < start + nbytes:
                found.append(Chunk(number, address, sizes[address], owners.get(address)))
                address += sizes[address]
        return found

    def _add_region(self, request: int) -> None:
        """A new region for a request no free chunk fits (TensorFlow's ``Extend``)."""
        available = (self.limit - self.pool_bytes) // MIN_ALLOCATION * MIN_ALLOCATION
        if request > available:
            raise AllocatorExhausted(f"{request} bytes requested with {self.pool_bytes} of the limit of {self.limit} "
                                     "bytes in regions and no free chunk large enough: a larger limit is needed")
        grew = False
        while request > self.next_region:
            self.next_region *= 2
            grew = True
        nbytes = min(self.next_region, available)
        if not grew:
            self.next_region *= 2
        if self.descending:
            self._bottom -= nbytes + _GAP
            start = self._bottom
        else:
            start = self._bottom + _GAP
            self._bottom = start + nbytes
        self.regions.append((start, nbytes))
        self.pool_bytes += nbytes
        self._insert_free(start, nbytes)

    def _insert_free(self, address: int, size: int) -> None:
        insort(self._free, size * _SPAN + address)
        self._free_size[address] = size
        self._free_end[address + size] = address

    def _remove_free(self, address: int, size: int) -> None:
        del self._free[bisect_left(self._free, size * _SPAN + address)]
        del self._free_size[address], self._free_end[address + size]


def replay(events: AllocationEvents, allocator: Optional[Allocator] = None) -> Allocator:
    """Run ``events`` (:class:`memsaving.model.buffers.AllocationEvents`)
    through ``allocator`` (a fresh one by default) and return it: its
    :attr:`Allocator.peak` is the chunk-level peak.

    Examples
    --------
    >>> events = AllocationEvents([ALLOCATE, ALLOCATE, FREE, ALLOCATE], ["a", "b", "a", "c"],
    ...                           [300_000, 300_000, 0, 200_000])
    >>> bfc = replay(events)
    >>> bfc.chunk_bytes("c"), bfc.peak  # "c" takes the whole of "a"'s chunk
    (300032, 600064)
    """
    bfc = Allocator() if allocator is None else allocator
    allocate, free, hand_over = bfc.allocate, bfc.free, bfc.hand_over
    for kind, key, value in zip(events.kinds, events.keys, events.values):
        if kind == ALLOCATE:
            allocate(key, value)
        elif kind == FREE:
            free(key)
        else:
            hand_over(key, value)
    return bfc
