"""``mdiedge config init`` skeletons run as written on one machine (two workers, the ring file
and the starter, unedited), ``config check`` refuses what would not run, and ``mdiedge
status`` finds the ring from the config file, and reads the ring of ``mdiedge serve``. Real
processes on loopback, the shipped NanoLlama."""
from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
from pathlib import Path
from typing import Dict, Iterator, List

import pytest

from mdiedge.base.defaults import STARTER_CONTROL_PORT
from mdiedge.serving.skeletons import worker_ports
from commands import MDIEDGE

ENV_KEYS = ("MDIEDGE_CONFIG", "MDIEDGE_SECRET", "MDIEDGE_SECRET_FILE", "MDIEDGE_API_KEY")


@pytest.fixture
def env(tmp_path: Path) -> Dict[str, str]:
    """An environment whose config and cache folders are the test's own."""
    found = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    found.update(XDG_CONFIG_HOME=str(tmp_path / "config"), XDG_CACHE_HOME=str(tmp_path / "cache"),
                 OMP_NUM_THREADS="1")
    return found


def mdiedge(env: Dict[str, str], *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*MDIEDGE, *args], capture_output=True,
                          text=True, timeout=300, env=env, cwd=cwd, stdin=subprocess.DEVNULL)


def start(env: Dict[str, str], cwd: Path, *args: str) -> "tuple[subprocess.Popen, dict]":
    """A long-lived node (or server), once it printed its ready line."""
    process = subprocess.Popen([*MDIEDGE, *args], cwd=cwd, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               stdin=subprocess.DEVNULL)
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        process.wait(timeout=30)
        pytest.fail(f"mdiedge {' '.join(args)} ended ({process.returncode}) before ready")
    return process, json.loads(line)


def stop(processes: List[subprocess.Popen]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the nodes bind
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture
def skeletons(tmp_path: Path, env: Dict[str, str]) -> Path:
    """``config init`` of every role into a folder, each checked by ``config check``."""
    for name, args in (("w1", ["worker"]), ("w2", ["worker", "--name", "w2"]),
                       ("starter", ["starter"]), ("ring", ["ring"])):
        out = mdiedge(env, "config", "init", *args, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        (tmp_path / f"{name}.toml").write_text(out.stdout)
    secret = tmp_path / "config" / "mdiedge" / "secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and len(secret.read_text()) == 65
    first = mdiedge(env, "config", "init", "worker", cwd=tmp_path)
    assert "kept as it was" in first.stderr and str(secret) in first.stderr
    assert (tmp_path / "w1.toml").read_text() == first.stdout
    for name in ("w1", "w2", "starter", "ring"):
        out = mdiedge(env, "config", "check", f"{name}.toml", cwd=tmp_path)
        assert out.returncode == 0 and ": valid;" in out.stdout, out.stderr
        assert str(secret) in out.stdout
    return tmp_path


def test_config_init_makes_one_secret_and_says_where(tmp_path: Path, env: Dict[str, str]) -> None:
    out = mdiedge(env, "config", "init", "starter", cwd=tmp_path)
    secret = tmp_path / "config" / "mdiedge" / "secret"
    assert out.returncode == 0
    assert out.stderr == f"mdiedge: wrote a new ring secret to {secret} (mode 0600)\n"
    assert f'secret_file = "{secret}"' in out.stdout
    secret.chmod(0o644)  # an existing secret is never rewritten, and must stay private
    again = mdiedge(env, "config", "init", "worker", cwd=tmp_path)
    assert again.returncode == 1 and again.stdout == ""
    assert again.stderr.startswith("mdiedge: error: ring secret ") and "chmod 600" in again.stderr


def test_config_check_refuses_a_missing_model_and_a_ring_without_secret(
        skeletons: Path, env: Dict[str, str]) -> None:
    text = (skeletons / "starter.toml").read_text()
    (skeletons / "model.toml").write_text(text.replace('# model = "/var/lib', 'model = "/var/lib'))
    out = mdiedge(env, "config", "check", "model.toml", cwd=skeletons)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == ("mdiedge: error: model.toml: starter.model: /var/lib/mdiedge/models/"
                          "tinyllama: model directory or file not found\n")
    ring = (skeletons / "ring.toml").read_text()
    (skeletons / "open.toml").write_text("\n".join(line for line in ring.splitlines()
                                                   if not line.startswith("secret_file =")))
    out = mdiedge(env, "config", "check", "open.toml", cwd=skeletons)
    assert out.returncode == 1 and len(out.stderr.splitlines()) == 1
    assert out.stderr.startswith("mdiedge: error: open.toml: starter.secret_file: a ring needs a "
                                 "secret")
    worker = (skeletons / "w1.toml").read_text()  # a worker alone may go without one
    (skeletons / "lone.toml").write_text(worker.replace("secret_file =", "# secret_file ="))
    assert mdiedge(env, "config", "check", "lone.toml", cwd=skeletons).returncode == 0


def test_a_ring_from_the_skeletons_runs_and_status_finds_it(skeletons: Path,
                                                            env: Dict[str, str]) -> None:
    ports = [p for name in ("w1", "w2") for p in worker_ports(name)] + [STARTER_CONTROL_PORT]
    if not all(port_free(p) for p in ports):
        pytest.skip(f"the skeletons' ports {ports} are not all free on this machine")
    nodes = []
    try:
        for name in ("w1", "w2"):
            nodes.append(start(env, skeletons, "worker", "--config", f"{name}.toml")[0])
        out = mdiedge(env, "generate", "ROMEO:", "-n", "8", "--temperature", "0", "--ring",
                      "ring.toml", "--json", cwd=skeletons)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["timing"]["new_tokens"] == 8
        ring_env = dict(env, MDIEDGE_CONFIG=str(skeletons / "ring.toml"))
        out = mdiedge(ring_env, "status", "--json", cwd=skeletons)
        assert out.returncode == 0, out.stdout + out.stderr
        assert [n["name"] for n in json.loads(out.stdout)["nodes"]] == ["w1", "w2"]

        nodes.append(start(env, skeletons, "starter", "--config", "starter.toml")[0])
        client = dict(env, MDIEDGE_SECRET_FILE=str(skeletons / "config" / "mdiedge" / "secret"))
        out = mdiedge(client, "generate", "ROMEO:", "-n", "8", "--starter",
                      f"http://127.0.0.1:{STARTER_CONTROL_PORT}", cwd=skeletons)
        assert out.returncode == 0, out.stderr
        out = mdiedge(env, "status", "--config", "starter.toml", "--json", cwd=skeletons)
        assert out.returncode == 0, out.stdout + out.stderr
        shown = json.loads(out.stdout)["nodes"]
        assert [(n["role"], n["name"]) for n in shown][1:] == [("worker", "w1"), ("worker", "w2")]
        assert shown[0]["role"] == "starter" and all(n["layers"] for n in shown)
        worker_env = dict(env, MDIEDGE_CONFIG=str(skeletons / "w2.toml"))
        out = mdiedge(worker_env, "status", "--json", cwd=skeletons)
        assert out.returncode == 0 and [n["name"] for n in json.loads(out.stdout)["nodes"]] == \
            ["w2"], out.stdout + out.stderr
    finally:
        stop(nodes)


@pytest.fixture
def serve_ring(tmp_path: Path, env: Dict[str, str]) -> Iterator[str]:
    server, ready = start(env, tmp_path, "serve", "--nodes", "2", "--port", "0", "--slots", "1")
    try:
        yield ready["url"]
    finally:
        stop([server])


def test_status_reads_the_ring_of_serve(serve_ring: str, tmp_path: Path,
                                        env: Dict[str, str]) -> None:
    for url in (serve_ring, serve_ring[:-len("/v1")]):  # as serve printed it, or its base
        out = mdiedge(env, "status", "--starter", url, "--json", cwd=tmp_path)
        assert out.returncode == 0, out.stdout + out.stderr
        shown = json.loads(out.stdout)["nodes"]
        assert [n["role"] for n in shown] == ["starter", "worker"]
        assert all(n["state"] != "down" and n["name"] for n in shown)
    signing = dict(env, MDIEDGE_SECRET="s" * 32)  # a client that signs: the API has no /ping
    out = mdiedge(signing, "status", "--starter", serve_ring, "--json", cwd=tmp_path)
    assert out.returncode == 0 and len(json.loads(out.stdout)["nodes"]) == 2, out.stderr
    table = mdiedge(env, "status", "--starter", serve_ring, cwd=tmp_path)
    assert table.returncode == 0 and all(n["name"] in table.stdout for n in shown)
    nothing = mdiedge(env, "status", "--starter", "http://127.0.0.1:9/v1", cwd=tmp_path)
    assert nothing.returncode == 69 and "unreachable" in nothing.stdout + nothing.stderr


def test_status_sends_the_api_key_of_serve(tmp_path: Path, env: Dict[str, str]) -> None:
    key = tmp_path / "key"
    key.write_text("k" * 24 + "\n")
    key.chmod(0o600)
    server, ready = start(dict(env, MDIEDGE_API_KEY="k" * 24), tmp_path, "serve", "--nodes",
                          "1", "--port", "0", "--slots", "1")
    try:
        out = mdiedge(env, "status", "--starter", ready["url"], "--json", cwd=tmp_path)
        assert out.returncode == 77, out.stdout + out.stderr
        assert json.loads(out.stdout)["unauthorized"] == ["starter"]
        for given in (["--api-key-file", str(key)], []):
            client = env if given else dict(env, MDIEDGE_API_KEY="k" * 24)
            out = mdiedge(client, "status", "--starter", ready["url"], "--json", *given,
                          cwd=tmp_path)
            assert out.returncode == 0, out.stdout + out.stderr
            assert [n["state"] for n in json.loads(out.stdout)["nodes"]] == ["ready"]
    finally:
        stop([server])
