"""`ratchet eval`: probes of a model checkpoint.

    ratchet eval niah --model DIR                                   # depth x length recall table
    ratchet eval niah --model DIR --lengths 120,240,500 --depths 0,0.5,1 --trials 8 --beyond-limit
    ratchet eval niah --model DIR --json                            # + one JSON object, the last line

The probe is `ratchet.eval.niah` (the needle-in-a-haystack recall of a key buried in filler);
defaults and help come from `NiahConfig`. No Prefect is imported here (the flow is flows/niah.py).
Bad input (not a model directory, a length past the model's context, a depth outside [0, 1])
fails with one `error:` line and exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from pydantic import ValidationError

from ratchet.cli_errors import fail, require_model_dir
from ratchet.config import NiahConfig, describe

app = typer.Typer(help="Probes of a model checkpoint.", no_args_is_help=True)
DEFAULT = NiahConfig()


@app.callback()
def _eval() -> None:
    """Probes of a model checkpoint."""


def _numbers(text: str | None, kind: type, option: str) -> tuple:
    if text is None:
        return ()
    try:
        return tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError:
        fail(f"{option} takes comma-separated {kind.__name__} numbers, got {text!r}", option)


@app.command("niah")
def niah_command(
    model: Path = typer.Option(..., help="Checkpoint directory (Hugging Face layout)."),
    lengths: Optional[str] = typer.Option(None, help=f"Comma-separated. {describe(NiahConfig, 'lengths')}"),
    depths: Optional[str] = typer.Option(None, help=f"Comma-separated. {describe(NiahConfig, 'depths')} "
                                         f"[default: {','.join(str(d) for d in DEFAULT.depths)}]"),
    trials: int = typer.Option(DEFAULT.trials, help=describe(NiahConfig, "trials")),
    key_digits: int = typer.Option(DEFAULT.key_digits, help=describe(NiahConfig, "key_digits")),
    seed: int = typer.Option(DEFAULT.seed, help=describe(NiahConfig, "seed")),
    batch_size: int = typer.Option(DEFAULT.batch_size, help=describe(NiahConfig, "batch_size")),
    beyond_limit: bool = typer.Option(False, "--beyond-limit", help=describe(NiahConfig, "beyond_limit")),
    as_json: bool = typer.Option(False, "--json", help="Also print the result as one JSON object (the last line)."),
) -> None:
    """Needle in a haystack: recall of a key buried at several depths in contexts of several lengths."""
    require_model_dir(model)
    fields = {"trials": trials, "key_digits": key_digits, "seed": seed, "batch_size": batch_size,
              "beyond_limit": beyond_limit, "lengths": _numbers(lengths, int, "--lengths")}
    if depths is not None:
        fields["depths"] = _numbers(depths, float, "--depths")
    try:
        cfg = NiahConfig(**fields)
    except ValidationError as e:
        err = e.errors()[0]
        fail(f"{err['msg']}", f"--{str(err['loc'][0]).replace('_', '-')}")
    from ratchet.eval.niah import probe
    from ratchet.model import load_policy
    from ratchet.watch import progress_bar

    loaded, tokenizer = load_policy(model)
    try:
        with progress_bar("needle in a haystack") as progress:   # on a terminal only
            result = probe(loaded, tokenizer, cfg, progress=progress)
    except ValueError as e:
        fail(str(e), "--lengths")
    typer.echo(result.text())
    if as_json:
        typer.echo(json.dumps({k: v for k, v in result.summary().items() if k != "table"}))
