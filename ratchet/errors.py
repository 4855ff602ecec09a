"""Which failures are worth a retry: the one rule every Prefect task's retries follow.

    from ratchet.errors import is_transient
    is_transient(ConnectionResetError())        # True: the network may come back
    is_transient(ValueError("bad config"))      # False: the same input fails the same way

A deterministic error (bad settings, a failed gate, corrupt data, a lost lease, a bug) fails
the same way on every attempt: retrying it only buries its message under repeated tracebacks.
Transient ones are I/O that may succeed later: a dropped connection, a timeout, a store that
answers 5xx or is briefly down. Anything not known to be transient is treated as deterministic.
"""

from __future__ import annotations

import errno
import functools
import socket
import ssl
import urllib.error

# An OSError is transient only for an errno that says "the other side or the network, for now": a name
# too long, a read-only or full disk, a bad argument fail the same way on every try.
_TRANSIENT_ERRNOS = {
    errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ETIMEDOUT, errno.EIO, errno.ESTALE, errno.ENOBUFS,
    errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.EPIPE, errno.ENOTCONN, errno.ESHUTDOWN,
    errno.EHOSTUNREACH, errno.EHOSTDOWN, errno.ENETUNREACH, errno.ENETDOWN, errno.ENETRESET,
    socket.EAI_AGAIN,   # a name lookup that failed for now (not EAI_NONAME: no such host)
}
# Raised with no errno (socket timeouts, http.client's RemoteDisconnected) or one of their own (ssl).
_TRANSIENT_OS = (ConnectionError, TimeoutError, ssl.SSLEOFError, ssl.SSLZeroReturnError)
_SERVER_CODES = {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout"}


class TransientError(RuntimeError):
    """Raised by ratchet for a condition that may clear by itself (retry it)."""


class StoreUnavailable(RuntimeError):
    """The store stayed unreachable past its retry budget. Not retried again by a task: the
    budget was the retry; one line names the store and the operation."""


def picklable(cls):
    """Class decorator for an exception whose `__init__` takes other arguments than its message:
    pickling it (a process pool, Ray, Prefect's result store) keeps the arguments it was raised with
    and calls `__init__` with them again. Without it, unpickling calls `cls(message)`, which fails
    with a TypeError that hides the error: a ProcessPoolExecutor then reports only BrokenProcessPool.
    A subclass with an `__init__` of its own needs the decorator too."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._init_args = (args, kwargs)   # set last: a decorated subclass's arguments win over its base's

    def __reduce__(self):
        return _rebuild, (type(self), *self._init_args)

    cls.__init__, cls.__reduce__ = __init__, __reduce__
    return cls


def _rebuild(cls, args: tuple, kwargs: dict):
    return cls(*args, **kwargs)


def is_transient(exc: BaseException | None) -> bool:
    if exc is None or isinstance(exc, StoreUnavailable):
        return False
    if isinstance(exc, TransientError):
        return True
    if isinstance(exc, OSError):
        return _transient_os(exc)
    try:
        from urllib3.exceptions import HTTPError as Urllib3Error
    except ImportError:  # pragma: no cover - urllib3 comes with minio and requests
        Urllib3Error = ()
    if Urllib3Error and isinstance(exc, Urllib3Error):
        return True
    name = type(exc).__name__                # minio's, without importing minio here
    if name == "S3Error" and getattr(exc, "code", None) in _SERVER_CODES:
        return True
    if name in ("S3Error", "ServerError", "InvalidResponseError"):
        # by the HTTP status, not the error code: MinIO has 503 codes of its own (SlowDownWrite,
        # XMinioServerNotInitialized while it restarts), and a proxy's 502/504 page is not S3 XML at all
        return _server_busy(_http_status(exc))
    return False


def _transient_os(exc: OSError) -> bool:
    if isinstance(exc, urllib.error.HTTPError):       # an answer: by its status
        return _server_busy(exc.code)
    if isinstance(exc, urllib.error.URLError):        # urlopen's wrapper of the network error
        return isinstance(exc.reason, BaseException) and is_transient(exc.reason)
    return isinstance(exc, _TRANSIENT_OS) or exc.errno in _TRANSIENT_ERRNOS


def _http_status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)            # S3Error
    for status in (getattr(response, "status", None), getattr(exc, "status_code", None),   # ServerError
                   getattr(exc, "_code", None)):          # InvalidResponseError
        if isinstance(status, int):
            return status
    return None


def _server_busy(status: int | None) -> bool:
    """A 5xx (the server failed, or a proxy found it down) or 429 (too many requests) may clear; not 501:
    the server does not implement the request."""
    return status is not None and (status == 429 or (500 <= status <= 599 and status != 501))
