"""A free loopback port, for a server ratchet starts (a vLLM server: ratchet/rollout/vllm.py
`ServerProcess`) and for tests that start servers. A one-process DeepSpeed group needs none
(`ratchet.train.deepspeed_trainer.init_distributed`: an in-memory store).

    port = free_port()        # bound and released here; the caller's process binds it next

The port is free when asked; another process can take it before the caller binds it (a window of
milliseconds on loopback). `ServerProcess`, given its command as a function of the port, starts a
server that lost that race again on another free port; the tests' servers do not retry.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
