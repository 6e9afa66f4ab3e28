"""Separate hosts on one machine: network and mount namespaces, for tests of many-host clusters.

Every other multi-node test runs its Ray "nodes" on one host: one loopback, one filesystem, one
`/tmp`. Whatever assumes a single host passes there. `HostCluster` makes hosts that differ where
real ones do: each is a network namespace with its own loopback and an address on a bridge
(10.77.<net>.<i>/24) that lives in a namespace of its own, and a mount namespace with a private
`/tmp` and a private node-local directory (`NODE_DIR`); one directory is shared by all
(`SHARED_DIR`, standing in for NFS or a shared volume). Nothing is routed out of the bridge:
the hosts reach each other and nothing else.

A host's namespaces are held by an anchor process (`sleep`), and every command runs inside them
through `nsenter`, so `ray start` and a later driver on the same host see the same `/tmp/ray`.
Needs root (the suite runs as root inside `unshare --net`, which these namespaces sit beside).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

SHARED_DIR = "/mnt/longrun-hosts/shared"  # the same directory on every host
NODE_DIR = "/mnt/longrun-hosts/node"  # a directory of each host's own
KEEP_DIR = "/mnt/longrun-hosts/keep"  # staging mountpoints for what a host's own /tmp must keep
# A test cluster on a private bridge, reached by nothing else: without Ray's token authentication
# (which a ~/.ray/auth_token left by a local `ray.init()` would turn on), unless the environment
# chose a mode. `longrun run`'s embedded head is another matter: it always demands a token of its
# own (services/ray_head.py).
AUTH_DEFAULT = {"RAY_AUTH_MODE": "disabled"}


def python_without_longrun(env_dir: Path) -> Path:
    """A python with longrun's dependencies and without longrun, as a user's cluster often has:
    a fresh venv whose .pth adds this venv's site-packages as a plain path (so its own .pth
    files, the editable install's finder among them, are not run). A job submitted to a Ray
    cluster on it runs only because `longrun submit` ships longrun with it."""
    import sysconfig
    import venv

    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = Path(env_dir) / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "zz_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return py


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Host:
    name: str
    netns: str
    address: str
    node_dir: Path  # what NODE_DIR is on this host, seen from outside
    anchor: subprocess.Popen | None = field(default=None, repr=False)

    def argv(self, command: list[str]) -> list[str]:
        """`command` run inside this host's network and mount namespaces."""
        assert self.anchor is not None, "the host is not up"
        return ["nsenter", "-t", str(self.anchor.pid), "-n", "-m", "--", *command]

    def popen(self, command: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(self.argv(command), **kw)

    def run(self, command: list[str], *, timeout: float = 120, check: bool = True,
            **kw) -> subprocess.CompletedProcess:
        done = subprocess.run(self.argv(command), capture_output=True, text=True, timeout=timeout, **kw)
        if check and done.returncode != 0:
            raise RuntimeError(f"{self.name}: {shlex.join(command)} exited {done.returncode}\n"
                               f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done

    def pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def kill_all(self) -> None:
        """Every process on this host, at once (the host is lost): SIGKILL, no clean-up."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


class HostCluster:
    """`count` hosts on one bridge; a context manager that tears everything down."""

    def __init__(self, count: int, workdir: Path, *, net: int = 0):
        self.id = uuid.uuid4().hex[:6]
        self.workdir = Path(workdir)
        self.shared = self.workdir / "shared"
        self.switch = f"lr-sw-{self.id}"
        self.hosts = [Host(f"host{i}", f"lr-h{i}-{self.id}", f"10.77.{net}.{i}",
                           self.workdir / f"host{i}-node") for i in range(1, count + 1)]

    def __enter__(self) -> HostCluster:
        try:
            self._up()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _up(self) -> None:
        self.shared.mkdir(parents=True, exist_ok=True)
        for mountpoint in (SHARED_DIR, NODE_DIR):
            Path(mountpoint).mkdir(parents=True, exist_ok=True)
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts, start=1):
            host.node_dir.mkdir(parents=True, exist_ok=True)
            inside, outside = f"vh{i}-{self.id}", f"vb{i}-{self.id}"
            _ip("netns", "add", host.netns)
            _ip("link", "add", inside, "type", "veth", "peer", "name", outside)
            _ip("link", "set", inside, "netns", host.netns)
            _ip("link", "set", outside, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", outside, "master", "br0")
            _ip("-n", self.switch, "link", "set", outside, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            _ip("-n", host.netns, "link", "set", inside, "name", "eth0")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
            # The anchor: a private mount namespace (shared dir, node dir, an empty /tmp) that
            # every later command of this host enters.
            keep_before, keep_after = self._keep_under_tmp()
            mounts = (f"mount --make-rprivate / && {keep_before}"
                      f"mount --bind {shlex.quote(str(self.shared))} {SHARED_DIR} && "
                      f"mount --bind {shlex.quote(str(host.node_dir))} {NODE_DIR} && "
                      "mount -t tmpfs -o size=2g longrun-host-tmp /tmp && "
                      f"{keep_after}echo ready && exec sleep infinity")
            host.anchor = subprocess.Popen(["ip", "netns", "exec", host.netns, "unshare", "--mount", "--",
                                            "sh", "-c", mounts], stdout=subprocess.PIPE, text=True)
            if host.anchor.stdout.readline().strip() != "ready":
                raise RuntimeError(f"{host.name}: its mounts failed (exit {host.anchor.wait()})")

    @property
    def head(self) -> Host:
        return self.hosts[0]

    def start_ray(self, python: Path, *, head_cpus: int = 0, node_cpus: int = 1, port: int = 6380,
                  env: dict[str, str] | None = None) -> str:
        """A Ray head on the first host (its Jobs API at http://<address>:8265) and a node on each
        other, all running `python` (first on their PATH, so a job's `python3` is it too);
        returns the Jobs API address."""
        env = {**AUTH_DEFAULT, **os.environ, **(env or {}), "RAY_USAGE_STATS_ENABLED": "0",
               "PATH": os.pathsep.join([str(Path(python).parent), os.environ.get("PATH", "")])}
        ray = [str(python), "-m", "ray.scripts.scripts", "start", "--disable-usage-stats"]
        self.head.run([*ray, "--head", f"--node-ip-address={self.head.address}", f"--port={port}",
                       f"--num-cpus={head_cpus}", "--include-dashboard=true",
                       f"--dashboard-host={self.head.address}"], env=env, timeout=180)
        for host in self.hosts[1:]:
            host.run([*ray, f"--address={self.head.address}:{port}", f"--node-ip-address={host.address}",
                      f"--num-cpus={node_cpus}"], env=env, timeout=180)
        return f"http://{self.head.address}:8265"

    @staticmethod
    def _keep_under_tmp() -> tuple[str, str]:
        """Shell, before and after a host's /tmp is replaced, that puts back inside it what the
        hosts' python needs from the real one: this interpreter's environment and longrun's
        source, when they live under /tmp (a checkout there). Each is bound to a staging
        mountpoint first, then from there to its own path in the new /tmp."""
        import longrun

        roots = {Path(sys.prefix).resolve(), Path(next(iter(longrun.__path__))).resolve().parent}
        needed = sorted(p for p in roots if p.is_relative_to("/tmp"))
        before = after = ""
        for i, path in enumerate(needed):
            stage, where = f"{KEEP_DIR}{i}", shlex.quote(str(path))
            Path(stage).mkdir(parents=True, exist_ok=True)
            before += f"mount --bind {where} {stage} && "
            after += f"mkdir -p {where} && mount --bind {stage} {where} && "
        return before, after

    def __exit__(self, *exc) -> None:
        for host in self.hosts:
            host.kill_all()
            if host.anchor is not None:
                host.anchor.kill()
                host.anchor.wait()
        for name in [h.netns for h in self.hosts] + [self.switch]:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def main(argv: list[str] | None = None) -> int:
    """`python -m longrun.testing.hosts [--hosts N] [-- COMMAND ...]`: bring up N hosts with a
    Ray cluster across them (head on host 1, no CPUs; one CPU on each other), run COMMAND on
    host 1 (default: a shell) with $RAY_API and $SHARED_DIR set, then tear everything down.
    Root only, like the tests; run it inside `unshare --net` to keep the machine's own network
    out of reach."""
    import argparse
    import sys
    import tempfile

    parser = argparse.ArgumentParser(prog="python -m longrun.testing.hosts", description=main.__doc__)
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("command", nargs="*", default=["bash"])
    args = parser.parse_args(argv)
    with (tempfile.TemporaryDirectory(prefix="longrun-hosts-") as work,
          HostCluster(args.hosts, Path(work)) as cluster):
        print(f"[hosts] {', '.join(f'{h.name} {h.address}' for h in cluster.hosts)}; shared {cluster.shared} "
              f"(at {SHARED_DIR} on each); starting Ray", file=sys.stderr, flush=True)
        api = cluster.start_ray(Path(sys.executable))
        print(f"[hosts] Ray Jobs API {api}; running {shlex.join(args.command)} on {cluster.head.name}",
              file=sys.stderr, flush=True)
        env = {**os.environ, "RAY_API": api, "SHARED_DIR": SHARED_DIR}
        return cluster.head.popen(args.command, env=env).wait()


if __name__ == "__main__":
    raise SystemExit(main())
