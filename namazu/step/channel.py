"""How a step message reaches rank 0's worker process: a shared-memory ring plus a 17-byte notice on the pipe.

The engine writes each step's message (`step_delta.py`) into a shared-memory segment it created and
sends only (offset, length) over the executor's pipe, which the worker already waits on (so a dead
worker is still noticed the same way, and commands and steps stay in one order). The worker copies the
message out before it runs the step. A region is in use from `put` until the step's result is
collected (the worker has read it by then); at most two steps are in flight (async scheduling), so
a ring of a few step sizes never waits. A message that does not fit beside the ones in flight goes
over the pipe itself (`put` returns None): slower, never blocked.

The segment is unlinked when the executor closes or fails; if the engine process dies without either,
multiprocessing's resource tracker (a separate process the workers share) unlinks it.
"""
from __future__ import annotations

import struct
from collections import deque
from multiprocessing import shared_memory

_NOTICE = struct.Struct("<cQQ")
NOTICE_TAG = b"S"      # first byte of a notice (a pickle starts with 0x80, a step message with its magic)


class StepRing:
    """Engine side: the segment and which of its byte ranges hold messages not yet collected."""

    def __init__(self, size: int):
        self.shm = shared_memory.SharedMemory(create=True, size=size)
        self.size = size
        self._head = 0
        self._live: deque[tuple[int, int]] = deque()     # (start, end) in submission order
        self.closed = False

    @property
    def name(self) -> str:
        return self.shm.name

    def put(self, message: bytes) -> bytes | None:
        """Writes `message` into the ring; returns the notice to send, or None when it does not fit."""
        n = len(message)
        # From the start whenever nothing is in flight: the messages then reuse the same few pages, which
        # stay mapped and cached in both processes (a fresh page costs a fault on each side).
        start = 0 if not self._live or self._head + n > self.size else self._head
        end = start + n
        if self.closed or end > self.size or any(s < end and start < e for s, e in self._live):
            return None
        self.shm.buf[start:end] = message
        self._live.append((start, end))
        self._head = end
        return _NOTICE.pack(NOTICE_TAG, start, n)

    def release_oldest(self) -> None:
        """The oldest message in flight was read (its step's result, or error, came back)."""
        if self._live:
            self._live.popleft()

    def clear(self) -> None:
        self._live.clear()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.shm.close()
        try:
            self.shm.unlink()
        except FileNotFoundError:
            pass


class StepReader:
    """Worker side: attaches to the engine's segment by name and copies messages out of it."""

    def __init__(self, name: str):
        self.shm = shared_memory.SharedMemory(name=name)

    def read(self, notice: bytes) -> bytearray:
        _, start, n = _NOTICE.unpack(notice)
        if start + n > self.shm.size:
            raise ValueError(f"step notice ({start}, {n}) outside the {self.shm.size}-byte segment")
        return bytearray(self.shm.buf[start:start + n])

    def close(self) -> None:
        self.shm.close()


def is_notice(raw: bytes) -> bool:
    return len(raw) == _NOTICE.size and raw[:1] == NOTICE_TAG


def ring_size(max_num_seqs: int, max_num_batched_tokens: int, num_speculative_tokens: int, vocab_size: int,
              max_blocks_per_seq: int) -> int:
    """Three of the largest step messages (every row masked, every table sent whole), at least 1 MiB."""
    rows = max_num_seqs * (1 + num_speculative_tokens)
    largest = (4096 + 128 * max_num_seqs + 8 * max_num_batched_tokens + rows * 4 * (-(-vocab_size // 32))
               + 8 * max_num_seqs * max_blocks_per_seq)
    return max(1 << 20, 3 * largest)
