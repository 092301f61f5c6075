"""Per-sequence model state: a pool of slots, batch layouts, snapshots and their byte codec.

Per KDA layer a sequence holds a recurrent state ``[H, K, V]`` fp32 and the short-conv
tails of q, k and v ``[3, H*D, kernel-1]`` (the last inputs, oldest first). Per MLA layer it
holds the latent KV of every token, ``[T, kv_lora_rank + qk_rope_head_dim]``. KDA state
does not grow with context; only MLA does.

The pool is what the runner batches over: KDA tensors are ``[P, ...]`` so decode kernels
update slots in place by index; MLA latents are one buffer per (layer, slot) that grows
by doubling, so a decode step writes one row and never concatenates the cache.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field

import torch

from .config import ModelConfig

_MAGIC = b"DSST"
_VERSION = 2  # 2: CRC-32 trailer (1 had a blake2b-16 one)
CHECKSUM_BYTES = 4
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """N sequences packed along one token axis: sequence i owns tokens cu[i]:cu[i+1]."""

    slots: tuple[int, ...]  # state slot of each sequence
    starts: tuple[int, ...]  # tokens already in the slot's state before this chunk
    lengths: tuple[int, ...]  # new tokens of each sequence in this chunk
    cu_seqlens: torch.Tensor  # [N+1] int64 offsets into the packed token axis
    slot_index: torch.Tensor  # [N] int64, the slots as a tensor
    # per sequence, the offsets inside its chunk (each 0 < offset < length, increasing; () for none) at which each KDA
    # layer copies the slot's recurrent state and conv tails into ``snapshots`` (the state after that many of the
    # chunk's tokens)
    snap_at: tuple[tuple[int, ...], ...] = ()
    snapshots: dict = field(default_factory=dict, compare=False)  # slot -> {KDA layer index: [(state, conv tails)]}

    @classmethod
    def make(cls, slots, starts, lengths, device: torch.device | str = "cpu", snap_at=()) -> "BatchLayout":
        """``snap_at[i]``: the offsets for sequence i, a sequence of ints, or one int (0: none)."""
        slots, starts, lengths = tuple(map(int, slots)), tuple(map(int, starts)), tuple(map(int, lengths))
        if not (len(slots) == len(starts) == len(lengths)) or not slots:
            raise ValueError(f"slots/starts/lengths must be non-empty and equal length, got {slots}, {starts}, {lengths}")
        if len(set(slots)) != len(slots):
            raise ValueError(f"a slot appears twice in one batch: {slots}")
        if min(lengths) < 1 or min(starts) < 0:
            raise ValueError(f"lengths must be >= 1 and starts >= 0, got lengths={lengths} starts={starts}")
        snap_at = tuple((() if int(o) == 0 else (int(o),)) if isinstance(o, int) else tuple(map(int, o)) for o in snap_at)
        if snap_at and (len(snap_at) != len(lengths) or any(
                list(o) != sorted(set(o)) or any(not 0 < x < n for x in o) for o, n in zip(snap_at, lengths))):
            raise ValueError(f"snap_at must give each sequence increasing offsets inside its chunk, got {snap_at} for "
                             f"lengths {lengths}")
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        cu[1:] = torch.tensor(lengths).cumsum(0)
        return cls(slots, starts, lengths, cu.to(device), torch.tensor(slots, dtype=torch.int64, device=device),
                   snap_at if any(snap_at) else ())

    @property
    def spans(self) -> list[tuple[int, int]]:
        """(first, end) packed token offsets of each sequence."""
        ends = [0]
        for n in self.lengths:
            ends.append(ends[-1] + n)
        return list(zip(ends[:-1], ends[1:]))

    @property
    def num_seqs(self) -> int:
        return len(self.slots)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.lengths)

    @property
    def uniform(self) -> bool:
        return len(set(self.lengths)) == 1

    @property
    def fresh(self) -> bool:
        return all(s == 0 for s in self.starts)

    @property
    def last_token_index(self) -> torch.Tensor:
        """[N] packed index of each sequence's last token."""
        return self.cu_seqlens[1:] - 1


class StatePool:
    """State slots for up to ``num_slots`` sequences, for every layer of one model."""

    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        *,
        capacity: int = 256,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        kda = config.kda
        self.config = config
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.dtype = dtype
        self.kda_index = {layer: i for i, layer in enumerate(config.kda_layers)}
        self.mla_index = {layer: i for i, layer in enumerate(config.mla_layers)}
        self.kda_state = [
            torch.zeros(num_slots, kda.num_heads, kda.head_dim, kda.head_dim, dtype=torch.float32, device=self.device)
            for _ in config.kda_layers
        ]
        self.conv_state = [
            torch.zeros(num_slots, 3, kda.proj_dim, kda.conv_kernel - 1, dtype=torch.float32, device=self.device)
            for _ in config.kda_layers
        ]
        self._init_capacity = max(1, capacity)
        self.mla_kv: list[list[torch.Tensor]] = [
            [self._new_kv(self._init_capacity) for _ in range(num_slots)] for _ in config.mla_layers
        ]

    def _new_kv(self, capacity: int) -> torch.Tensor:
        return torch.zeros(capacity, self.config.mla_latent_dim, dtype=self.dtype, device=self.device)

    def reserve(self, slot: int, length: int) -> None:
        """Make every MLA buffer of ``slot`` hold at least ``length`` tokens (grows by doubling)."""
        for buffers in self.mla_kv:
            buf = buffers[slot]
            if buf.shape[0] < length:
                new = self._new_kv(max(length, 2 * buf.shape[0]))
                new[: buf.shape[0]] = buf
                buffers[slot] = new

    def reset(self, slot: int) -> None:
        """Zero a slot's state (a new sequence starts from nothing)."""
        for t in self.kda_state + self.conv_state:
            t[slot].zero_()

    def state_bytes(self, length: int) -> int:
        """Exact bytes of one sequence's state at ``length`` tokens: no padding, no spare capacity."""
        kda = sum(t[0].numel() * t.element_size() for t in self.kda_state + self.conv_state)
        per_token = self.config.mla_latent_dim * torch.empty((), dtype=self.dtype).element_size()
        return kda + len(self.mla_kv) * length * per_token

    def snapshot(self, slot: int, position: int) -> "SequenceState":
        """Copy of a slot's state after ``position`` tokens."""
        return SequenceState(
            fingerprint=self.config.fingerprint(),
            position=position,
            kda=[t[slot].clone() for t in self.kda_state],
            conv=[t[slot].clone() for t in self.conv_state],
            mla=[buffers[slot][:position].clone() for buffers in self.mla_kv],
        )

    def kda_snapshot(self, slot: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of a slot's KDA recurrent states and conv tails (fixed size, whatever the position)."""
        return [t[slot].clone() for t in self.kda_state], [t[slot].clone() for t in self.conv_state]

    def mla_rows(self, slot: int, start: int, end: int) -> list[torch.Tensor]:
        """Copies of a slot's MLA latent rows ``start:end``, one tensor per MLA layer."""
        return [buffers[slot][start:end].clone() for buffers in self.mla_kv]

    def restore(self, slot: int, state: "SequenceState") -> None:
        """Load a snapshot into ``slot``; the caller continues from ``state.position``."""
        if state.fingerprint != self.config.fingerprint():
            raise ValueError(
                f"snapshot is for model {state.fingerprint}, this pool is for {self.config.fingerprint()}"
            )
        if len(state.kda) != len(self.kda_state) or len(state.mla) != len(self.mla_kv):
            raise ValueError(
                f"snapshot layout ({len(state.kda)} KDA, {len(state.mla)} MLA layers) does not match the model "
                f"({len(self.kda_state)} KDA, {len(self.mla_kv)} MLA)"
            )
        for dst, src in zip(self.kda_state, state.kda):
            dst[slot].copy_(src)
        for dst, src in zip(self.conv_state, state.conv):
            dst[slot].copy_(src)
        self.reserve(slot, state.position)
        for buffers, src in zip(self.mla_kv, state.mla):
            buffers[slot][: state.position].copy_(src)


@dataclass
class SequenceState:
    """One sequence's complete state after ``position`` tokens (see the module docstring)."""

    fingerprint: str  # ModelConfig.fingerprint() of the model that produced it
    position: int  # tokens consumed
    kda: list[torch.Tensor]  # per KDA layer [H, K, V] fp32
    conv: list[torch.Tensor]  # per KDA layer [3, H*D, kernel-1] fp32
    mla: list[torch.Tensor]  # per MLA layer [position, kv_lora_rank + qk_rope_head_dim]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kda + self.conv + self.mla)

    def to_bytes(self) -> bytes:
        """Header (magic, version, JSON: fingerprint, position, dtypes, shapes), raw bytes, CRC-32."""
        tensors = [(f"kda.{i}", t) for i, t in enumerate(self.kda)]
        tensors += [(f"conv.{i}", t) for i, t in enumerate(self.conv)]
        tensors += [(f"mla.{i}", t) for i, t in enumerate(self.mla)]
        return encode_tensors(_MAGIC, {"fingerprint": self.fingerprint, "position": self.position}, tensors)

    @classmethod
    def from_bytes(cls, data: bytes, expected_fingerprint: str | None = None) -> "SequenceState":
        """Decode and verify; raises ValueError on a bad magic, version, checksum or layout."""
        header, tensors = decode_tensors(data, _MAGIC, what="state snapshot")
        if expected_fingerprint is not None and header["fingerprint"] != expected_fingerprint:
            raise ValueError(f"snapshot is for model {header['fingerprint']}, expected {expected_fingerprint}")
        groups: dict[str, list[torch.Tensor]] = {"kda": [], "conv": [], "mla": []}
        for name, t in tensors:
            kind = name.split(".")[0]
            if kind not in groups:
                raise ValueError(f"state snapshot has an unknown tensor {name!r}")
            groups[kind].append(t)
        return cls(header["fingerprint"], header["position"], groups["kda"], groups["conv"], groups["mla"])


def encode_tensors(magic: bytes, meta: dict, tensors: list[tuple[str, torch.Tensor]]) -> bytes:
    """A self-describing blob: ``magic`` (4 bytes), version, JSON header (``meta`` plus every
    tensor's name, dtype and shape), the raw tensor bytes, and a CRC-32 (4 bytes, little-endian)
    of all of it. Nothing in it is ever unpickled: :func:`decode_tensors` reads the header and
    the raw bytes. The checksum is against corruption and truncation (what reaches Redis or the
    network is never trusted for more than its layout); it is a CRC for speed: a handoff encodes
    and decodes ~0.5 MB per request."""
    if len(magic) != 4:
        raise ValueError(f"magic must be 4 bytes, got {magic!r}")
    if "tensors" in meta:
        raise ValueError("meta must not have a 'tensors' key (the codec writes it)")
    header = {**meta, "tensors": [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors]}
    head = json.dumps(header, separators=(",", ":")).encode()
    parts = [magic + struct.pack("<HI", _VERSION, len(head)) + head, *(_tensor_bytes(t) for _, t in tensors)]
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return b"".join([*parts, struct.pack("<I", crc)])  # one copy of the tensors' bytes


def decode_tensors(data: bytes, magic: bytes, *, what: str = "blob") -> tuple[dict, list[tuple[str, torch.Tensor]]]:
    """Verify and decode an :func:`encode_tensors` blob: (header, [(name, tensor)]).

    Raises ValueError naming ``what`` on a bad magic, version, checksum, header or length;
    the tensors own their memory (writable, independent of ``data``)."""
    if len(data) < 4 + 6 + CHECKSUM_BYTES or data[:4] != magic:
        raise ValueError(f"not a deltaserve {what} (bad magic or too short)")
    payload = memoryview(data)[:-CHECKSUM_BYTES]  # no copy: each tensor copies its own bytes once
    if zlib.crc32(payload) != struct.unpack_from("<I", data, len(payload))[0]:
        raise ValueError(f"{what} checksum mismatch (corrupt or truncated)")
    version, head_len = struct.unpack_from("<HI", payload, 4)
    if version != _VERSION:
        raise ValueError(f"{what} version {version} is not supported (expected {_VERSION})")
    try:
        header = json.loads(bytes(payload[10 : 10 + head_len]))
        specs = [(str(n), str(d), [int(x) for x in shape]) for n, d, shape in header["tensors"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{what} header is malformed: {e}") from e
    offset = 10 + head_len
    tensors = []
    for name, dtype_name, shape in specs:
        dtype = _DTYPES.get(dtype_name)
        if dtype is None:
            raise ValueError(f"{what} tensor {name} has unsupported dtype {dtype_name!r}")
        if any(x < 0 for x in shape):
            raise ValueError(f"{what} tensor {name} has a negative dimension {shape}")
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        raw = bytearray(payload[offset : offset + n])
        if len(raw) != n:
            raise ValueError(f"{what} tensor {name} is truncated")
        tensors.append((name, torch.frombuffer(raw, dtype=dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)))
        offset += n
    if offset != len(payload):
        raise ValueError(f"{what} has {len(payload) - offset} trailing bytes")
    return header, tensors


def _tensor_bytes(t: torch.Tensor) -> memoryview | bytes:
    """The tensor's raw bytes, without a copy when it is a contiguous CPU tensor."""
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.numpy().reshape(-1)).cast("B") if t.numel() else b""
