"""A free loopback port, for a process ratchet starts that listens on one (a vLLM server, the GPU
check's DeepSpeed rendezvous) and for tests that start servers. A one-process DeepSpeed group needs
none (`ratchet.train.deepspeed_trainer.init_distributed`: an in-memory store).

    port = free_port()        # bound and released here; the caller's process binds it next

The port is free when asked; another process can take it before the caller binds it (a window of
milliseconds on loopback; neither caller retries such a start today).
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
