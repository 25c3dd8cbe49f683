"""Compressed key cache of SFA for decoding: each cached key is stored as its ``topk`` (index, value) pairs.

SFA attends with the sparsified keys only (:mod:`.codes`), so a decode step never needs a cached key's other
coordinates: per token and KV head the cache keeps ``topk`` coordinate indices, bit-packed at
b = :func:`index_bits` (D) bits each (:func:`pack_indices`), ``topk`` values in the model dtype, and the dense V row.
With D = 128, topk = 16 and bfloat16 that is 14 (16 indices of 7 bits) + 32 + 256 = 302 bytes against 512 for a
dense K+V cache (58.98%; whole bytes per index would be 304, 59.375%); :meth:`SFAKeyCache.bytes_per_token`
measures it from the tensors actually allocated.

One cache holds one layer. Its tensors are preallocated for ``capacity`` tokens and, when an append does not fit,
replaced by tensors of twice the capacity (the filled part copied over), so n appends cost O(n) copies in all.
"""
from __future__ import annotations

import torch

from ..._checks import FLOAT_DTYPES, check_int, check_no_nan, fail, fail_where
from .codes import index_checks, index_dtype, sparse_codes


# ---------------------------------------------------------------------------------------------------- bit packing

def index_bits(dim: int) -> int:
    """Bits b of one packed coordinate index for head dim ``dim``: max(1, (dim - 1).bit_length()), the fewest
    holding 0 .. dim - 1 (1 at D <= 2, 7 at D = 128, 8 at D = 256, 9 at D = 257)."""
    return max(1, (check_int("dim", dim, 1) - 1).bit_length())


def packed_bytes(topk: int, dim: int) -> int:
    """Bytes of one key's packed indices: ceil(topk * :func:`index_bits` (dim) / 8) (14 at topk = 16, D = 128)."""
    return (check_int("topk", topk, 1) * index_bits(dim) + 7) // 8


def _index_bytes(topk: int, bits: int, nbytes: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each of ``topk`` indices of ``bits`` bits lies in a key's ``nbytes`` bytes: (byte [topk, span], shift
    [topk]) int64, byte[j, s] = j * bits // 8 + s (clamped to the last byte) for s < span = ceil((7 + bits) / 8),
    the most bytes one index can touch, and shift[j] = j * bits % 8, its first bit within its first byte."""
    start = torch.arange(topk, device=device) * bits
    span = (bits + 14) // 8
    byte = (start // 8)[:, None] + torch.arange(span, device=device)
    return byte.clamp(max=nbytes - 1), start % 8


def pack_indices(indices: torch.Tensor, dim: int) -> torch.Tensor:
    """Bit-packs coordinate indices: indices [..., topk] (any integer dtype, each in [0, dim)) -> uint8
    [..., ceil(topk * b / 8)] with b = :func:`index_bits` (dim).

    Layout, little-endian in bits: read a key's bytes as one integer whose bit i is bit i % 8 of byte i // 8 (bit 0
    is the least significant bit of byte 0); index j occupies bits [j * b, (j + 1) * b) of it, its least
    significant bit first. Bits past topk * b (the last byte's tail) are 0. No range check (callers have done it):
    an index of more than b bits would spill into its neighbour. Temporaries: int64 [..., topk, span] and
    [..., bytes], span = ceil((7 + b) / 8): 16 * 2 * 8 + 14 * 8 = 368 bytes per key at D = 128, topk = 16.
    """
    if not isinstance(indices, torch.Tensor):
        fail("indices", "a torch.Tensor [..., topk]", type(indices).__name__)
    if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
        fail("indices", "an integer tensor", indices.dtype)
    if indices.dim() == 0 or indices.shape[-1] == 0:
        fail("indices", "a tensor [..., topk] with topk >= 1", f"shape {tuple(indices.shape)}")
    bits, topk = index_bits(dim), indices.shape[-1]
    nbytes = packed_bytes(topk, dim)
    byte, shift = _index_bytes(topk, bits, nbytes, indices.device)
    span = byte.shape[1]
    # Each index, moved to its bit offset, is cut into its ``span`` bytes; the indices' bit ranges are disjoint, so
    # adding the pieces into their bytes is an OR. A clamped byte position only ever receives zero pieces.
    shifted = indices.long() << shift
    pieces = (shifted[..., None] >> (8 * torch.arange(span, device=indices.device))) & 0xFF  # [..., topk, span]
    lead = indices.shape[:-1]
    packed = torch.zeros(*lead, nbytes, dtype=torch.int64, device=indices.device)
    packed.scatter_add_(-1, byte.reshape(-1).expand(*lead, topk * span), pieces.reshape(*lead, topk * span))
    return packed.to(torch.uint8)


def unpack_indices(packed: torch.Tensor, dim: int, topk: int) -> torch.Tensor:
    """Inverse of :func:`pack_indices`: packed uint8 [..., ceil(topk * b / 8)] -> int64 indices [..., topk], index j
    read from bits [j * b, (j + 1) * b) of the key's bytes (layout in :func:`pack_indices`)."""
    bits = index_bits(dim)
    nbytes = packed_bytes(topk, dim)
    if not isinstance(packed, torch.Tensor):
        fail("packed", "a torch.Tensor", type(packed).__name__)
    if packed.dtype != torch.uint8 or packed.dim() == 0 or packed.shape[-1] != nbytes:
        fail("packed", f"a uint8 tensor [..., {nbytes}] ({topk} indices of {bits} bits)",
             f"{packed.dtype} shape {tuple(packed.shape)}")
    byte, shift = _index_bytes(topk, bits, nbytes, packed.device)
    span = byte.shape[1]
    lead = packed.shape[:-1]
    gathered = packed.gather(-1, byte.reshape(-1).expand(*lead, topk * span)).long().reshape(*lead, topk, span)
    # Byte s of an index's span holds its bits [8s, 8s + 8) before the shift; bytes past its last bit (neighbours,
    # or the clamped last byte again) only set bits above b after the shift, which the mask drops.
    word = (gathered << (8 * torch.arange(span, device=packed.device))).sum(dim=-1)
    return (word >> shift) & ((1 << bits) - 1)


# ---------------------------------------------------------------------------------------------------- the cache

def _check_dtype(dtype) -> torch.dtype:
    if dtype not in FLOAT_DTYPES:
        fail("dtype", "torch.float16, bfloat16, float32 or float64", dtype)
    return dtype


def dense_bytes_per_token(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token of one KV head in a dense K+V cache of ``dtype``: 2 * head_dim elements."""
    return 2 * check_int("head_dim", head_dim, 1) * _check_dtype(dtype).itemsize


class SFAKeyCache:
    """KV cache of one layer with compressed keys: [B, Hkv, T, topk] (index, value) pairs per key, dense V.

    Storage: packed indices uint8 [B, Hkv, capacity, :func:`packed_bytes` (topk, D)] (:func:`pack_indices`; each
    head's keys back to back, the head padded to a whole number of 4-byte words), key values [B, Hkv, capacity,
    topk] and V [B, Hkv, capacity, D] in ``dtype``.

    Args:
        batch, kv_heads, head_dim: B, Hkv and D of the keys and values it will hold.
        topk: int in [1, D], coordinates kept per key (the SFA ``topk`` of the layer).
        dtype: float16, bfloat16, float32 or float64: dtype of the key values and of V (the model dtype).
        device: where the tensors live.
        capacity: tokens allocated at first (>= 1); doubled whenever an append does not fit.

    Keys enter through :meth:`append` (dense keys, coded here with :func:`.codes.sparse_codes`, the rule every SFA
    path shares) or :meth:`append_codes` (codes computed by the caller). Both take the new tokens of every sequence
    of the batch at once, so all sequences have the same length.
    """

    def __init__(self, batch: int, kv_heads: int, head_dim: int, *, topk: int, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", capacity: int = 256):
        self.batch = check_int("batch", batch, 1)
        self.kv_heads = check_int("kv_heads", kv_heads, 1)
        self.head_dim = check_int("head_dim", head_dim, 1)
        self.topk = check_int("topk", topk, 1, head_dim)
        self.dtype = _check_dtype(dtype)
        self.index_dtype = index_dtype(head_dim)  # of the unpacked indices that keys() returns
        self.index_bits = index_bits(head_dim)
        self.packed_bytes = packed_bytes(topk, head_dim)  # per key
        self.length = 0
        self._packed, self._values, self._v = self._allocate(check_int("capacity", capacity, 1), device)
        self.device = self._v.device  # normalised ("cuda" -> "cuda:0"), to compare with the inputs' devices

    def _allocate(self, capacity: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Uninitialised (packed indices, key values, V) for ``capacity`` tokens."""
        tokens = (self.batch, self.kv_heads, capacity)
        # Each head's packed keys from a 4-byte boundary to one (at most 3 bytes of padding per head): the decode
        # kernel reads them as 4-byte words, which its copy engine stages (decode._index_word).
        head_bytes = capacity * self.packed_bytes
        heads = torch.empty(self.batch, self.kv_heads, -(-head_bytes // 4) * 4, dtype=torch.uint8, device=device)
        return (heads[:, :, :head_bytes].view(*tokens, self.packed_bytes),
                torch.empty(*tokens, self.topk, dtype=self.dtype, device=device),
                torch.empty(self.batch, self.kv_heads, capacity, self.head_dim, dtype=self.dtype, device=device))

    @property
    def capacity(self) -> int:
        """Tokens the allocated tensors hold."""
        return self._v.shape[2]

    def __len__(self) -> int:
        return self.length

    def keys(self, start: int = 0, stop: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached keys at positions [start, stop) (default: all ``length``): indices [B, Hkv, stop - start, topk]
        (:attr:`index_dtype`, unpacked into a new tensor) and values [B, Hkv, stop - start, topk] (:attr:`dtype`, a
        view that aliases the cache until it grows). The key at position start + j is ``densify(indices[..., j, :],
        values[..., j, :], D)``."""
        stop = self.length if stop is None else check_int("stop", stop, 0, self.length)
        start = check_int("start", start, 0, stop)
        indices = unpack_indices(self._packed[:, :, start:stop], self.head_dim, self.topk)
        return indices.to(self.index_dtype), self._values[:, :, start:stop]

    def packed_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the cached keys as stored: packed indices uint8 [B, Hkv, length, :attr:`packed_bytes`] (layout
        in :func:`pack_indices`) and values [B, Hkv, length, topk]; what a kernel reads. They alias the cache until
        it grows."""
        return self._packed[:, :, :self.length], self._values[:, :, :self.length]

    def values(self) -> torch.Tensor:
        """View of the cached dense V [B, Hkv, length, D]; aliases the cache until it grows."""
        return self._v[:, :, :self.length]

    def allocated_bytes(self) -> int:
        """Bytes of the storages this cache holds (packed indices, key values and V, unused capacity included),
        measured with ``untyped_storage().nbytes()``."""
        return sum(t.untyped_storage().nbytes() for t in (self._packed, self._values, self._v))

    def bytes_per_token(self) -> float:
        """Measured bytes per token slot and KV head: allocated_bytes() / (B * Hkv * capacity). Compare with
        :func:`dense_bytes_per_token` (head_dim, dtype). packed_bytes + (topk + D) * element size, plus each head's
        padding of its packed indices to whole 4-byte words (at most 3 bytes per head, so nothing past the first
        decimals at long capacities): 302 at D = 128, topk = 16, bfloat16, against 512 dense."""
        return self.allocated_bytes() / (self.batch * self.kv_heads * self.capacity)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Adds Tnew tokens: k and v [B, Hkv, Tnew, D] (Tnew >= 1) in the cache's dtype and device, k after RoPE.
        k is stored as its ``sparse_codes(k, topk)`` (indices bit-packed), v as is."""
        self._check_tokens("k", k, self.head_dim, "head dim", self.dtype)
        self._check_tokens("v", v, self.head_dim, "head dim", self.dtype)
        if v.shape != k.shape:
            fail("v", f"the shape of k {tuple(k.shape)}", f"shape {tuple(v.shape)}")
        # Top-k of a NaN is unspecified, and a NaN in V would reach every later output: refuse them here, once
        # per token, so that decode steps need not re-read the cache.
        check_no_nan(k=k, v=v)
        indices, values = sparse_codes(k, self.topk)
        self._write(indices, values, v)

    def append_codes(self, indices: torch.Tensor, values: torch.Tensor, v: torch.Tensor) -> None:
        """Adds Tnew tokens whose key codes the caller computed: indices [B, Hkv, Tnew, topk] in
        :attr:`index_dtype`, distinct coordinates in [0, D) per key; values [B, Hkv, Tnew, topk] and v
        [B, Hkv, Tnew, D] in the cache's dtype. Decoding is exact over whatever codes are stored; codes from
        :func:`.codes.sparse_codes` (k, topk) make it SFA of k."""
        self._check_tokens("indices", indices, self.topk, "topk", self.index_dtype)
        self._check_tokens("values", values, self.topk, "topk", self.dtype)
        self._check_tokens("v", v, self.head_dim, "head dim", self.dtype)
        if values.shape != indices.shape:
            fail("values", f"the shape of indices {tuple(indices.shape)}", f"shape {tuple(values.shape)}")
        if v.shape[2] != indices.shape[2]:
            fail("v", f"{indices.shape[2]} tokens (those of indices)", v.shape[2])
        self._check_coordinates(indices)
        check_no_nan(values=values, v=v)
        self._write(indices, values, v)

    def _check_tokens(self, name: str, t, last_dim: int, last_name: str, dtype: torch.dtype) -> None:
        """t must be a [B, Hkv, Tnew >= 1, last_dim] tensor of ``dtype`` on the cache's device; ``last_name`` says
        what last_dim is (head dim or topk)."""
        if not isinstance(t, torch.Tensor):
            fail(name, "a torch.Tensor", type(t).__name__)
        ok = t.dim() == 4 and (t.shape[0], t.shape[1], t.shape[3]) == (self.batch, self.kv_heads, last_dim)
        if not ok or t.shape[2] == 0:
            fail(name, f"shape [{self.batch}, {self.kv_heads}, Tnew >= 1, {last_dim}] (the cache's batch, KV heads "
                       f"and {last_name})", f"shape {tuple(t.shape)}")
        if t.dtype != dtype:
            fail(name, f"dtype {dtype} (the cache's)", t.dtype)
        if t.device != self.device:
            fail(name, f"a tensor on {self.device} (the cache's device)", t.device)

    def _check_coordinates(self, indices: torch.Tensor) -> None:
        """Every index in [0, D), distinct within each key (:func:`.codes.index_checks`), also within
        :func:`sieve_attn.skip_nan_checks`: the kernel reads memory by them."""
        fail_where(index_checks(indices, self.head_dim))

    def _write(self, indices: torch.Tensor, values: torch.Tensor, v: torch.Tensor) -> None:
        """Stores checked codes (indices packed here) and V of Tnew tokens after the filled part, growing first if
        they do not fit."""
        new = v.shape[2]
        if self.length + new > self.capacity:
            self._grow(self.length + new)
        stop = self.length + new
        self._packed[:, :, self.length:stop] = pack_indices(indices, self.head_dim)
        self._values[:, :, self.length:stop] = values.detach()
        self._v[:, :, self.length:stop] = v.detach()
        self.length = stop

    def _grow(self, needed: int) -> None:
        """Doubles the capacity until ``needed`` tokens fit, copying the filled part."""
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        grown = self._allocate(capacity, self.device)
        for new, old in zip(grown, (self._packed, self._values, self._v)):
            new[:, :, :self.length] = old[:, :, :self.length]
        self._packed, self._values, self._v = grown
