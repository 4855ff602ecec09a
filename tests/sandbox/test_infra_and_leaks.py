"""The sandbox's own failures are infra errors (never scored as the model's), and 1,000 runs
leave no process, fd, mount, temp dir or cgroup behind."""
import os
import signal
import tempfile
import threading
import time

import pytest

from ratchet.sandbox import Limits, Payload, Sandbox, doctor, run_many
from tests.sandbox.conftest import BACKENDS, need_backend, processes_named
from tests.waiting import until


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_infra_error_is_not_a_payload_failure(backend):
    need_backend(backend)
    with Sandbox(Limits(wall_s=5), backend=backend, concurrency=1) as sb:
        failed = sb.run(Payload(code="raise SystemExit(1)"))
        assert failed.infra_error is None and failed.exit_code == 1 and not failed.ok
        broken = sb.run(Payload(code="print(1)", python="/nonexistent/bin/python"))
        assert broken.infra_error and broken.exit_code is None and not broken.ok
        assert sb.run(Payload(code="print(2)")).stdout == "2\n"


@pytest.mark.timeout(60)
def test_worker_death_is_an_infra_error():
    need_backend("zygote")
    with Sandbox(Limits(wall_s=10), backend="zygote", concurrency=1) as sb:
        assert sb.run(Payload(code="print(0)")).ok
        slot = sb._free.queue[0]
        killer = threading.Timer(0.5, lambda: os.kill(slot.proc.pid, signal.SIGKILL))
        killer.start()
        r = sb.run(Payload(code="import ctypes, time\nctypes.CDLL(None).prctl(15, b'ratchetvictim', 0, 0, 0)\n"
                                "time.sleep(30)"))
        killer.join()
        assert r.infra_error and "worker" in r.infra_error and r.exit_code is None, r
        # the orphaned run is ended by the caller, not left running
        until(lambda: not processes_named("ratchetvictim"), timeout=3, what="the orphaned run to end")
        assert sb.run(Payload(code="print('back')")).stdout == "back\n"   # a new worker is started


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(pid))
            except (OSError, ValueError, IndexError):
                pass
    out, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _snapshot():
    with open("/proc/self/mountinfo") as f:   # only mounts a sandbox could leave (others share this VM)
        mounts = [ln for ln in f.read().splitlines() if " /tmp" in ln or "ratchet" in ln]
    return {"procs": _descendants(os.getpid()), "fds": set(os.listdir("/proc/self/fd")), "mounts": mounts}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["zygote", "subprocess"])
def test_no_leaks_after_1000_runs(backend, monkeypatch):
    need_backend(backend)
    tmp_path = tempfile.mkdtemp(prefix="ratchet-leaktest-", dir="/tmp")   # o+x: the slot uid must reach it
    os.chmod(tmp_path, 0o755)
    n = 1000 if backend == "zygote" else 150   # the fallback costs ~40 ms a run; keep it short
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = _snapshot()
    t = time.monotonic()
    payloads = [Payload(code=f"import os\nopen('f{i}', 'w').write('x')\nprint({i})",
                        files={"in.txt": "x"}) for i in range(n)]
    with Sandbox(Limits(), backend=backend, concurrency=2) as sb:
        cgroup_dirs = []
        results = sb.run_many(payloads)
        for slot in list(sb._free.queue):
            if slot.cg:
                cgroup_dirs += list(slot.cg.dirs.values())
    elapsed = time.monotonic() - t
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(n)]
    assert all(r.ok for r in results)
    until(lambda: not _snapshot()["procs"] - before["procs"], timeout=5,
          what=lambda: f"the runs' processes to exit; left behind: {_snapshot()['procs'] - before['procs']}")
    after = _snapshot()
    assert after["fds"] - before["fds"] == set(), "file descriptors left open"
    assert after["mounts"] == before["mounts"], "mounts left behind"
    assert os.listdir(tmp_path) == [], "temp dirs left behind"
    os.rmdir(tmp_path)
    assert not [d for d in cgroup_dirs if os.path.exists(d)], "cgroups left behind"
    print(f"{n} runs on {backend} in {elapsed:.1f}s")


@pytest.mark.timeout(60)
def test_default_run_many_and_doctor():
    rs = run_many([Payload(code=f"print({i} * 2)") for i in range(5)])
    assert [r.stdout for r in rs] == [f"{i * 2}\n" for i in range(5)]
    info = doctor()
    assert info["backend"] in BACKENDS and {"cpu", "wall", "memory", "pids"} <= set(info["mechanisms"])
