"""The systemd units: rendering, ``systemd-analyze verify`` cleanliness, and installation."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from mdiedge.ops import units

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
    package = Path(units.__file__).resolve().parent.parent  # mdiedge/, beside ops/
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
        assert exec_start.endswith(" --cache-dir ${STATE_DIRECTORY}")
    expected = {"Type": "notify", "NotifyAccess": "main", "WatchdogSec": "30",
                "Restart": "on-failure", "RestartSec": "2", "TimeoutStopSec": "20",
                "KillSignal": "SIGTERM", "DynamicUser": "yes", "ProtectSystem": "strict",
                "ProtectHome": "read-only", "PrivateTmp": "yes", "NoNewPrivileges": "yes",
                "SupplementaryGroups": "video", "ConfigurationDirectory": "mdiedge",
                "After": "network-online.target", "Wants": "network-online.target",
                "WantedBy": "multi-user.target",
                "LoadCredential": "ring-secret:/etc/mdiedge/secret",
                "StateDirectory": "mdiedge-worker-%i" if "@" in name else "mdiedge"}
    for key, value in expected.items():
        assert _directives(text, key) == [value], key
    assert set(_directives(text, "Environment")) == {
        "PYTHONUNBUFFERED=1", "MDIEDGE_SECRET_FILE=%d/ring-secret"}
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


def _read_all(folder: Path) -> Dict[str, str]:
    return {p.name: p.read_text() for p in sorted(folder.iterdir())}


def test_install_units(tmp_path: Path) -> None:
    dest, config_dir = tmp_path / "system", tmp_path / "etc" / "mdiedge"
    written = units.install_units(dest, "/opt/venv/bin/mdiedge", config_dir)
    assert sorted(written) == sorted([dest / n for n in units.UNIT_NAMES]
                                     + [config_dir / "mdiedge.toml", config_dir / "starter.toml"])
    for name in units.UNIT_NAMES:
        text = (dest / name).read_text()
        assert text == units.render_unit(name, "/opt/venv/bin/mdiedge")
        assert _directives(text, "ExecStart")[0].startswith("/opt/venv/bin/mdiedge ")
        assert (dest / name).stat().st_mode & 0o777 == 0o644
    assert (config_dir / "mdiedge.toml").read_text() == units.WORKER_CONFIG
    assert (config_dir / "starter.toml").read_text() == units.STARTER_CONFIG

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


def test_install_units_default_executable(tmp_path: Path) -> None:
    executable = units.default_executable()
    assert os.path.isabs(executable)
    units.install_units(tmp_path / "u", config_dir=tmp_path / "c")
    text = (tmp_path / "u" / "mdiedge-worker.service").read_text()
    assert _directives(text, "ExecStart")[0].startswith(executable + " ")


def test_module_entry_point(tmp_path: Path) -> None:
    args = ["--dest", str(tmp_path / "u"), "--config-dir", str(tmp_path / "c"),
            "--executable", "/usr/bin/mdiedge"]
    assert units.main(args) == 0
    assert _read_all(tmp_path / "u").keys() == set(units.UNIT_NAMES)
    assert units.main(args + ["--executable", "relative"]) == 1


def test_config_skeletons_follow_the_schema() -> None:
    worker = tomllib.loads(units.WORKER_CONFIG)
    assert worker == {"worker": {
        "name": "w1", "host": "0.0.0.0", "control_port": 7700, "data_port": 7701, "threads": 0,
        "cache_dir": "/var/lib/mdiedge", "log_level": "info", "idle_timeout_s": 60,
        "busy_poll_us": 200, "insecure": False}}
    starter = tomllib.loads(units.STARTER_CONFIG)
    assert starter == {
        "starter": {"host": "0.0.0.0", "control_port": 7600,
                    "model": "/var/lib/mdiedge/models/tinyllama", "device": "cpu",
                    "dtype": "float32", "weight": 1.0, "stall_s": 3, "recover": True,
                    "rebalance_margin": 0.25, "busy_poll_us": 200},
        "workers": [{"name": "w1", "host": "10.0.0.2", "control_port": 7700, "device": "cuda",
                     "weight": 1.0, "spare": False}]}
    # the optional keys are there, commented out, with the schema's example values
    for text, keys in ((units.WORKER_CONFIG, ("secret_file", "model", "layers")),
                       (units.STARTER_CONFIG, ("memory", "layers", "secret_file"))):
        for key in keys:
            commented = [line[2:] for line in text.splitlines() if line.startswith(f"# {key} = ")]
            assert commented, key
            assert all(tomllib.loads(line) for line in commented)


def test_config_skeletons_show_the_defaults(tmp_path: Path) -> None:
    from mdiedge.base.settings import StarterSettings, WorkerSettings, load_settings

    (tmp_path / "w.toml").write_text(units.WORKER_CONFIG)
    (tmp_path / "s.toml").write_text(units.STARTER_CONFIG)
    worker = load_settings(tmp_path / "w.toml").worker
    ring = load_settings(tmp_path / "s.toml")
    default_worker, default_starter = WorkerSettings(), StarterSettings()
    assert worker is not None and ring.starter is not None
    assert (worker.control_port, worker.data_port, worker.idle_timeout_s) == \
        (default_worker.control_port, default_worker.data_port, default_worker.idle_timeout_s)
    assert ring.starter.control_port == default_starter.control_port
    assert [w.control_port for w in ring.workers] == [default_worker.control_port]


@pytest.mark.parametrize("kind", ["worker", "starter", "ring"])
def test_config_init_round_trips_through_config_check(tmp_path: Path, kind: str) -> None:
    import subprocess
    import sys

    from mdiedge.base.settings import check_config

    out = subprocess.run([sys.executable, "-m", "mdiedge", "config", "init", kind],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == units.skeleton(kind)
    path = tmp_path / f"{kind}.toml"
    path.write_text(out.stdout)
    assert check_config(path).startswith(f"{path}: valid;")


def test_config_init_refuses_an_unknown_kind() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "mdiedge", "config", "init", "gateway"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == "mdiedge: error: unknown config kind 'gateway'; choose worker, " \
                         "starter or ring\n"
