"""ratchet's exceptions cross process boundaries intact (`ratchet.errors.picklable`), and which of
them a task retries (`ratchet.errors.is_transient`).

An exception whose __init__ takes other arguments than its message used to unpickle as
`cls(message)`: a TypeError, which a ProcessPoolExecutor reports as BrokenProcessPool, hiding
the error (bench.multiturn lost a held-out evaluation's IntegrityError that way).
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import pickle
import signal
import urllib.error
from concurrent.futures import ProcessPoolExecutor

import pytest

from ratchet.data.gates import GateError, GateReport
from ratchet.errors import is_transient
from ratchet.monitor import Alarm, HealthCheckFailed
from ratchet.rollout.engine import PromptTooLong
from ratchet.rollout.server import BadRequest
from ratchet.run import Interrupted
from ratchet.store.base import IntegrityError
from ratchet.store.lease import LeaseHeld
from ratchet.train.checkpoint import NoUsableCheckpoint

ALARM = Alarm(monitor="entropy_collapse", signal="sampled_entropy", wave=7, waves=(6, 7), values=(0.01, 0.02),
              threshold=0.05, rule="below")
RAISED = [
    IntegrityError("runs/r1/waves/000003/scored.parquet", "ab" * 32, "cd" * 32, where="score_wave", hint="rewritten"),
    Interrupted(signal.SIGTERM),
    HealthCheckFailed([ALARM]),
    GateError(GateReport(gate="wave", success=False, rows=3, checks=["reward_in_range"], failures=[], source="s.parquet")),
    LeaseHeld("r1", {"owner": "someone", "host": "h", "pid": 12, "heartbeat_at": 100.0, "ttl_s": 30}, now=110.0),
    NoUsableCheckpoint("r1", "file:///tmp/store", [("000004", "sha256 mismatch")]),
    BadRequest("max_tokens too large", param="max_tokens", status=422),
    PromptTooLong(3, 600, 48, 512, count=2, task_id="imported-x/long"),
]


@pytest.mark.parametrize("exc", RAISED, ids=lambda e: type(e).__name__)
def test_an_exception_unpickles_as_itself(exc):
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc)
    assert str(back) == str(exc)
    assert vars(back) == vars(exc)


def _corrupt_read(key: str):
    raise IntegrityError(key, "ab" * 32, "cd" * 32, where="evaluate")


def test_a_child_process_error_reaches_the_parent_as_itself():
    """Through a real spawned process pool: the parent sees the IntegrityError, not BrokenProcessPool."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        future = pool.submit(_corrupt_read, "envs/python_functions/v1/heldout_passed.parquet")
        with pytest.raises(IntegrityError, match="heldout_passed.parquet' in evaluate") as e:
            future.result()
    assert e.value.key == "envs/python_functions/v1/heldout_passed.parquet"


# --- which failures are retried (is_transient) ---------------------------------------------------

@pytest.mark.parametrize("exc", [
    ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"),    # a store or server being restarted
    ConnectionResetError(), TimeoutError("timed out"),                  # no errno: socket timeouts, http.client
    OSError(errno.EHOSTUNREACH, "No route to host"), OSError(errno.ETIMEDOUT, "Connection timed out"),
    BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable"), OSError(errno.EIO, "I/O error"),
    urllib.error.URLError(ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")),   # urlopen's wrapper
], ids=repr)
def test_an_os_error_of_the_network_is_transient(exc):
    assert is_transient(exc)


@pytest.mark.parametrize("code", [errno.ENAMETOOLONG, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EINVAL],
                         ids=errno.errorcode.get)
def test_an_os_error_that_fails_the_same_way_every_time_is_not_retried(code):
    """Found by review: any OSError but five subclasses was retried, a read-only disk or a name too
    long as well: the task's retries only repeated the same traceback."""
    assert not is_transient(OSError(code, os.strerror(code)))
    assert not is_transient(urllib.error.URLError("unknown url type: foo"))


def test_a_key_too_long_for_the_filesystem_is_not_retried(tmp_path):
    from ratchet.store import open_store

    store = open_store(tmp_path / "store")
    with pytest.raises(OSError) as e:
        store.put_bytes("envs/imported-" + "x" * 250 + "/tasks.parquet", b"1")
    assert e.value.errno == errno.ENAMETOOLONG and not is_transient(e.value)


def _s3_error(status: int, code: str):
    from minio.error import S3Error
    from urllib3 import HTTPResponse

    return S3Error(HTTPResponse(status=status), code, "m", "/b/k", None, None)


def test_a_store_that_answers_5xx_or_429_is_transient_whatever_its_error_code():
    """Found by review: only four S3 codes were transient. MinIO's own 503s (SlowDownWrite, and
    XMinioServerNotInitialized while it restarts) and a proxy's 502 page (InvalidResponseError: not
    XML) failed a checkpoint's multipart upload at once, a POST urllib3 does not retry itself."""
    from minio.error import InvalidResponseError, ServerError

    for busy in (_s3_error(503, "SlowDownWrite"), _s3_error(503, "XMinioServerNotInitialized"),
                 _s3_error(500, "XMinioBackendDown"), _s3_error(429, "TooManyRequests"),
                 _s3_error(400, "RequestTimeout"),                    # a named code, whatever its status
                 InvalidResponseError(502, "text/html", "<html>502 Bad Gateway</html>"),
                 InvalidResponseError(504, "text/html", None), ServerError("server failed", 503)):
        assert is_transient(busy), busy
    for refused in (_s3_error(403, "AccessDenied"), _s3_error(404, "NoSuchBucket"), _s3_error(501, "NotImplemented"),
                    InvalidResponseError(400, "text/html", "bad request"), ServerError("not modified", 304)):
        assert not is_transient(refused), refused
