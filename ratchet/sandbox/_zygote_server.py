"""The zygote: a pre-initialised Python that forks one isolated child per run.

Started by ratchet.sandbox.backends.zygote as `python -I -S _zygote_server.py CONFIG` with a
SOCK_SEQPACKET control socket (its fd number in CONFIG); stdlib only. It runs as root in its
own mount namespace whose root is a minimal read-only tree (/usr, the interpreter prefixes,
a tiny /etc and /dev, an empty /tmp), and it never reads a payload.

Ahead of each run it pre-warms a child: A enters fresh mount, net, ipc, uts and pid
namespaces, mounts a fresh tmpfs on /tmp, forks B (pid 1 of the new pid namespace) and
exits; the zygote is B's subreaper. The zygote hands B's socket to the caller, which sends B
the run's request and five pipe fds directly. B alone reads the request, seeds /tmp/work,
sets rlimits, drops to the slot's unprivileged uid, enters a fresh user namespace, drops
every capability and runs the payload (in this already initialised interpreter, or by exec
of another one). The zygote waits for B through a pidfd and reports its wait status and
rusage; killing B (pid 1) tears down everything the run started. One child, one run.
"""
import base64
import ctypes
import fcntl
import json
import os
import platform
import resource
import select
import signal
import socket
import struct
import sys
import types

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PIDFD_GET_MNT_NAMESPACE = 0xFF03   # _IO(PIDFS_IOCTL_MAGIC, 3), Linux >= 6.11
PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_SET_DUMPABLE = 36, 38, 24, 4
SYS = {"x86_64": {"pivot_root": 155, "capset": 126, "keyctl": 250},
       "aarch64": {"pivot_root": 41, "capset": 91, "keyctl": 219}}[platform.machine()]
KEYCTL_JOIN_SESSION_KEYRING = 1
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]


def check(ret, what):
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def mount(src, dst, fstype, flags, data=None):
    check(libc.mount(src and src.encode(), dst.encode(), fstype and fstype.encode(), flags,
                     data and data.encode()), f"mount {dst}")


def unshare(flags):
    check(libc.unshare(flags), f"unshare {flags:#x}")


def drop_caps():
    hdr = struct.pack("Ii", 0x20080522, 0)
    data = b"\0" * 24
    check(libc.syscall(SYS["capset"], hdr, data), "capset")


# ---------------------------------------------------------------- root filesystem (once)

def _under_tmp(path):
    real = os.path.realpath(path)
    return real == "/tmp" or real.startswith("/tmp/")


def bind_ro(src, dst, is_dir=True):
    if is_dir:
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    mount(src, dst, None, MS_BIND | MS_REC)
    mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | (MS_NODEV if is_dir else 0))


def build_root(cfg):
    """Private mount namespace; a tmpfs root with read-only binds of what the runtime needs."""
    unshare(CLONE_NEWNS)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    # An interpreter prefix under /tmp (a checkout in /tmp) would be hidden by the staging
    # tmpfs below and by every run's fresh /tmp: hold it open now, park it at /.tmpbinds/<i>,
    # and bind it back into each run's /tmp (prewarm).
    cfg["tmp_binds"] = [p for p in cfg["binds"] if _under_tmp(p)]
    held = [os.open(p, os.O_PATH) for p in cfg["tmp_binds"]]
    new = "/tmp"
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=755")
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        p = "/" + top
        if os.path.islink(p):
            os.symlink(os.readlink(p), new + p)
        elif os.path.isdir(p):
            bind_ro(p, new + p)
    bind_ro("/usr", new + "/usr")
    for prefix in cfg["binds"]:
        if not os.path.realpath(prefix).startswith("/usr/") and prefix not in cfg["tmp_binds"]:
            bind_ro(prefix, new + prefix)
    for i, fd in enumerate(held):
        bind_ro(f"/proc/self/fd/{fd}", f"{new}/.tmpbinds/{i}")
        os.close(fd)
    os.makedirs(new + "/etc")
    uid = cfg["uid"]
    files = {"passwd": f"root:x:0:0::/:/bin/false\nsandbox:x:{uid}:{uid}::/tmp/work:/bin/false\n",
             "group": f"root:x:0:\nsandbox:x:{uid}:\n", "hosts": "127.0.0.1 localhost sandbox\n",
             "hostname": "sandbox\n"}
    for name in ("ld.so.cache", "ld.so.conf", "localtime", "nsswitch.conf"):
        try:
            with open("/etc/" + name, "rb") as f:
                files[name] = f.read()
        except OSError:
            pass
    for name, content in files.items():
        with open(f"{new}/etc/{name}", "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)
    os.makedirs(new + "/dev")
    for d in ("null", "zero", "full", "random", "urandom"):
        bind_ro("/dev/" + d, f"{new}/dev/{d}", is_dir=False)
        mount(None, f"{new}/dev/{d}", None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NOEXEC)  # rw, no dev restriction
    os.symlink("/proc/self/fd", new + "/dev/fd")
    os.makedirs(new + "/tmp")
    os.symlink("/tmp/work", new + "/app")     # the task spec's layout: /app is the run's workdir
    os.makedirs(new + "/proc")                 # mounted per run for program payloads only (child_b)
    os.makedirs(new + "/.old")
    os.chdir(new)
    check(libc.syscall(SYS["pivot_root"], b".", b".old"), "pivot_root")
    os.chdir("/")
    check(libc.umount2(b"/.old", MNT_DETACH), "umount old root")
    os.rmdir("/.old")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


# ---------------------------------------------------------------- per run

def prewarm(cfg):
    """Fork A, which builds the next run's namespaces before any request exists: fresh
    mount, net, ipc, uts and pid namespaces and a fresh tmpfs on /tmp; A forks B (pid 1 of
    the new pid namespace), reports B's pid, exits. B waits for its run. Returns
    (a_pid, report_fd, zygote_end_of_B's_socket)."""
    zsock, bsock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sp_r, sp_w = os.pipe()
    a = os.fork()
    if a == 0:
        try:
            zsock.close()
            os.close(sp_r)
            lo, hi = sorted((sp_w, bsock.fileno()))
            os.closerange(3, lo)            # nothing of the zygote's (or earlier runs') survives
            os.closerange(lo + 1, hi)
            os.closerange(hi + 1, 1 << 16)
            unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWPID)
            mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
                  f"size={4 * cfg['limits']['fsize_mb']}m,nr_inodes=8192,mode=1777")
            for i, path in enumerate(cfg["tmp_binds"]):   # interpreter prefixes that live under /tmp
                os.makedirs(path, mode=0o755, exist_ok=True)
                mount(f"/.tmpbinds/{i}", path, None, MS_BIND | MS_REC)
                mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
            b = os.fork()
            if b:
                os.write(sp_w, struct.pack("i", b))
                os._exit(0)
            os.close(sp_w)
            child_b(cfg, bsock)
        except BaseException as e:
            try:
                os.write(sp_w, f"E{type(e).__name__}: {e}".encode()[:500])
            except BaseException:
                pass
        os._exit(70)
    bsock.close()
    os.close(sp_w)
    return a, sp_r, zsock


def child_b(cfg, bsock):
    """B: pid 1 of the run's pid namespace, root until its run arrives. Then: read the
    request, seed /tmp/work, set rlimits, drop to the slot uid, enter a fresh user namespace,
    drop every capability, run the payload."""
    msg, fds, _f, _a = socket.recv_fds(bsock, 66000, 5)   # < malloc's mmap threshold
    bsock.close()
    if len(fds) != 5:
        os._exit(71)
    req_r, in_r, out_w, err_w, ev_w = fds
    chunks = [msg]
    while not msg:              # a large request comes through the pipe instead
        b = os.read(req_r, 1 << 20)
        if not b:
            break
        chunks.append(b)
    req = json.loads(b"".join(chunks))
    os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.dup2(in_r, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.dup2(ev_w, 3)
    os.closerange(4, 1 << 16)
    lim, uid = cfg["limits"], cfg["uid"]
    work = "/tmp/work"
    os.mkdir(work)
    os.chmod(work, 0o1777)
    for rel, data, ro in req["files"]:
        path = os.path.join(work, rel)
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            os.makedirs(parent)
            d = parent
            while d != work:
                os.chmod(d, 0o1777)
                d = os.path.dirname(d)
        if os.path.lexists(path):
            os.unlink(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o444 if ro else 0o644)
        os.write(fd, base64.b64decode(data))
        if not ro:
            os.fchown(fd, uid, uid)
        os.close(fd)
    if req["code"] is not None and req["exec"]:
        with open("/tmp/.main.py", "w", encoding="utf-8") as f:
            f.write(req["code"])
    program = bool(req.get("program"))
    if program:   # shell commands: their own /proc (this pid namespace only), as bwrap gives
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    cpu = max(1, int(-(-lim["cpu_s"] // 1)))
    for res, val in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, lim["memory_mb"] << 20),
                     (resource.RLIMIT_FSIZE, lim["fsize_mb"] << 20), (resource.RLIMIT_NOFILE, lim["nofile"]),
                     (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, lim["max_procs"])):
        resource.setrlimit(res, (val, val))
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)              # all uids non-zero: every capability is gone
    libc.syscall(SYS["keyctl"], KEYCTL_JOIN_SESSION_KEYRING, None)   # a fresh session keyring
                                                                       # (no channel to the next run)
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    unshare(CLONE_NEWUSER)                   # a fresh user namespace owning nothing of ours...
    if program:
        map_self(uid)
    drop_caps()                              # ...and no capabilities in it either
    os.chdir(work)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "TMPDIR": "/tmp",
           "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
    if req["exec"]:
        argv = req["argv_exec"]
        env.update(req.get("env") or {})
        os.execve(argv[0], argv, env)
    os.environ.clear()
    os.environ.update(env)
    sys.stdin = open(0, "r", encoding="utf-8", errors="replace", closefd=False)
    BOOT.run("code", [req["code"], work + "/main.py"], 3, work)


def map_self(uid):
    """Map the slot uid/gid to themselves in the run's fresh user namespace. Unmapped, the run's
    ids read as 65534 and every seteuid(getuid()) fails with EINVAL: GNU make's posix_spawn
    (POSIX_SPAWN_RESETIDS) cannot start a recipe. Needs the run's /proc."""
    check(libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "dumpable")   # /proc/self owned by the slot uid
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{uid} {uid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


class Zygote:
    """Keeps up to two pre-warmed children handed out to the caller. The caller talks to a
    child directly (over the socket it got in a "ready" message); the zygote only watches
    each child's pidfd, reports its end ("exit"), and kills it on request."""

    def __init__(self, cfg, sock):
        self.cfg, self.sock = cfg, sock
        self.warming = None      # (a_pid, report_fd, zsock)
        self.out = {}            # b_pid -> (a_pid, pidfd, mntns_fd or None): handed out, not ended
        self.mntns_ok = True

    def send(self, fds=(), **msg):
        data = json.dumps(msg).encode()
        if fds:
            socket.send_fds(self.sock, [data], list(fds))
        else:
            self.sock.send(data)

    def maybe_warm(self):
        if self.warming is None and len(self.out) < 2:
            try:
                self.warming = prewarm(self.cfg)
            except OSError:
                self.warming = None   # e.g. the slot's pids cgroup is full right now: retry later

    def warmed(self):
        """A reported: hand B's socket to the caller."""
        a, rfd, zsock = self.warming
        self.warming = None
        got = os.read(rfd, 512)
        os.close(rfd)
        if len(got) != 4:
            os.waitpid(a, 0)
            zsock.close()
            self.send(op="error", msg="prewarm failed: " + (got[1:].decode(errors="replace") or "child died"))
            return
        b = struct.unpack("i", got)[0]
        try:
            pidfd = os.pidfd_open(b)
        except OSError:
            os.waitpid(a, 0)
            zsock.close()
            return
        mntns = None
        if self.mntns_ok:
            try:   # hold the run's mount namespace: its teardown then happens after we report
                mntns = fcntl.ioctl(pidfd, PIDFD_GET_MNT_NAMESPACE)
            except OSError:
                self.mntns_ok = False
        self.out[b] = (a, pidfd, mntns)
        self.send(fds=[zsock.fileno()], op="ready", pid=b)
        zsock.close()

    def ended(self, b):
        a, pidfd, mntns = self.out.pop(b)
        os.waitpid(a, 0)                          # B was reparented to us when A exited
        _, status, ru = os.wait4(b, 0)
        os.close(pidfd)
        self.send(op="exit", pid=b, status=status, cpu=ru.ru_utime + ru.ru_stime, maxrss=ru.ru_maxrss)
        if mntns is not None:
            os.close(mntns)

    def serve(self):
        self.maybe_warm()
        while True:
            p = select.poll()
            p.register(self.sock.fileno(), select.POLLIN)
            by_fd = {}
            for b, (_a, pidfd, _m) in self.out.items():
                p.register(pidfd, select.POLLIN)
                by_fd[pidfd] = b
            if self.warming:
                p.register(self.warming[1], select.POLLIN)
            retry = self.warming is None and len(self.out) < 2     # a failed warm-up: retry soon
            for fd, _ev in p.poll(50 if retry else None):
                if fd in by_fd:
                    self.ended(by_fd[fd])
                elif self.warming and fd == self.warming[1]:
                    self.warmed()
                elif fd == self.sock.fileno():
                    if not self.on_message():
                        return self.shutdown()
            self.maybe_warm()

    def on_message(self):
        msg = self.sock.recv(4096)
        if not msg:
            return False
        op = json.loads(msg)
        if op["op"] == "kill" and op.get("pid") in self.out:
            try:
                signal.pidfd_send_signal(self.out[op["pid"]][1], signal.SIGKILL)
            except OSError:
                pass
        return op["op"] != "exit"

    def shutdown(self):
        for _a, pidfd, _m in self.out.values():
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except OSError:
                pass
        if self.warming:
            a, rfd, zsock = self.warming
            zsock.close()              # B gets EOF instead of a run and exits
        while True:
            try:
                os.wait()
            except ChildProcessError:
                break


PRELOAD = ("json re math collections itertools functools typing dataclasses heapq bisect string "
           "random traceback runpy copy fractions decimal statistics operator enum abc io unittest "
           "textwrap hashlib array contextlib").split()


def main():
    cfg = json.loads(sys.argv[1])
    sock = socket.socket(fileno=cfg["fd"])
    try:
        global BOOT
        BOOT = types.ModuleType("ratchet_sandbox_boot")
        with open(cfg["boot"], encoding="utf-8") as f:
            exec(compile(f.read(), cfg["boot"], "exec"), BOOT.__dict__)
        for p in cfg["cgroup_procs"]:
            with open(p, "w") as f:
                f.write("0")
        try:  # the OOM killer should pick the run, not the zygote (best effort)
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("-1000")
        except OSError:
            pass
        for name in PRELOAD:
            try:
                __import__(name)
            except Exception:
                pass
        build_root(cfg)
        import gc
        gc.collect()
        gc.freeze()   # children never walk (and so never copy) the preloaded heap
        check(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "subreaper")
        os.environ.clear()
        os.environ.update({"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"})
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except BaseException as e:
        import traceback
        where = traceback.extract_tb(e.__traceback__)[-1]
        sock.send(json.dumps({"op": "error", "msg": f"zygote start: {type(e).__name__}: {e} "
                                                    f"(line {where.lineno}: {where.line})"}).encode())
        return
    sock.send(json.dumps({"op": "ready", "pid": os.getpid()}).encode())
    Zygote(cfg, sock).serve()


if __name__ == "__main__":
    main()
