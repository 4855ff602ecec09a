"""`program` payloads (what run_command lines become: `/bin/sh -c LINE`) on every backend: sh,
coreutils and make are inside the sandbox's mount namespace, the spec's /app is the workdir,
the payload's env reaches the run, and the run still cannot reach the network or the host.

    .venv/bin/python -m pytest tests/sandbox/test_programs.py -q
"""
from ratchet.sandbox import Payload

MAKEFILE = "all: out.txt\n\t@cat out.txt\nout.txt:\n\t@printf 'made %s\\n' \"$$(cat in.txt)\" > out.txt\n"


def sh(line, **kw):
    return Payload(program=("/bin/sh", "-c", line), **kw)


def test_shell_pipeline_make_and_env(sb):
    pipe, make, env = sb.run_many([
        sh("printf 'b\\na\\nb\\n' | sort | uniq -c | tr -s ' ' | head -1; exit 3"),
        sh("make -s && ls", files={"Makefile": MAKEFILE, "in.txt": "x"}),
        sh('echo "$GREETING" "$PATH"', env={"GREETING": "hi", "PATH": "/opt/none:/usr/bin:/bin"}),
    ])
    assert (pipe.exit_code, pipe.stdout.strip()) == (3, "1 a"), pipe.stderr
    # make starts each recipe with posix_spawn, which needs the run's uid mapped (zygote: map_self)
    assert make.exit_code == 0 and make.stdout.split() == ["made", "x", "Makefile", "in.txt", "out.txt"], make.stderr
    assert env.stdout.strip() == "hi /opt/none:/usr/bin:/bin"


def test_app_is_the_workdir_and_the_host_is_out_of_reach(isolating):
    app, host = isolating.run_many([
        sh("cd /app && cat in.txt && id -u && ls /proc | grep -c '^[0-9]'", files={"in.txt": "spec layout\n"}),
        sh("ls /root /work 2>&1; cat /etc/shadow 2>&1; python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 53), 1)'"),
    ])
    assert app.exit_code == 0, app.stderr
    text, uid, procs = app.stdout.split("\n")[:3]
    assert text == "spec layout" and uid != "0" and uid != "65534"      # an unprivileged, mapped uid
    assert int(procs) <= 6                                                # its own pid namespace only
    assert host.exit_code != 0 and "Network is unreachable" in host.stderr + host.stdout
    assert "No such file" in host.stdout and "shadow" in host.stdout
