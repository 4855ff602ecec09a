"""`ratchet sandbox ...`: run a file in the sandbox, or say what this host offers.

    ratchet sandbox run solution.py --timeout 2 --memory-mb 256 --json
    ratchet sandbox doctor
    ratchet sandbox reap --json         # end this host's runs past their lease or orphaned (cron / sidecar)

A missing, binary or undecodable FILE, or a backend this host lacks: one `error:` line, exit 2.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from pydantic import ValidationError

from ratchet.cli_errors import fail, read_python
from ratchet.config import VerifyConfig, describe

app = typer.Typer(help="Run untrusted Python in ratchet's sandbox.", no_args_is_help=True)


@app.command()
def run(
    file: Path = typer.Argument(..., help="Python file to run as the main program."),
    timeout: float = typer.Option(VerifyConfig().timeout_s, "--timeout", help=describe(VerifyConfig, "timeout_s")),
    memory_mb: int = typer.Option(VerifyConfig().memory_mb, "--memory-mb", help=describe(VerifyConfig, "memory_mb")),
    backend: str = typer.Option("auto", "--backend", help="zygote | bwrap | subprocess | auto."),
    as_json: bool = typer.Option(False, "--json", help="Print the full result as JSON."),
) -> None:
    """Run FILE in the sandbox and print its result; exits with the payload's exit code."""
    from . import Payload, Sandbox
    try:
        limits = VerifyConfig(timeout_s=timeout, memory_mb=memory_mb).sandbox_limits()
    except ValidationError as e:
        err = e.errors()[0]
        fail(f"{err['msg']} (got {err['input']})", "--timeout" if err["loc"] == ("timeout_s",) else "--memory-mb")
    code = read_python(file)
    stdin = b"" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.buffer.read()
    try:
        sandbox = Sandbox(limits, backend=backend, concurrency=1)
    except (ValueError, RuntimeError) as e:
        fail(str(e), f"--backend {backend}")
    with sandbox as sb:
        res = sb.run(Payload(code=code, stdin=stdin))
    if as_json:
        typer.echo(json.dumps(res.to_dict(), indent=2))
    else:
        sys.stdout.write(res.stdout)
        sys.stderr.write(res.stderr)
        status = "ok" if res.ok else (res.infra_error and "infra error: " + res.infra_error.splitlines()[0]
                                      or f"killed by {res.killed_by}" if res.killed_by
                                      else f"exit {res.exit_code}" if res.signal is None else f"signal {res.signal}")
        events = f" events={','.join(res.security_events)}" if res.security_events else ""
        typer.echo(f"[sandbox] {status} wall={res.wall_ms:.1f}ms cpu={res.cpu_ms:.1f}ms "
                   f"peak={res.peak_memory_mb:.1f}MiB{' truncated' if res.truncated else ''}{events}", err=True)
    code = 0 if res.ok else (res.exit_code if res.exit_code else (3 if res.infra_error else 1))
    raise typer.Exit(code)


@app.command()
def doctor(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Print what this host offers and which mechanism each limit uses."""
    from . import doctor as _doctor
    info = _doctor()
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    typer.echo(info["summary"])
    typer.echo(f"backend: {info['backend']}")
    for name, why in info["backends"].items():
        typer.echo(f"  {name:<10} {why}")
    for k, v in info["mechanisms"].items():
        typer.echo(f"{k:<10} {v}")
    for k, v in info["host"].items():
        typer.echo(f"host.{k:<15} {v}")


@app.command()
def reap(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """End this host's sandbox runs whose worker died or that outlived their lease (ratchet/sandbox/lease.py);
    print what was found. Workers do this themselves every few seconds; run it from cron or a sidecar for a
    host whose workers are all gone."""
    from . import lease
    found = {**lease.reap(), "leases": lease_count(lease.lease_dir()), "dir": lease.lease_dir()}
    typer.echo(json.dumps(found) if as_json else
               f"reaped {found['reaped']}, orphaned {found['orphaned']}, {found['leases']} live lease(s) in {found['dir']}")


def lease_count(d: str) -> int:
    import os
    return sum(n.endswith(".json") for n in os.listdir(d))


if __name__ == "__main__":
    app()
