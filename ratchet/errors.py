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

import functools

_NOT_TRANSIENT_OS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)
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
    if isinstance(exc, OSError):          # ConnectionError, TimeoutError, BrokenPipeError, ...
        return not isinstance(exc, _NOT_TRANSIENT_OS)
    try:
        from urllib3.exceptions import HTTPError as Urllib3Error
    except ImportError:  # pragma: no cover - urllib3 comes with minio and requests
        Urllib3Error = ()
    if Urllib3Error and isinstance(exc, Urllib3Error):
        return True
    name = type(exc).__name__                # minio's, without importing minio here
    if name == "ServerError":                # the S3 server answered 5xx
        return True
    return name == "S3Error" and getattr(exc, "code", None) in _SERVER_CODES
