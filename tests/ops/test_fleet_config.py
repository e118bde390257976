"""The fleet configuration in the state dir (``mount --directory``, core/fleet/config.py):
bad flags and a bad file are one line each, nothing written; ``fleet ls`` and
``fleet hosts`` default to the saved directory, and say so when there is none."""

from __future__ import annotations

import json
import os
from pathlib import Path

from capsulefs.core.fleet import config
from capsulefs.core.store import layout

from cli_kit import run_cli


def test_mount_refuses_a_bad_directory_flag_in_one_line_and_saves_nothing(tmp_path: Path) -> None:
    state, mnt = tmp_path / "state", tmp_path / "mnt"
    mnt.mkdir()
    for flags, words in [(["--directory", "http://127.0.0.1:2379"], "not an etcd address"),
                         (["--directory", "etcd://127.0.0.1:99999"], "not HOST:PORT"),
                         (["--directory", "etcd://127.0.0.1:2379", "--directory-prefix", "capsulefs"],
                          "starts and ends with '/'"),
                         (["--directory-prefix", "/p/"], "--directory-prefix needs --directory"),
                         (["--directory", "etcd://127.0.0.1:2379", "--listen", "0.0.0.0:7714"],
                          "--listen 0.0.0.0:7714: other hosts cannot reach this host there"),
                         (["--directory", "etcd://127.0.0.1:2379", "--listen", "127.0.0.1:0"],
                          "give --advertise HOST:PORT"),
                         (["--directory", "etcd://127.0.0.1:2379", "--listen", "0.0.0.0:7714", "--advertise",
                           "[::]:7714"], "--advertise [::]:7714: other hosts cannot reach"),
                         (["--listen", "127.0.0.1:7714", "--advertise", "10.0.0.1:7714"],
                          "--advertise needs the fleet mode"),
                         (["--blobs", "http://127.0.0.1:8333/fleet-blobs"], "--blobs needs --directory"),
                         (["--directory", "etcd://127.0.0.1:2379", "--blobs", "s3://fleet-blobs/eu"],
                          "http://HOST[:PORT]/BUCKET[/PREFIX]"),
                         (["--directory", "etcd://127.0.0.1:2379", "--blobs", "http://k:s@127.0.0.1:8333/fleet-blobs"],
                          "carries no credentials"),
                         (["--directory", "etcd://127.0.0.1:2379", "--blobs", "http://127.0.0.1:8333/Bad_Bucket"],
                          "not an S3 bucket name"),
                         (["--directory", "etcd://127.0.0.1:2379", "--blobs", "http://127.0.0.1:8333/fleet-blobs"],
                          "no credentials for the blob tier")]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        proc = run_cli("mount", str(mnt), *flags, state=state, env=env)
        assert proc.returncode == 1, proc
        (line,) = proc.stderr.splitlines()
        assert line.startswith("capsulefs: error: ") and words in line, line
        assert not (state / layout.FLEET_FILE).exists()


def test_the_saved_file_is_read_strictly(tmp_path: Path) -> None:
    assert config.load(str(tmp_path)) is None  # (no file: peer-to-peer)
    config.save(str(tmp_path), config.make("etcd://10.0.0.1:2379,10.0.0.2:2379", "/fleet-a/"))
    assert config.load(str(tmp_path)) == config.FleetConfig("etcd://10.0.0.1:2379,10.0.0.2:2379", "/fleet-a/")
    config.save(str(tmp_path), config.make("etcd://10.0.0.1:2379", None, "https://s3.example:9000/fleet-blobs/eu"))
    saved = config.load(str(tmp_path))
    assert saved is not None and saved.blobs == "https://s3.example:9000/fleet-blobs/eu"
    assert saved.tier is not None and (saved.tier.bucket, saved.tier.prefix) == ("fleet-blobs", "eu/")
    path = tmp_path / layout.FLEET_FILE
    for data, words in [(b'{"directory": "etcd://a:1", "directory": "etcd://b:1"}', "appears twice"),
                        (b'{"directory": "etcd://a:1", "extra": 1}', "not an object of"),
                        (b'["etcd://a:1"]', "not an object of"),
                        (b'{"directory": "etcd://a"}', "not HOST:PORT"),
                        (b'{"directory": "etcd://a:1", "prefix": "/x"}', "starts and ends"),
                        (b'{"directory": "etcd://a:1", "blobs": null}', "not an object of"),
                        (b'{"directory": "etcd://a:1", "blobs": "s3://bucket"}', "/BUCKET[/PREFIX]"),
                        (b'{"directory": "etcd://a:1", "blobs": "http://a:b@h:1/bucket"}', "no credentials"),
                        (b"\xff", "not UTF-8")]:
        path.write_bytes(data)
        try:
            config.load(str(tmp_path))
        except config.FleetConfigError as exc:
            assert str(path) in str(exc) and words.lower() in str(exc).lower() and "\n" not in str(exc), str(exc)
        else:
            raise AssertionError(f"{data!r} was accepted")


def test_fleet_commands_default_to_the_saved_directory(tmp_path: Path) -> None:
    from fleet_kit import free_ports

    state = tmp_path / "state"
    proc = run_cli("fleet", "ls", state=state)
    assert proc.returncode != 0 and "no --directory given and none saved" in proc.stderr, proc
    (port,) = free_ports(1)  # (nothing listens there: the command says it could not reach it)
    state.mkdir()
    config.save(str(state), config.make(f"etcd://127.0.0.1:{port}", "/fleet-b/"))
    for cmd in ("ls", "hosts"):
        proc = run_cli("fleet", cmd, "--json", state=state)
        assert proc.returncode == 1 and proc.stdout == "", proc
        (line,) = proc.stderr.splitlines()
        assert f"127.0.0.1:{port}" in line, line
    assert json.loads((state / layout.FLEET_FILE).read_bytes())["prefix"] == "/fleet-b/"


def test_a_mount_refused_as_the_second_on_a_state_changes_no_fleet_file(tmp_path: Path) -> None:
    """fleet.json is written only once the mount holds the state: a second
    mount racing the first (refused at the state's lock) leaves it as it was,
    or absent."""
    from capsulefs.daemon.daemon import holding_state

    state, mnt = tmp_path / "state", tmp_path / "mnt"
    mnt.mkdir()
    with holding_state(str(state), doing="serving it (the first mount, in this test)"):
        proc = run_cli("mount", str(mnt), "--directory", "etcd://127.0.0.1:2379", state=state)
        assert proc.returncode == 1, proc
        (line,) = proc.stderr.splitlines()
        assert "already holds" in line and "refused" in line, line
        assert not (state / layout.FLEET_FILE).exists()

        first = config.make("etcd://10.0.0.1:2379", "/fleet-a/")
        config.save(str(state), first)
        before = (state / layout.FLEET_FILE).read_bytes()
        proc = run_cli("mount", str(mnt), "--directory", "etcd://10.9.9.9:2379", "--directory-prefix", "/fleet-b/",
                       state=state)
        assert proc.returncode == 1 and "already holds" in proc.stderr, proc
        assert (state / layout.FLEET_FILE).read_bytes() == before
        assert config.load(str(state)) == first


def test_a_move_without_the_daemon_is_refused_in_the_fleet_mode(tmp_path: Path) -> None:
    """Only the daemon asks the directory (and holds the lease): an offline
    move or resume would be one the directory never sees."""
    state = tmp_path / "state"
    run_cli("init", state=state, check=True)
    config.save(str(state), config.make("etcd://127.0.0.1:2379"))
    for args in (["move", "walker", "b"], ["move", "walker", "--resume"]):
        proc = run_cli(*args, state=state)
        assert proc.returncode == 1, proc
        (line,) = proc.stderr.splitlines()
        assert line.startswith("capsulefs: error: in the fleet mode a move goes through the mount's daemon"), line


def test_fleet_gc_needs_a_tier_and_a_grace_it_can_read_each_refused_in_one_line(tmp_path: Path) -> None:
    from fleet_kit import free_ports

    state = tmp_path / "state"
    state.mkdir()
    (port,) = free_ports(1)
    config.save(str(state), config.make(f"etcd://127.0.0.1:{port}", "/fleet-g/"))
    for args, problem in [
        ((), "no --blobs given and no blob tier saved"),
        (("--grace", "1 day"), "--grace '1 day' is not a duration such as 90s, 30m, 24h or 7d"),
        (("--grace=-5s",), "is not a duration"),
        (("--grace", "10y"), "is not a duration"),
        (("--grace", ""), "is not a duration"),
        (("--blobs", "s3://bucket/eu"), "s3://"),
    ]:
        proc = run_cli("fleet", "gc", *args, state=state)
        assert proc.returncode == 1 and proc.stdout == "", (args, proc)
        (line,) = proc.stderr.splitlines()
        assert problem in line, (args, line)


def test_a_grace_is_seconds_minutes_hours_or_days() -> None:
    from capsulefs.cli.fleet_cmds import parse_duration

    assert [parse_duration(t, "--grace") for t in ("90s", "30m", "24h", "7d", "15", "0s")] == [
        90.0, 1800.0, 86400.0, 604800.0, 15.0, 0.0]
