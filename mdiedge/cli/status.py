"""``mdiedge status``."""
from __future__ import annotations

import json
from typing import Optional

import typer

from .app import app, check_url, client_auth, fail, one_line_errors


@app.command()
@one_line_errors
def status(
    ring: Optional[str] = typer.Option(None, help="Ring file (TOML) naming the workers."),
    starter: Optional[str] = typer.Option(None, help="URL of a running `mdiedge starter`."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    wide: bool = typer.Option(False, "--wide", help="Show every column (default: those that "
                              "fit the terminal)."),
) -> None:
    """Show every node of the ring and where its layers live. Exit code 0 when every node
    answered; 69 when a node is down that the starter does not know of yet (or any node is
    down, with --ring); else 75 when the starter serves without a lost worker or spare
    (state "degraded": it rejoins when it answers again); else 77 when a node refused the
    request as unsigned or wrongly signed (state "unauthorized": set MDIEDGE_SECRET or the
    ring file's secret)."""
    from .console import print_status, refused, starter_nodes

    if starter:
        nodes = starter_nodes(check_url("--starter", starter), starter, client_auth())
    elif ring:
        from ..base.ringfile import load_ring
        from ..runtime.auth import Authenticator
        from ..runtime.control import ControlClient

        found, workers = load_ring(ring, secret=True)
        auth = Authenticator(found["secret"])
        nodes = [ControlClient(w, auth).status().to_json() for w in workers]
    else:
        raise fail("pass --ring FILE or --starter URL", 2)
    nodes = [refused(node) for node in nodes]
    down = [n["name"] for n in nodes if n.get("state") == "down"]
    denied = [n["name"] for n in nodes if n.get("state") == "unauthorized"]
    degraded = any(n.get("state") == "degraded" for n in nodes)
    if as_json:
        typer.echo(json.dumps({"nodes": nodes, "down": down, "unauthorized": denied,
                               "degraded": degraded}))
    else:
        print_status(nodes, wide)
    lost = {name for n in nodes if n.get("role") == "starter" for name in n.get("lost") or []}
    code = 69 if set(down) - lost else 75 if degraded or down else 77 if denied else 0
    if code:
        raise typer.Exit(code)

