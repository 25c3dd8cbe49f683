"""The pool of an SFA decode step: the keys past its programs' fixed chunks, handed out at run time in units that
shrink as the pool drains (:func:`.decode._sfa_decode_chunk` takes them through one counter per row block).

Why shrinking units: a unit restarts the key loop's software pipeline, so long units cost less, but the last units
handed out set when the step ends, and a long one there ends late while other SMs idle (a 4-tile unit takes a loaded
H200 SM about 9 us). So most of the pool goes in long units and its end in single tiles. :func:`pool_units` states
the schedule; :func:`pool_unit` is the same schedule in a kernel, one unit per ticket (the counter's value).
"""
from __future__ import annotations

from ..triton_common import jit, triton

if triton is not None:
    import triton.language as tl


def unit_levels(largest: int) -> int:
    """The unit sizes of a pool whose largest unit is ``largest`` tiles, a power of two: largest, largest / 2, ...,
    1 (the LEVELS of :func:`pool_unit`)."""
    if largest < 1 or largest & (largest - 1):
        raise ValueError(f"largest: expected a power of two >= 1 (tiles of the pool's largest unit), got {largest}")
    return largest.bit_length()


def pool_units(tiles: int, largest: int) -> list[int]:
    """The sizes, in tiles, of the units a pool of ``tiles`` tiles is handed out in, in the order they are handed
    out (their sum is ``tiles``; the last unit is cut at the cache's end): about half the pool in units of
    ``largest`` tiles (a power of two), half of the rest in units of half that, and so on, the rest in single tiles.
    E.g. 27 tiles from 4: three units of 4, three of 2, nine of 1."""
    sizes, size = [], 1 << (unit_levels(largest) - 1)
    while size > 1:
        units = tiles // 2 // size
        sizes += [size] * units
        tiles -= units * size
        size //= 2
    return sizes + [1] * tiles


@jit
def pool_unit(ticket, pool_start, k_len, BLOCK_N: tl.constexpr, LEVELS: tl.constexpr):
    """Keys [start, stop) of unit number ``ticket`` (int32, from 0) of the pool [pool_start, k_len), the units being
    ``pool_units(ceil((k_len - pool_start) / BLOCK_N), 2 ** (LEVELS - 1))`` back to back from pool_start, each cut
    at k_len. Where there is no such unit (the ticket is past the last, or pool_start >= k_len: a fixed plan's
    chunks may reach past the cache), start >= k_len."""
    rest = tl.maximum(tl.cdiv(k_len - pool_start, BLOCK_N), 0)  # tiles not yet in a unit of a larger size
    offset = 0  # tiles before this size's units
    start = -1  # the unit's first tile, once found
    length = 1
    for level in tl.static_range(LEVELS - 1):
        size = 1 << (LEVELS - 1 - level)
        units = rest // 2 // size
        found = (start < 0) & (ticket < units)
        start = tl.where(found, offset + ticket * size, start)
        length = tl.where(found, size, length)
        ticket -= units
        offset += units * size
        rest -= units * size
    start = pool_start + tl.where(start < 0, offset + ticket, start) * BLOCK_N
    return start, tl.minimum(start + length * BLOCK_N, k_len)
