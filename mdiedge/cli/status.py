"""``mdiedge status``."""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

import typer

from .app import app, check_url, client_auth, fail, one_line_errors

NO_RING = ("no ring to ask: pass --starter URL, --ring FILE or --config FILE (or set "
           "$MDIEDGE_CONFIG to a config naming a starter, a ring or a worker)")


@app.command()
@one_line_errors
def status(
    ring: Optional[str] = typer.Option(None, help="Ring file (TOML) naming the workers."),
    starter: Optional[str] = typer.Option(None, help="URL of a running starter: its control "
                                          "plane (`mdiedge starter`) or its OpenAI API "
                                          "(`mdiedge serve`, `starter --api-port`)."),
    config: Optional[str] = typer.Option(None, help="Config to find the ring in (default: "
                                         "$MDIEDGE_CONFIG, then /etc/mdiedge/mdiedge.toml): a "
                                         "starter's config asks that starter, a ring file its "
                                         "workers, a worker's config that worker."),
    api_key_file: Optional[str] = typer.Option(None, help="File holding the API key of the "
                                               "--starter URL's API (default: "
                                               "$MDIEDGE_API_KEY)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    wide: bool = typer.Option(False, "--wide", help="Show every column (default: those that "
                              "fit the terminal)."),
) -> None:
    """Show every node of the ring and where its layers live. Without --starter or --ring,
    the config file names the ring. Exit code 0 when every node answered; 69 when a node is
    down that the starter does not know of yet (or any node is down, with --ring); else 75
    when the starter serves without a lost worker or spare (state "degraded": it rejoins
    when it answers again) or is setting its ring up (`setup` says what it waits for); else 77 when a node refused the request as unsigned or wrongly
    signed (state "unauthorized": set MDIEDGE_SECRET or the ring file's secret)."""
    from .console import print_status, refused

    if starter:
        nodes = _starter_nodes(check_url("--starter", starter), starter, client_auth(),
                               api_key_file)
    elif ring:
        nodes = _ring_nodes(ring)
    else:
        found = _config_nodes(config)
        if found is None:
            raise fail(NO_RING, 2)
        nodes = found
    nodes = [refused(node) for node in nodes]
    down = [n["name"] for n in nodes if n.get("state") == "down"]
    denied = [n["name"] for n in nodes if n.get("state") == "unauthorized"]
    degraded = any(n.get("state") == "degraded" for n in nodes)
    setting_up = any(n.get("role") == "starter" and n.get("setup") for n in nodes)
    if as_json:
        typer.echo(json.dumps({"nodes": nodes, "down": down, "unauthorized": denied,
                               "degraded": degraded}))
    else:
        print_status(nodes, wide)
    lost = {name for n in nodes if n.get("role") == "starter" for name in n.get("lost") or []}
    code = 69 if set(down) - lost else 75 if degraded or down or setting_up else \
        77 if denied else 0
    if code:
        raise typer.Exit(code)


def _starter_nodes(url: str, given: str, auth: Any, api_key_file: Optional[str] = None
                   ) -> List[Dict[str, Any]]:
    from .console import starter_nodes

    def api_key() -> Optional[str]:
        from ..serving.api.server import read_api_key

        return read_api_key(api_key_file)

    return starter_nodes(url, given, auth, api_key)


def _ring_nodes(ring: str) -> List[Dict[str, Any]]:
    """Each worker of a ring file, asked on its control port."""
    from ..base.ringfile import load_ring
    from ..runtime.auth import Authenticator
    from ..runtime.control import ControlClient

    found, workers = load_ring(ring, secret=True)
    auth = Authenticator(found["secret"])
    return [ControlClient(w, auth).status().to_json() for w in workers]


def _reachable(host: str) -> str:
    """The address a client on this machine reaches a node at that listens on ``host``."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _config_nodes(config: Optional[str]) -> Optional[List[Dict[str, Any]]]:
    """The nodes the config file names (``--config``, else the file every command finds):
    a ``[starter]`` that sets ``control_port`` (a starter's config) is asked as a running
    starter; ``[[workers]]`` without it (a ring file), each worker; a ``[worker]``, that
    worker. None when there is no config or it names none of these."""
    from ..base.nodes import NodeSpec
    from ..base.settings import find_config, load_settings, read_secret
    from ..runtime.auth import Authenticator
    from ..runtime.control import ControlClient

    path = find_config(config)
    if path is None:
        return None
    settings = load_settings(path)
    s, w = settings.starter, settings.worker
    if settings.workers and s is not None and "control_port" in s.keys_set:
        node = NodeSpec("starter", _reachable(s.host), s.control_port)
        return _starter_nodes(node.url, node.url, Authenticator(read_secret(s)))
    if settings.workers:
        return _ring_nodes(str(path))
    if w is not None:
        node = NodeSpec(w.name, _reachable(w.host), w.control_port)
        return [ControlClient(node, Authenticator(read_secret(w))).status().to_json()]
    return None
