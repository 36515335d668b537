"""The node's host-memory backup file: its format, how the agent writes it and how workers read it.

One safetensors file per node under /dev/shm, owned by the node agent so it outlives any worker
crash: the dense weights (`dense.<name>`, for ranks that restart) and the routed experts of the
node's share (`layer<L>.expert<E>.w13|w2`, L = MoE layer index), in the served dtype. The whole layout (the
header and every tensor's offset) is fixed before any weight is written, so the agent writes the
file piece by piece and announces each piece as it lands: a fault soon after start restores
from what is already written instead of from disk. A reader reads an expert straight into its
destination with positioned reads (no mapping, no intermediate copy), checksumming each chunk as
it lands; other nodes ask the agent, which reads it the same way.

Nothing is left behind (at DeepSeek-V3 size the file is ~160 GB of RAM per node): its name
carries the owner process (`pid<PID>-<start time>`, the start time tells a reused pid), a
guard process removes it the moment its owner is gone, however it ended (`guard_backup`; SIGKILL
included), and an agent that starts removes the files of owners that are gone
(`reap_stale_backups`) in case the guard was killed too. Files without an owner tag (written by
older versions) are left alone.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np
import psutil
import torch
from safetensors import safe_open

from elastic_ep.model.checkpoint import CheckpointReader

SHM_DIR = "/dev/shm"
DENSE_PREFIX = "dense."
# safetensors' names of the dtypes a backup holds (the served dtype: --dtype)
ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
READ_CHUNK_BYTES = 2**20  # read, then checksummed while still in cache
FILE_PREFIX = "elastic-ep-backup-"
OWNED_NAME = re.compile(rf"^{FILE_PREFIX}.+-pid(\d+)-(\d+)-[^-]+\.safetensors$")
# Waits until its stdin closes (its owner is gone: only the owner holds the pipe), then removes the file.
_GUARD = "import os, sys\nsys.stdin.buffer.read()\ntry:\n    os.unlink(sys.argv[1])\nexcept OSError:\n    pass\n"


def _start_cs(pid: int) -> int:
    """The process's start time in centiseconds since the epoch (pid plus this names one process)."""
    return int(psutil.Process(pid).create_time() * 100)


def owner_tag(pid: int) -> str:
    return f"pid{pid}-{_start_cs(pid)}"


def owner_alive(path: str) -> bool | None:
    """Whether the process named in a backup file's name still runs (None: the name has no owner tag)."""
    match = OWNED_NAME.match(os.path.basename(path))
    if match is None:
        return None
    pid, start_cs = int(match[1]), int(match[2])
    try:
        return abs(_start_cs(pid) - start_cs) <= 1
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def backup_dir(directory: str = SHM_DIR) -> str:
    """Where backup files go: `directory` (RAM-backed /dev/shm by default), else the temp dir."""
    return directory if os.path.isdir(directory) else tempfile.gettempdir()


def reap_stale_backups(directory: str = SHM_DIR) -> list[str]:
    """Remove the backup files in backup_dir(directory) whose owner process is gone; returns their paths."""
    removed = []
    for path in sorted(Path(backup_dir(directory)).glob(f"{FILE_PREFIX}*.safetensors")):
        if owner_alive(str(path)) is False:
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            removed.append(str(path))
    return removed


def guard_backup(path: str) -> subprocess.Popen:
    """A small process that removes `path` once this process is gone, whether it exits, crashes or
    is SIGKILLed: it reads a pipe only this process holds open. Close its stdin to let it go (it
    then removes the file, if still there, and exits)."""
    return subprocess.Popen([sys.executable, "-I", "-c", _GUARD, path], stdin=subprocess.PIPE,
                            start_new_session=True)


def backup_key(layer: int, expert: int, part: str) -> str:
    """Tensor name of an expert in a backup file (layer = MoE layer index, part w13 or w2)."""
    return f"layer{layer}.expert{expert}.{part}"


class BackupWriter:
    """A backup file of `items` (MoE layer index, expert) of `reader`'s checkpoint in `directory`
    (RAM-backed /dev/shm by default), plus the dense weights when `dense`: `dense_state` when given
    (a copy already in host memory, `read_dense`), else read from the checkpoint. The file exists
    at its full size from the start; `write_dense` and `write_experts` fill it in, and what they
    wrote can be read at once (by this process or another)."""

    def __init__(self, reader: CheckpointReader, items: list[tuple[int, int]], node: str,
                 directory: str = SHM_DIR, dense: bool = True, dense_state: dict[str, torch.Tensor] | None = None):
        self.reader = reader
        cfg = reader.config
        if dense and dense_state is None:
            dense_state = reader.dense_state()
        self.dense = {DENSE_PREFIX + name: t.contiguous() for name, t in (dense_state or {}).items()} if dense else {}
        specs = {name: (list(t.shape), t.dtype) for name, t in self.dense.items()}
        for layer, expert in items:
            specs[backup_key(layer, expert, "w13")] = ([2 * cfg.moe_intermediate_size, cfg.hidden_size], reader.dtype)
            specs[backup_key(layer, expert, "w2")] = ([cfg.hidden_size, cfg.moe_intermediate_size], reader.dtype)
        header, self.offsets, data_bytes = _layout(specs)
        prefix = f"{FILE_PREFIX}{node}-{owner_tag(os.getpid())}-"  # named for this process, its owner
        self._fd, self.path = tempfile.mkstemp(prefix=prefix, suffix=".safetensors", dir=backup_dir(directory))
        self.nbytes = len(header) + data_bytes
        os.ftruncate(self._fd, self.nbytes)
        os.pwrite(self._fd, header, 0)

    def write_dense(self) -> None:
        for name, t in self.dense.items():
            self._write(name, [t])

    def write_experts(self, items: list[tuple[int, int]], device_kind: str = "cpu") -> list[int]:
        """Copy these experts from the checkpoint into their places in the file; returns the
        checksum of each as read (`expert_checksum` of the kind ranks on `device_kind` take)."""
        moe_layers = self.reader.config.moe_layers
        checksums = []
        for layer, expert in items:
            gate, up, down = self.reader.expert_projections(moe_layers[layer], expert)
            self._write(backup_key(layer, expert, "w13"), [gate, up])
            self._write(backup_key(layer, expert, "w2"), [down])
            if device_kind == "cpu":  # CRC32 runs on: no copy of w13
                checksums.append(zlib.crc32(as_bytes(down), zlib.crc32(as_bytes(up), zlib.crc32(as_bytes(gate)))))
            else:
                checksums.append(expert_checksum(torch.cat([gate, up]), down, device_kind))
        return checksums

    def _write(self, name: str, parts: list[torch.Tensor]) -> None:
        offset = self.offsets[name]
        buffers = [memoryview(as_bytes(p)) for p in parts]
        if os.pwritev(self._fd, buffers, offset) != sum(b.nbytes for b in buffers):
            raise OSError(f"short write of {name} to {self.path}")

    def close(self) -> None:
        os.close(self._fd)


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of a CPU tensor of any dtype as a uint8 array (a view when it is contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _layout(specs: dict[str, tuple[list[int], torch.dtype]]) -> tuple[bytes, dict[str, int], int]:
    """The safetensors header for tensors of `specs` (name -> shape, dtype) laid out in order,
    each tensor's absolute file offset, and the bytes of data after the header."""
    entries, data_offsets, at = {}, {}, 0
    for name, (shape, dtype) in specs.items():
        n = int(np.prod(shape)) * dtype.itemsize
        entries[name] = {"dtype": ST_DTYPES[dtype], "shape": shape, "data_offsets": [at, at + n]}
        data_offsets[name] = at
        at += n
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    return struct.pack("<Q", len(text)) + text, {k: start + v for k, v in data_offsets.items()}, at


def write_backup(
    reader: CheckpointReader, items: list[tuple[int, int]], node: str, directory: str = SHM_DIR,
    dense: bool = True,
) -> tuple[str, int]:
    """The whole backup file at once (see BackupWriter); returns (path, bytes)."""
    writer = BackupWriter(reader, items, node, directory, dense)
    try:
        writer.write_dense()
        writer.write_experts(items)
    finally:
        writer.close()
    return writer.path, writer.nbytes


def _header(path: str) -> tuple[int, dict]:
    """(bytes before the data, the header's tensor entries) of a safetensors file."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return 8 + size, header


def expert_offsets(path: str, items: list[tuple[int, int]]
                   ) -> tuple[torch.dtype, list[tuple[tuple[int, list[int]], tuple[int, list[int]]]]]:
    """The dtype the experts of a backup file are stored in (float32 when it holds none) and, per
    (layer, expert) of `items`, (offset, shape) of its w13 and of its w2, for reading it straight
    into place; one read of the header. Raises KeyError for a missing item."""
    start, header = _header(path)
    names = {v: k for k, v in ST_DTYPES.items()}
    dtype = next((names[e["dtype"]] for name, e in header.items() if not name.startswith(DENSE_PREFIX)),
                 torch.float32)
    out = []
    for layer, expert in items:
        w13, w2 = header.get(backup_key(layer, expert, "w13")), header.get(backup_key(layer, expert, "w2"))
        if w13 is None or w2 is None:
            raise KeyError(f"layer {layer} expert {expert} is not in this node's backup")
        out.append(((start + w13["data_offsets"][0], w13["shape"]), (start + w2["data_offsets"][0], w2["shape"])))
    return dtype, out


def expert_checksum(w13: torch.Tensor, w2: torch.Tensor, device_kind: str | None = None) -> int:
    """A checksum of the bytes of one expert (w13 [2I, H], w2 [H, I]), equal iff the same weights
    in the same dtype, of the kind ranks on `device_kind` take (default: w13's device). On the CPU:
    CRC32 over the bytes in place (no copy), the same one `read_checked` takes as a slot is filled
    from a backup file. On an accelerator: taken on the device (nothing is copied to the host),
    the sum of its 32-bit words, each times its position, mod 2^64; a change of any one word
    always changes it. Every rank of a group runs on one device kind, so checksums compared
    within a group are of one kind; an agent takes its reference checksums on the CPU in the
    kind of the group's device (the same integers)."""
    if (device_kind or w13.device.type) == "cpu":
        return zlib.crc32(as_bytes(w2), zlib.crc32(as_bytes(w13)))
    total = 0
    for t in (w13, w2):
        flat = t.contiguous().reshape(-1)
        words = flat.view(torch.int32) if flat.numel() * flat.element_size() % 4 == 0 else flat.view(torch.uint8)
        position = torch.arange(1, words.numel() + 1, dtype=torch.int64, device=words.device)
        total = (total * 1_000_003 + int((words.to(torch.int64) * position).sum())) % 2**64
    return total


def read_checked(fd: int, offset: int, dst: torch.Tensor, crc: int = 0) -> int:
    """Fill `dst` (contiguous, on the CPU, e.g. an expert slot) from file `fd` at `offset`, a chunk at
    a time, and return `crc` continued (zlib CRC32) over its bytes, each chunk checksummed right
    after it landed, while in cache: a restored slot is verified without a second pass over memory."""
    if not dst.is_contiguous():
        raise ValueError("read_checked fills a contiguous tensor in place")
    buf = memoryview(as_bytes(dst))
    for at in range(0, buf.nbytes, READ_CHUNK_BYTES):
        chunk = buf[at : at + READ_CHUNK_BYTES]
        if os.preadv(fd, [chunk], offset + at) != chunk.nbytes:
            raise OSError(f"short read of {chunk.nbytes} bytes at {offset + at}")
        crc = zlib.crc32(chunk, crc)
    return crc


def read_backup(path: str, items: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [n, 2I, H], w2 [n, H, I] of `items` from a backup file. Raises KeyError for a missing item."""
    dtype, entries = expert_offsets(path, items)
    (_, s13), (_, s2) = entries[0] if entries else ((0, [0, 0]), (0, [0, 0]))
    w13, w2 = torch.empty(len(items), *s13, dtype=dtype), torch.empty(len(items), *s2, dtype=dtype)
    fd = os.open(path, os.O_RDONLY)
    try:
        for i, ((o13, _), (o2, _)) in enumerate(entries):
            read_checked(fd, o13, w13[i])
            read_checked(fd, o2, w2[i])
    finally:
        os.close(fd)
    return w13, w2


def read_dense(path: str) -> dict[str, torch.Tensor]:
    """The dense tensors of a backup file (name -> tensor). Raises KeyError when it has none."""
    with safe_open(path, framework="pt") as f:
        state = {k[len(DENSE_PREFIX):]: f.get_tensor(k) for k in f.keys() if k.startswith(DENSE_PREFIX)}
    if not state:
        raise KeyError(f"{path} holds no dense weights")
    return state
