"""The systemd units: rendering, ``systemd-analyze verify`` cleanliness, and installation."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from mdiedge.serving import units
from mdiedge.serving.skeletons import on_boards, skeleton
from commands import MDIEDGE

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parent.parent


def _mdiedge_executable() -> str:
    sibling = Path(sys.executable).parent / "mdiedge"
    if sibling.is_file() and os.access(sibling, os.X_OK):
        return str(sibling)
    found = shutil.which("mdiedge")
    if not found:
        pytest.skip("no mdiedge console script installed")
    return os.path.abspath(found)


def _directives(text: str, key: str) -> List[str]:
    return [line.split("=", 1)[1] for line in text.splitlines() if line.startswith(key + "=")]


def test_sources_are_the_checkout_units() -> None:
    package = Path(units.__file__).resolve().parent.parent  # mdiedge/, beside serving/
    assert units.unit_source_dir() in (REPO / "systemd", package / "_systemd")
    for name in units.UNIT_NAMES:
        assert (REPO / "systemd" / name).is_file()


@pytest.mark.parametrize("name", units.UNIT_NAMES)
def test_render_rewrites_exec_start(name: str) -> None:
    text = units.render_unit(name, "/opt/mdiedge/venv/bin/mdiedge")
    (exec_start,) = _directives(text, "ExecStart")
    assert exec_start.startswith("/opt/mdiedge/venv/bin/mdiedge ")
    assert units.SOURCE_EXECUTABLE not in text
    role = "starter" if "starter" in name else "worker"
    config = {"mdiedge-worker.service": "/etc/mdiedge/mdiedge.toml",
              "mdiedge-worker@.service": "/etc/mdiedge/worker-%i.toml",
              "mdiedge-starter.service": "/etc/mdiedge/starter.toml"}[name]
    assert exec_start.split()[1:4] == [role, "--config", config]
    if role == "worker":
        assert exec_start.endswith(" --cache-dir ${STATE_DIRECTORY} --secret-fd 0")
    else:
        assert exec_start.endswith(" --secret-fd 0")
    expected = {"Type": "notify", "NotifyAccess": "main", "WatchdogSec": "30",
                "Restart": "on-failure", "RestartSec": "2", "TimeoutStopSec": "20",
                "KillSignal": "SIGTERM", "DynamicUser": "yes", "ProtectSystem": "strict",
                "ProtectHome": "read-only", "PrivateTmp": "yes", "NoNewPrivileges": "yes",
                "SupplementaryGroups": "video", "ConfigurationDirectory": "mdiedge",
                "After": "network-online.target", "Wants": "network-online.target",
                "WantedBy": "multi-user.target",
                "StandardInput": "file:/etc/mdiedge/secret", "StandardOutput": "journal",
                "StateDirectory": "mdiedge-worker-%i" if "@" in name else "mdiedge"}
    for key, value in expected.items():
        assert _directives(text, key) == [value], key
    assert _directives(text, "Environment") == ["PYTHONUNBUFFERED=1"]
    assert _directives(text, "Description") and _directives(text, "Documentation")
    assert text.startswith("# ")


def test_render_quotes_and_escapes_odd_paths() -> None:
    text = units.render_unit("mdiedge-worker.service", "/opt/my tools/100%/mdiedge")
    (exec_start,) = _directives(text, "ExecStart")
    assert exec_start.startswith('"/opt/my tools/100%%/mdiedge" worker ')
    with pytest.raises(ValueError):
        units.render_unit("mdiedge-worker.service", "bin/mdiedge")
    with pytest.raises(ValueError):
        units.render_unit("mdiedge-worker.service", "/opt/$HOME/mdiedge")
    with pytest.raises(ValueError):
        units.render_unit("nope.service", "/usr/bin/mdiedge")


def _verify(paths: List[Path]) -> "subprocess.CompletedProcess[str]":
    env = {k: v for k, v in os.environ.items() if k != "SYSTEMD_LOG_LEVEL"}
    command = ["systemd-analyze", "verify"]
    if not shutil.which("man"):  # Documentation=man:... lookups need man(1)
        command.append("--man=no")
    return subprocess.run(command + [str(p) for p in paths], capture_output=True, text=True,
                          env=env, timeout=120)


def test_systemd_analyze_verify_is_clean(tmp_path: Path) -> None:
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed (CI installs the systemd package)")
    executable = _mdiedge_executable()
    paths = []
    for name in units.UNIT_NAMES:
        # a template verifies as an instance of it
        path = tmp_path / name.replace("@.", "@a.")
        path.write_text(units.render_unit(name, executable))
        paths.append(path)
    odd = tmp_path / "odd dir" / "100%"
    odd.mkdir(parents=True)
    (odd / "mdiedge").symlink_to(executable)
    path = tmp_path / "mdiedge-worker@b.service"
    path.write_text(units.render_unit("mdiedge-worker@.service", str(odd / "mdiedge")))
    paths.append(path)
    # python -m mdiedge, configs in a folder of their own, outside /etc and inside it
    for name, config_dir in (("mdiedge-starter.service", "/opt/mdiedge/conf"),
                             ("mdiedge-worker.service", "/etc/mdiedge/lab")):
        path = tmp_path / "other" / config_dir.replace("/", "_") / name
        path.parent.mkdir(parents=True)
        path.write_text(units.render_unit(name, sys.executable, config_dir, ("-m", "mdiedge")))
        paths.append(path)
    result = _verify(paths)
    assert (result.returncode, result.stderr) == (0, ""), result.stderr


def test_systemd_analyze_verify_reports_problems(tmp_path: Path) -> None:
    """The check above can fail: a unit with a bogus key or a missing executable is flagged."""
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed (CI installs the systemd package)")
    path = tmp_path / "mdiedge-worker.service"
    text = units.render_unit("mdiedge-worker.service", str(tmp_path / "missing"))
    path.write_text(text.replace("[Service]\n", "[Service]\nBogusKey=1\n"))
    result = _verify([path])
    assert "BogusKey" in result.stderr and "missing" in result.stderr


# The oldest systemd release that knows each directive (and environment variable) the units
# use, with the values they give it, from systemd's NEWS; 0: before release 200 (2013).
# JetPack 5 (Ubuntu 20.04) ships systemd 245.
SINCE = {"Description": 0, "Documentation": 0, "After": 0, "Wants": 0, "WantedBy": 0,
         "Type": 0, "NotifyAccess": 0, "ExecStart": 0, "Environment": 0, "Restart": 0,
         "RestartSec": 0, "KillSignal": 0, "PrivateTmp": 0, "SupplementaryGroups": 0,
         "TimeoutStartSec": 0, "TimeoutStopSec": 0, "WatchdogSec": 0, "LimitNOFILE": 0, "NoNewPrivileges": 0,
         "User": 0, "StandardOutput": 0, "ProtectHome": 214, "ProtectSystem": 232,
         "DynamicUser": 232, "StateDirectory": 235, "ConfigurationDirectory": 235,
         "StandardInput": 236, "$STATE_DIRECTORY": 240}
JETPACK5_SYSTEMD = 245


@pytest.mark.parametrize("name", units.UNIT_NAMES)
def test_units_raise_the_descriptor_limit(name: str) -> None:
    """systemd's default soft LimitNOFILE (1024) is within reach of a connection flood."""
    from mdiedge.base import defaults

    lines = units.render_unit(name, "/opt/venv/bin/mdiedge").splitlines()
    assert f"LimitNOFILE={defaults.LIMIT_NOFILE}" in lines
    assert defaults.LIMIT_NOFILE > 4 * (defaults.MAX_CONTROL_CONNECTIONS +
                                        defaults.MAX_API_CONNECTIONS)


@pytest.mark.parametrize("name", units.UNIT_NAMES)
def test_units_run_on_the_systemd_of_jetpack_5(name: str) -> None:
    text = units.render_unit(name, "/opt/venv/bin/mdiedge")
    used = {line.split("=", 1)[0] for line in text.splitlines()
            if line and line[0].isalpha() and "=" in line}
    used |= {word for word in ("$STATE_DIRECTORY",) if "${STATE_DIRECTORY}" in text}
    assert used <= SINCE.keys(), f"unknown to this test (look it up in systemd's NEWS): " \
                                 f"{sorted(used - SINCE.keys())}"
    needed = max(SINCE[key] for key in used)
    assert needed <= JETPACK5_SYSTEMD
    assert f"Needs systemd >= {needed} (" in text  # what the unit's comment says
    assert "%d" not in text.replace("%%", "")  # the specifier needs systemd 252


@pytest.mark.parametrize("name", units.UNIT_NAMES)
@pytest.mark.parametrize("config_dir,configuration_directory",
                         [("/opt/mdiedge/conf", None), ("/etc/mdiedge-lab", "mdiedge-lab"),
                          ("/etc/mdiedge", "mdiedge")])
def test_render_carries_the_config_dir(name: str, config_dir: str,
                                       configuration_directory: Optional[str]) -> None:
    text = units.render_unit(name, "/opt/venv/bin/mdiedge", config_dir)
    if config_dir != "/etc/mdiedge":
        assert "/etc/mdiedge/" not in text
    (exec_start,) = _directives(text, "ExecStart")
    config = exec_start.split()[exec_start.split().index("--config") + 1]
    assert config.startswith(config_dir + "/") and config.endswith(".toml")
    assert _directives(text, "StandardInput") == [f"file:{config_dir}/secret"]
    assert _directives(text, "ConfigurationDirectory") == (
        [configuration_directory] if configuration_directory else [])
    assert f"{config_dir}/secret, mode 0600" in text  # the comment tells where it goes


@pytest.mark.parametrize("config_dir", ["conf", "/etc/my conf", "/etc/100%", "/etc/$HOME"])
def test_render_refuses_a_config_dir_it_cannot_name(config_dir: str) -> None:
    with pytest.raises(units.ConfigError, match="config folder"):
        units.render_unit("mdiedge-worker.service", "/opt/venv/bin/mdiedge", config_dir)


def test_render_runs_a_python_module() -> None:
    text = units.render_unit("mdiedge-starter.service", "/opt/venv/bin/python3",
                             args=("-m", "mdiedge"))
    (exec_start,) = _directives(text, "ExecStart")
    assert exec_start.startswith("/opt/venv/bin/python3 -m mdiedge starter --config ")


def _read_all(folder: Path) -> Dict[str, str]:
    return {p.name: p.read_text() for p in sorted(folder.iterdir())}


def test_install_units(tmp_path: Path) -> None:
    dest, config_dir = tmp_path / "system", tmp_path / "etc" / "mdiedge"
    written = units.install_units(dest, "/opt/venv/bin/mdiedge", config_dir)
    assert sorted(written) == sorted([dest / n for n in units.UNIT_NAMES]
                                     + [config_dir / "mdiedge.toml", config_dir / "starter.toml"])
    for name in units.UNIT_NAMES:
        text = (dest / name).read_text()
        assert text == units.render_unit(name, "/opt/venv/bin/mdiedge", config_dir)
        assert _directives(text, "ExecStart")[0].startswith("/opt/venv/bin/mdiedge ")
        assert (dest / name).stat().st_mode & 0o777 == 0o644
    worker_config = (config_dir / "mdiedge.toml").read_text()
    # a board's worker: every interface, where the one-machine skeleton listens on loopback
    assert worker_config == on_boards(skeleton("worker")).replace("/etc/mdiedge/",
                                                                  f"{config_dir}/")
    assert '\nhost = "0.0.0.0"\n# host = "127.0.0.1"\n' in worker_config
    assert f"reads\n# {config_dir}/mdiedge.toml" in worker_config
    assert f'\nsecret_file = "{config_dir}/secret"\n' in worker_config  # the units' file
    assert (config_dir / "starter.toml").read_text() == \
        on_boards(skeleton("starter")).replace("/etc/mdiedge/", f"{config_dir}/")

    # a second call changes nothing: units exist, configs are never overwritten
    (config_dir / "mdiedge.toml").write_text("# mine\n")
    (dest / "mdiedge-worker.service").write_text("# edited\n")
    assert units.install_units(dest, "/usr/bin/mdiedge", config_dir) == []
    assert (config_dir / "mdiedge.toml").read_text() == "# mine\n"
    assert (dest / "mdiedge-worker.service").read_text() == "# edited\n"

    # force replaces the units, still not the configs
    (config_dir / "starter.toml").unlink()
    written = units.install_units(dest, "/usr/bin/mdiedge", config_dir, force=True)
    assert sorted(written) == sorted([dest / n for n in units.UNIT_NAMES]
                                     + [config_dir / "starter.toml"])
    assert "ExecStart=/usr/bin/mdiedge worker" in (dest / "mdiedge-worker.service").read_text()
    assert (config_dir / "mdiedge.toml").read_text() == "# mine\n"
    assert not [p for p in dest.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_install_units_into_a_root(tmp_path: Path) -> None:
    """With a root, files land under it and name the paths as the installed system sees them."""
    written = units.install_units("/etc/systemd/system", "/opt/venv/bin/mdiedge",
                                  "/etc/mdiedge-lab", root=tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in written) == sorted(
        [f"etc/systemd/system/{n}" for n in units.UNIT_NAMES]
        + ["etc/mdiedge-lab/mdiedge.toml", "etc/mdiedge-lab/starter.toml"])
    for path in written:
        text = path.read_text()
        assert "/etc/mdiedge/" not in text and str(tmp_path) not in text
    worker = (tmp_path / "etc/systemd/system/mdiedge-worker.service").read_text()
    assert _directives(worker, "StandardInput") == ["file:/etc/mdiedge-lab/secret"]
    with pytest.raises(units.ConfigError, match="absolute"):
        units.install_units("/etc/systemd/system", "/opt/venv/bin/mdiedge", "conf",
                            root=tmp_path)


def test_default_command_is_this_install() -> None:
    """Run from a virtual environment (as root, under sudo), the units run its mdiedge."""
    command = units.default_command()
    beside = Path(sys.executable).parent / "mdiedge"
    if beside.is_file():
        assert command == (str(beside),)
    else:
        assert command == (sys.executable, "-m", "mdiedge")


def test_default_command_without_a_console_script(tmp_path: Path) -> None:
    """A Python with no mdiedge script beside it runs ``python -m mdiedge``, if that Python
    imports mdiedge on its own; one that finds it only through $PYTHONPATH is refused."""
    import venv

    venv.create(tmp_path / "venv", with_pip=False)
    python = str(tmp_path / "venv" / "bin" / "python")
    with pytest.raises(units.ConfigError, match="PYTHONPATH or a user site"):
        units.default_command(python)
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "mdiedge-checkout.pth").write_text(f"{REPO}\n")  # as `pip install -e` does
    assert units.default_command(python) == (python, "-m", "mdiedge")
    text = units.render_unit("mdiedge-worker.service", python, args=("-m", "mdiedge"))
    assert _directives(text, "ExecStart")[0].startswith(f"{python} -m mdiedge worker ")


def _cli(*args: str) -> "subprocess.CompletedProcess[str]":
    return subprocess.run([*MDIEDGE, *args], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_install_units_command(tmp_path: Path) -> None:
    out = _cli("install-units", "--root", str(tmp_path), "--config-dir", "/etc/mdiedge-lab")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    lines = out.stdout.splitlines()
    assert lines[:5] == [f"wrote {tmp_path}/etc/systemd/system/{n}" for n in units.UNIT_NAMES] \
        + [f"wrote {tmp_path}/etc/mdiedge-lab/{n}" for n in ("mdiedge.toml", "starter.toml")]
    assert lines[5].endswith(" into /etc/mdiedge-lab/secret,") and "mode 0600" in lines[6]
    worker = (tmp_path / "etc/systemd/system/mdiedge-worker.service").read_text()
    assert _directives(worker, "ExecStart")[0].startswith(units.default_command()[0] + " ")
    again = _cli("install-units", "--root", str(tmp_path), "--config-dir", "/etc/mdiedge-lab")
    assert again.returncode == 0 and again.stdout.startswith("nothing to do"), again.stderr


@pytest.mark.parametrize("args,message", [
    (["--executable", "bin/mdiedge"], "ExecStart= needs an absolute path, not 'bin/mdiedge'"),
    (["--config-dir", "/etc/my conf"], "cannot name the config folder '/etc/my conf'"),
])
def test_install_units_command_errors(tmp_path: Path, args: List[str], message: str) -> None:
    out = _cli("install-units", "--root", str(tmp_path), *args)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith("mdiedge: error: ") and message in out.stderr
    assert len(out.stderr.splitlines()) == 1 and not list(tmp_path.iterdir())


def test_install_units_command_without_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture) -> None:
    """Not root: one line naming the folder and the command that works from a venv."""
    import typer

    from mdiedge.cli.install import install_units_command

    def refused(folder: Path) -> None:
        raise PermissionError(13, "Permission denied", str(folder))

    monkeypatch.setattr(units, "_on_disk", lambda root, path: tmp_path / "no-access")
    monkeypatch.setattr(Path, "mkdir", lambda self, *a, **k: refused(self))
    with pytest.raises(typer.Exit) as exit_info:
        install_units_command(units.DEFAULT_CONFIG_DIR, units.DEFAULT_UNIT_DIR, None,
                              "/opt/venv/bin/mdiedge", False)
    assert exit_info.value.exit_code == 1
    assert capsys.readouterr().err == (
        f"mdiedge: error: {tmp_path}/no-access: permission denied; run it as root: "
        'sudo "$(command -v mdiedge)" install-units\n')


def test_the_nodes_read_the_secret_systemd_opens_as_stdin(tmp_path: Path) -> None:
    """``StandardInput=file:SECRET`` and ``--secret-fd 0``: a worker on a public address
    starts with that secret, and keeps /dev/null on its standard input."""
    from mdiedge.runtime.auth import Authenticator
    from mdiedge.runtime.control import call

    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef-the-ring-secret\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDIEDGE_")}
    with secret.open("rb") as stdin:
        proc = subprocess.Popen(
            [*MDIEDGE, "worker", "--no-config", "--host", "0.0.0.0",
             "--control-port", "0", "--data-port", "0", "--secret-fd", "0"],
            stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        ready = json.loads(proc.stdout.readline() or "{}")
        assert ready.get("event") == "ready", proc.stderr.read() if proc.poll() else ready
        assert os.readlink(f"/proc/{proc.pid}/fd/0") == "/dev/null"
        url = f"http://127.0.0.1:{ready['control_port']}"
        auth = Authenticator(b"0123456789abcdef-the-ring-secret")
        assert "name" in call(url, "GET", "/status", auth=auth, timeout=10)
    finally:
        proc.terminate()
        proc.wait(20)


def test_the_starter_reads_the_secret_from_stdin(tmp_path: Path) -> None:
    ring = tmp_path / "starter.toml"
    ring.write_text('[starter]\nhost = "0.0.0.0"\n[[workers]]\nname = "w1"\n'
                    'host = "127.0.0.1"\ncontrol_port = 9\n')
    secret = tmp_path / "secret"
    secret.write_text("short\n")
    with secret.open("rb") as stdin:
        out = subprocess.run([*MDIEDGE, "starter", "--config", str(ring),
                              "--secret-fd", "0"], stdin=stdin, capture_output=True, text=True,
                             timeout=120)
    assert out.returncode == 2 and out.stderr == \
        "mdiedge: error: --secret-fd 0: expected a secret of at least 16 bytes, got 5 bytes\n"


def test_config_skeletons_follow_the_schema() -> None:
    worker = tomllib.loads(skeleton("worker", "/home/u/secret", "/home/u/cache"))
    assert worker == {"worker": {
        "name": "w1", "host": "127.0.0.1", "control_port": 7700, "data_port": 7701,
        "threads": 0, "cache_dir": "/home/u/cache", "log_level": "info", "idle_timeout_s": 60,
        "busy_poll_us": 200, "encrypt": True, "secret_file": "/home/u/secret"}}
    assert tomllib.loads(skeleton("worker", name="w2"))["worker"]["control_port"] == 7702
    workers = [{"name": "w1", "host": "127.0.0.1", "control_port": 7700, "device": "cpu",
                "weight": 1.0, "spare": False},
               {"name": "w2", "host": "127.0.0.1", "control_port": 7702, "device": "cpu"}]
    starter = tomllib.loads(skeleton("starter", "/home/u/secret"))
    assert starter == {
        "starter": {"host": "127.0.0.1", "control_port": 7600, "device": "cpu",
                    "dtype": "float32", "weight": 1.0, "stall_s": 3, "recover": True,
                    "rebalance_margin": 0.25, "busy_poll_us": 200, "encrypt": True,
                    "secret_file": "/home/u/secret"},
        "workers": workers}
    ring = tomllib.loads(skeleton("ring", "/home/u/secret"))
    assert ring == {"starter": {"host": "127.0.0.1", "device": "cpu", "weight": 1.0,
                                "stall_s": 3, "recover": True, "rebalance_margin": 0.25,
                                "busy_poll_us": 200, "encrypt": True,
                                "secret_file": "/home/u/secret"},
                    "workers": workers}
    # the optional keys, and every value for boards, are there commented, as valid TOML
    for kind, keys in (("worker", ("secret_file", "model", "layers", "host", "cache_dir")),
                       ("starter", ("memory", "layers", "secret_file", "model", "host")),
                       ("ring", ("memory", "host", "device"))):
        text = skeleton(kind)
        for key in keys:
            commented = [line[2:] for line in text.splitlines() if line.startswith(f"# {key} = ")]
            assert commented, key
            assert all(tomllib.loads(line) for line in commented)


def test_config_skeletons_show_the_defaults(tmp_path: Path) -> None:
    from mdiedge.base.settings import StarterSettings, WorkerSettings, load_settings

    (tmp_path / "w.toml").write_text(skeleton("worker"))
    (tmp_path / "s.toml").write_text(skeleton("starter"))
    worker = load_settings(tmp_path / "w.toml").worker
    ring = load_settings(tmp_path / "s.toml")
    default_worker, default_starter = WorkerSettings(), StarterSettings()
    assert worker is not None and ring.starter is not None
    assert (worker.control_port, worker.data_port, worker.idle_timeout_s) == \
        (default_worker.control_port, default_worker.data_port, default_worker.idle_timeout_s)
    assert ring.starter.control_port == default_starter.control_port
    assert [w.control_port for w in ring.workers] == [default_worker.control_port, 7702]


@pytest.mark.parametrize("kind", ["worker", "starter", "ring"])
def test_config_init_round_trips_through_config_check(tmp_path: Path, kind: str) -> None:
    from mdiedge.base.settings import check_config

    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path / "config"),
               XDG_CACHE_HOME=str(tmp_path / "cache"))
    out = subprocess.run([*MDIEDGE, "config", "init", kind],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    secret = tmp_path / "config" / "mdiedge" / "secret"
    assert out.stdout == skeleton(kind, str(secret), str(tmp_path / "cache" / "mdiedge"))
    path = tmp_path / f"{kind}.toml"
    path.write_text(out.stdout)
    assert check_config(path, env={}).startswith(f"{path}: valid;")


def test_config_init_refuses_an_unknown_kind() -> None:
    import subprocess

    out = subprocess.run([*MDIEDGE, "config", "init", "gateway"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""  # a usage error
    assert out.stderr == "mdiedge: error: unknown config kind 'gateway'; choose worker, " \
                         "starter or ring\n"
