"""Runs inside the sandbox, before the payload: stdlib only, self-contained.

Used two ways: imported by the zygote's per-run child (fast path), and passed as the `-c`
program of a fresh interpreter (exec path: `python -I [-S] -c <this file> EVFD MODE ...`).
It installs an audit hook that *reports* what the payload tries (network, writes outside the
writable area, signals, process spawns, native code) on the events fd; the kernel-level
isolation is what *refuses* them. Events are advisory: a payload can lie by adding events,
never remove the kernel's refusal.
"""
import os
import sys

WRITABLE = ("/tmp/", "/dev/null", "/dev/zero", "/dev/full")
_AUDIT = {
    "socket.connect": "network_attempt", "socket.getaddrinfo": "network_attempt",
    "socket.gethostbyname": "network_attempt", "socket.gethostbyaddr": "network_attempt",
    "socket.sendto": "network_attempt", "socket.bind": "network_attempt",
    "os.fork": "process_spawn", "os.forkpty": "process_spawn", "subprocess.Popen": "process_spawn",
    "os.posix_spawn": "process_spawn", "os.exec": "process_spawn", "os.system": "process_spawn",
    "ctypes.call_function": "native_code", "ctypes.dlopen": "native_code",
}


def install(ev_fd, workdir):
    """Start reporting events on ev_fd (one name per line, each name once)."""
    seen = set()
    writable = tuple(WRITABLE) + (workdir.rstrip("/") + "/",)
    me = os.getpid()

    def emit(name):
        if name not in seen:
            seen.add(name)
            try:
                os.write(ev_fd, (name + "\n").encode())
            except OSError:
                pass

    def hook(event, args):
        kind = _AUDIT.get(event)
        if kind is not None:
            if event == "ctypes.dlopen" and args and args[0] is None:
                return  # `import ctypes` opens the main program itself
            emit(kind)
        elif event == "open" and len(args) > 2 and isinstance(args[0], (str, bytes)):
            mode, flags = args[1], args[2] or 0
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC))
            if writing:
                p = os.path.abspath(os.fsdecode(args[0]))
                if not (p + "/").startswith(writable) and not p.startswith(writable):
                    emit("write_refused")
        elif event in ("os.kill", "os.killpg"):
            pid = args[0]
            if pid != me and (pid <= 1 or pid == os.getppid()):
                emit("signal_attempt")

    sys.addaudithook(hook)
    real_fork = os.fork

    def fork():
        try:
            return real_fork()
        except BlockingIOError:
            emit("fork_limit")
            raise
    os.fork = fork
    return emit


def finish(code, emit):
    """Flush, note leftover children (daemons), leave with `code`."""
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:
            pass
    if os.getpid() == 1:  # pid-namespace init: every orphan is our child
        try:
            if os.waitpid(-1, os.WNOHANG) == (0, 0):
                emit("daemon_left")
        except ChildProcessError:
            pass
    os._exit(code)


def run(mode, args, ev_fd, workdir):
    """mode "code": args = [source, filename]; "argv": python-style argv (-m mod | -c src | script)."""
    emit = install(ev_fd, workdir)
    import runpy
    import traceback
    code = 0
    try:
        if mode == "code":
            sys.argv = [args[1]]
            sys.path.insert(0, workdir)
            import types
            main = types.ModuleType("__main__")   # a fresh __main__ (not the zygote's)
            main.__file__ = args[1]
            main.__builtins__ = __builtins__
            sys.modules["__main__"] = main
            exec(compile(args[0], args[1], "exec"), main.__dict__)
        elif args[0] == "-m":
            sys.argv = [args[1]] + list(args[2:])
            sys.path.insert(0, workdir)
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv = ["-c"] + list(args[2:])
            sys.path.insert(0, workdir)
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            sys.argv = list(args)
            sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        c = e.code
        if c is None:
            code = 0
        elif isinstance(c, int):
            code = c & 0xFF
        else:
            try:
                sys.stderr.write(str(c) + "\n")
            except Exception:
                pass
            code = 1
    except MemoryError:
        emit("memory_limit")
        try:
            sys.stderr.write("MemoryError: the sandbox's memory limit was reached\n")
        except Exception:
            pass
        code = 1
    except BaseException:
        try:
            traceback.print_exc()
        except Exception:
            pass
        code = 1
    finish(code, emit)


if __name__ == "__main__":  # exec path: python -I [-S] -c <this source> EVFD WORKDIR MODE ARGS...
    _fd, _wd, _mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    _rest = sys.argv[4:]
    if _mode == "codefile":
        with open(_rest[0], encoding="utf-8") as _f:
            _src = _f.read()
        _mode, _rest = "code", [_src, os.path.join(_wd, "main.py")]
    run(_mode, _rest, _fd, _wd)
