"""The S3 store across an outage of its server, and a store that lost its objects.

A moto S3 server of our own on loopback, stopped and restarted on the same port (moto keeps
its objects in this process, so a restart is an outage, not a wipe)."""

from __future__ import annotations

import socket
import threading
import time
import uuid

import pytest

from ratchet.errors import StoreUnavailable
from ratchet.net import free_port
from ratchet.store import S3Store, StoreLost, open_store


@pytest.fixture
def own_server(monkeypatch):
    from moto.server import ThreadedMotoServer

    port = free_port()
    servers = [ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)]
    servers[0].start()
    for k, v in {"RATCHET_S3_ENDPOINT": f"127.0.0.1:{port}", "RATCHET_S3_SECURE": "0", "AWS_ACCESS_KEY_ID": "t",
                 "AWS_SECRET_ACCESS_KEY": "t", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)

    class Server:
        def stop(self):
            servers[-1].stop()

        def start(self):
            servers.append(ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False))
            servers[-1].start()

    yield Server()
    servers[-1].stop()


def test_an_outage_within_the_budget_is_survived(own_server):
    store = S3Store(f"s3://outage/{uuid.uuid4().hex[:8]}", retry_budget_s=60)
    store.put_bytes("before", b"1")
    own_server.stop()
    back = threading.Timer(3.0, own_server.start)   # the server is down for 3 s, mid-operation
    back.start()
    t0 = time.monotonic()
    store.put_bytes("during", b"2")
    back.join()
    assert time.monotonic() - t0 >= 2.5                               # it did wait the outage out
    assert store.get_bytes("before") == b"1" and store.get_bytes("during") == b"2"
    assert store.list() == ["before", "during"]                       # nothing lost or doubled


def test_an_outage_past_the_budget_is_one_clear_error(own_server):
    store = S3Store(f"s3://outage/{uuid.uuid4().hex[:8]}", retry_budget_s=2)
    own_server.stop()
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable) as e:
        store.put_bytes("k", b"1")
    message = str(e.value)
    assert "\n" not in message and store.root_uri in message and "during put 'k'" in message
    assert "retry budget 2 s" in message and time.monotonic() - t0 < 20
    own_server.start()


def test_a_store_that_never_answers_fails_within_its_budget(monkeypatch):
    """Found by review: a server that accepts connections and never answers (a hung MinIO, a half-open
    proxy) held one call for up to ~30 min (minio's pool: 300 s timeouts, 5 retries), the retry budget
    checked only between calls. A listening socket that nobody accepts on: connections complete in the
    kernel, requests are never answered."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        for k, v in {"RATCHET_S3_ENDPOINT": f"127.0.0.1:{silent.getsockname()[1]}", "RATCHET_S3_SECURE": "0",
                     "AWS_ACCESS_KEY_ID": "t", "AWS_SECRET_ACCESS_KEY": "t", "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(k, v)
        raised = []
        opening = threading.Thread(target=lambda: raised.append(_raised(S3Store, "s3://hung/p", retry_budget_s=1)),
                                   daemon=True)
        opening.start()
        opening.join(timeout=120)            # a generous bound: it gives up after about 5 s
        assert not opening.is_alive(), "S3Store blocked past its retry budget on a server that never answers"
    assert isinstance(raised[0], StoreUnavailable) and "during create bucket" in str(raised[0])
    assert "Timeout" in str(raised[0])


def _raised(fn, *args, **kw) -> BaseException | None:
    try:
        fn(*args, **kw)
    except Exception as e:  # noqa: BLE001
        return e
    return None


def test_a_store_emptied_under_a_run_is_lost_not_fresh(own_server):
    uri = f"s3://emptied-{uuid.uuid4().hex[:8]}/p"
    store = open_store(uri)
    store.put_bytes("runs/r/waves/000000/trajectories.parquet", b"x")
    for obj in store.client.list_objects(store.bucket, recursive=True):     # the server comes back empty
        store.client.remove_object(store.bucket, obj.object_name)
    store.client.remove_bucket(store.bucket)
    with pytest.raises(StoreLost, match="lost the objects it held"):
        open_store(uri)
    assert not store.client.bucket_exists(store.bucket) or store.list() == []   # nothing written after


OPENER = """
import sys, time
from ratchet.store import IDENTITY_KEY, local, open_store
write = local.LocalStore._write
def slow(self, key, *a):        # widen the window between reading "no marker" and writing one
    if key == IDENTITY_KEY:
        time.sleep(0.5)
    return write(self, key, *a)
local.LocalStore._write = slow
open_store(sys.argv[1])
time.sleep(1.5)                  # both have written by now
open_store(sys.argv[1])          # each task of a run opens its store again
print("ok")
"""


def test_two_processes_opening_one_fresh_store_agree_on_its_identity(tmp_path):
    """Found by review: both read "no identity marker", both wrote one, and the process whose id was
    overwritten stopped at its next open_store with a false StoreLost ("was the bucket emptied?")."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    procs = [subprocess.Popen([sys.executable, "-c", OPENER, str(tmp_path / "store")], cwd=root, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and [o for o, _ in outs] == ["ok\n", "ok\n"], outs
