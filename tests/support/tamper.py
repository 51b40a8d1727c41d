"""A TCP proxy between two members of a distributed cache, as a node on the path would be: it records every byte
each way, and can flip one byte of what the owner answers (the `flip`-th byte of a connection's answers, counted
from its first byte). Listens on loopback only."""

from __future__ import annotations

import socket
import threading

HELLO = 100  # bytes of an owner's answer to a hello, at most (flip_all leaves them alone)


class TamperProxy:
    def __init__(self, upstream: tuple[str, int], host: str = "127.0.0.1", port: int = 0):
        self.upstream = upstream
        self.flip: int | None = None  # offset in each connection's answer stream whose byte is flipped
        self.flip_all = False  # flip a byte in every chunk an owner sends past its connection's hello (every answer)
        self.asked = bytearray()  # every byte askers sent, all connections in turn
        self.answered = bytearray()  # every byte owners sent (before any flip)
        self.requests: list[bytes] = []  # each connection's asker bytes
        self.flipped = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server((host, port))
        self.address = self._listener.getsockname()[:2]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def peer(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                asker, _ = self._listener.accept()
            except OSError:
                return
            owner = socket.create_connection(self.upstream)
            sent = bytearray()
            with self._lock:
                self.requests.append(sent)  # (filled as the asker writes)
            threading.Thread(target=self._pipe, args=(asker, owner, sent, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(owner, asker, None, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, record: bytearray | None, answers: bool) -> None:
        seen = 0
        try:
            while data := src.recv(65536):
                with self._lock:
                    (self.answered if answers else self.asked).extend(data)
                    if record is not None:
                        record.extend(data)
                if answers and (self.flip_all and seen + len(data) > HELLO
                                or self.flip is not None and seen <= self.flip < seen + len(data)):
                    data = bytearray(data)
                    data[max(HELLO - seen, len(data) // 2) if self.flip_all else self.flip - seen] ^= 0x01
                    self.flipped += 1
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._listener.close()
