"""A real two-node Slurm cluster on this one machine, for integration tests.

Debian's ``slurmctld``/``slurmd``/``munge`` packages run as root without systemd.  ``SlurmCluster`` starts munged (when
it is not already answering), one ``slurmctld`` and one ``slurmd -N vmK`` per virtual node, all configured from a
private ``slurm.conf`` under the directory it is given; ``SLURM_CONF`` points the daemons and every client tool at it,
so ``/etc/slurm`` is never touched.  Leaving the ``with`` block cancels every job, stops the daemons and wipes the state,
so job ids restart at 1 in the next session.

Used through the session fixture ``slurm_cluster`` in ``tests/integration/conftest.py``; it can also be driven by hand::

    with SlurmCluster("/tmp/sc") as cluster:
        job = cluster.sbatch(["--nodes=2", "/abs/path/job.sh"])
        cluster.wait_state(job, "COMPLETED")
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
NODES = ("vm1", "vm2")
CPUS_PER_NODE = 2
GPUS_PER_NODE = 2
PARTITIONS = ("cheap", "a100")
# Set to "PID:ROOT" in the environment of every daemon we start, so a later session can find (and end) the daemons
# and job steps that a crashed session left behind, without touching any other Slurm on the machine or the cluster
# of a test session that is still running.
MARKER_ENV = "SHARDRL_TEST_SLURM_CLUSTER"
DAEMONS = ("slurmctld", "slurmd", "slurmstepd")
MUNGE_SOCKET_DIR = Path("/run/munge")


def ensure_slurm_installed() -> str | None:
    """Install the Slurm and munge packages when missing; None on success, else why not (for ``pytest.skip``)."""
    if os.geteuid() != 0:
        return "the test Slurm cluster runs munged, slurmctld and slurmd, which needs root"
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged", "unmunge")):
        return None
    if shutil.which("apt-get") is None:
        return "Slurm is not installed and there is no apt-get to install it"
    if _apt_install() != 0:
        # Package lists may be missing or stale on a fresh machine; refresh them only when the cheap path failed.
        update = subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True, check=False)
        if update.returncode != 0:
            return f"apt-get update failed: {update.stderr.strip()[-300:]}"
        if _apt_install() != 0:
            return f"apt-get install {' '.join(PACKAGES)} failed"
    return None


def _apt_install() -> int:
    # Without systemd the packages' postinst scripts try to start the daemons through invoke-rc.d, and slurmctld's
    # fails the whole install when it cannot start (there is no slurm.conf yet).  A policy-rc.d that denies every
    # start keeps the install to installing; one the machine already has is left as it is.
    policy = Path("/usr/sbin/policy-rc.d")
    ours = not policy.exists()
    if ours:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
        return subprocess.run(cmd, env=env, capture_output=True, check=False).returncode
    finally:
        if ours:
            policy.unlink(missing_ok=True)


class SlurmCluster:
    """Two virtual nodes (``vm1``, ``vm2``: 2 CPUs and 2 fake GPUs each) in partitions ``cheap`` (default) and ``a100``.

    ``root`` is a private directory for the config, state, spool, logs and fake GPU devices.  ``env`` is the
    environment a child process needs to reach the cluster (``SLURM_CONF``); it is also exported into ``os.environ``
    while the cluster runs.
    """

    def __init__(self, root: str | Path, *, start_timeout: float = 60.0) -> None:
        self.root = Path(root).absolute()
        self.start_timeout = start_timeout
        self.conf = self.root / "etc" / "slurm.conf"
        self.logs = self.root / "log"
        # Default working directory of sbatch, so default slurm-%j.out files land here and not in the caller's cwd.
        self.job_dir = self.root / "jobs"
        self.nodes = NODES
        self.partitions = PARTITIONS
        self.env: dict[str, str] = {"SLURM_CONF": str(self.conf)}
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._munged: subprocess.Popen[bytes] | None = None
        self._saved_slurm_conf: str | None = None
        self._started = False

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        kill_leftover_daemons(self.root)
        if self.root.exists():
            shutil.rmtree(self.root)
        for d in (self.conf.parent, self.logs, self.job_dir, self.root / "state", self.root / "dev"):
            d.mkdir(parents=True)
        self._saved_slurm_conf = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = str(self.conf)
        self._started = True
        try:
            self._start_munge()
            host = _ensure_hostname_resolves()
            self._write_config(host)
            daemon_env = {**os.environ, **self.env, MARKER_ENV: f"{os.getpid()}:{self.root}"}
            self._spawn("slurmctld", ["slurmctld", "-D"], daemon_env)
            self._wait(self._controller_up, "slurmctld to answer scontrol ping")
            for node in self.nodes:
                self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node], daemon_env)
            self._wait(self._nodes_idle, f"nodes {', '.join(self.nodes)} to be idle")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Cancel every job, stop the daemons (and munged if we started it) and wipe the state."""
        if not self._started:
            return
        self._started = False
        if self._procs.get("slurmctld") is not None and self._procs["slurmctld"].poll() is None:
            self.cancel_all_jobs()
            self.run("scontrol", "shutdown", check=False, timeout=10)
        for proc in self._procs.values():
            _stop(proc, grace=10)
        self._procs.clear()
        kill_leftover_daemons(self.root)  # job steps outlive a killed slurmd
        if self._munged is not None:
            _stop(self._munged, grace=5)
            self._munged = None
        if self._saved_slurm_conf is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = self._saved_slurm_conf
        shutil.rmtree(self.root, ignore_errors=True)

    # ------------------------------------------------------------------ jobs
    def run(
        self, *cmd: str, check: bool = True, timeout: float = 30, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command against this cluster; raises with its stderr when it fails and ``check``."""
        full_env = {**os.environ, **self.env, **(env or {})}
        res = subprocess.run(
            list(cmd),
            env=full_env,
            cwd=self.job_dir,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {res.returncode}: {res.stderr.strip()}")
        return res

    def sbatch(self, args: list[str], env: Mapping[str, str] | None = None) -> int:
        """Submit with ``sbatch --parsable *args`` and return the job id.

        ``env`` adds to (or overrides) the caller's environment, which sbatch exports into the job by default.  The
        command runs in ``job_dir``, so pass absolute paths for the script and any ``--output``.
        """
        out = self.run("sbatch", "--parsable", *args, env=env).stdout.strip()
        return int(out.splitlines()[-1].split(";")[0])

    def squeue_states(self, job_id: int) -> list[str]:
        """States of the job's entries (one per array task or het component); [] once slurmctld forgot the job."""
        res = self.run("squeue", "-h", "--states=all", "-j", str(job_id), "-o", "%T", check=False)
        if res.returncode != 0:  # "Invalid job id specified" once the job has been purged
            return []
        return res.stdout.split()

    def wait_state(self, job_id: int, states: str | Iterable[str], timeout: float = 60.0) -> list[str]:
        """Wait until every entry of the job is in one of ``states`` (e.g. ``"RUNNING"``); return the states seen."""
        wanted = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        seen: list[str] = []
        while time.monotonic() < deadline:
            seen = self.squeue_states(job_id)
            if seen and all(s in wanted for s in seen):
                return seen
            time.sleep(0.2)
        raise TimeoutError(
            f"job {job_id} did not reach {sorted(wanted)} in {timeout:.0f}s (now {seen or 'unknown'})\n"
            + self.log_tail()
        )

    def scancel(self, job_id: int, *flags: str) -> None:
        """``scancel *flags job_id``, e.g. ``scancel(j, "--signal=TERM", "--batch")``."""
        self.run("scancel", *flags, str(job_id))

    def job_info(self, job_id: int) -> dict[str, str]:
        """The job's record from ``scontrol show job -o`` as a dict (the first component of a het job)."""
        res = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        line = res.stdout.strip().splitlines()[0] if res.returncode == 0 and res.stdout.strip() else ""
        if not line:
            raise LookupError(f"slurmctld does not know job {job_id}: {res.stderr.strip()}")
        return parse_record(line)

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of every daemon log, for assertion messages."""
        parts = []
        for log in sorted(p for p in self.logs.iterdir() if p.stat().st_size):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    # ------------------------------------------------------------------ setup pieces
    def _start_munge(self) -> None:
        if _munge_works():
            return
        MUNGE_SOCKET_DIR.mkdir(parents=True, exist_ok=True)
        shutil.chown(MUNGE_SOCKET_DIR, "munge", "munge")
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            key.write_bytes(os.urandom(128))
            key.chmod(0o400)
            shutil.chown(key, "munge", "munge")
        # --force: a munged that died uncleanly leaves its socket behind, which would make a new one refuse to start.
        with open(self.logs / "munged.stderr", "wb") as err:
            self._munged = subprocess.Popen(
                ["munged", "--foreground", "--force"],
                user="munge",
                group="munge",
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,
            )
        self._wait(_munge_works, "munged to answer", timeout=15)

    def _write_config(self, host: str) -> None:
        ctld_port, *node_ports = _free_ports(1 + len(self.nodes))
        mem = _real_memory_mb(len(self.nodes))
        d = self.root
        gres_lines = []
        node_lines = []
        for node, port in zip(self.nodes, node_ports, strict=True):
            for i in range(GPUS_PER_NODE):
                _make_fake_device(d / "dev" / f"{node}-gpu{i}")
            gres_lines.append(f"NodeName={node} Name=gpu File={d}/dev/{node}-gpu[0-{GPUS_PER_NODE - 1}]")
            node_lines.append(
                f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={CPUS_PER_NODE} "
                f"RealMemory={mem} Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN"
            )
        all_nodes = ",".join(self.nodes)
        conf = f"""\
# Written by tests/integration/slurm_cluster.py; wiped when the test session ends.
ClusterName=shardrltest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_min_interval=100000
DependencyParameters=kill_invalid_depend
# A requeued job waits out the job credential's lifetime before it may start again (120 s by default); a minute
# keeps the requeue tests well inside their waits.
AuthInfo=cred_expire=60
# Lets a virtual node declare more CPUs, memory and GPUs than this machine has.
SlurmdParameters=config_overrides
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
ReturnToService=2
InactiveLimit=0
MinJobAge=600
# Real clusters use the default of 30 s between SIGTERM and SIGKILL; 5 s keeps tests short.  A drain that passes
# here must still be planned to finish well inside 30 s.
KillWait=5
GresTypes=gpu
{chr(10).join(node_lines)}
PartitionName=cheap Nodes={all_nodes} Default=YES MaxTime=INFINITE State=UP
PartitionName=a100 Nodes={all_nodes} Default=NO MaxTime=INFINITE State=UP
"""
        self.conf.write_text(conf)
        (self.conf.parent / "gres.conf").write_text("\n".join(gres_lines) + "\n")

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        with open(self.logs / f"{name}.stderr", "wb") as err:
            self._procs[name] = subprocess.Popen(
                cmd,
                env=env,
                cwd=self.root,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=True,
            )

    def _controller_up(self) -> bool:
        return "UP" in self.run("scontrol", "ping", check=False, timeout=10).stdout

    def _nodes_idle(self) -> bool:
        res = self.run("sinfo", "-h", "-N", "-p", PARTITIONS[0], "-o", "%N %T", check=False, timeout=10)
        states = dict(line.split() for line in res.stdout.splitlines() if line.strip())
        for node in self.nodes:
            state = states.get(node, "")
            # A node may register once as drain/inval/down before its config settles; resuming it is enough.
            if any(s in state for s in ("drain", "inval", "down", "fail")):
                self.run("scontrol", "update", f"nodename={node}", "state=resume", check=False, timeout=10)
        return all(states.get(node) == "idle" for node in self.nodes)

    def _wait(self, ready: Callable[[], bool], what: str, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or self.start_timeout)
        while time.monotonic() < deadline:
            for name, proc in [*self._procs.items(), ("munged", self._munged)]:
                if proc is None:
                    continue
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited {proc.returncode} while waiting for {what}\n{self.log_tail()}"
                    )
            if ready():
                return
            time.sleep(0.2)
        raise TimeoutError(f"timed out waiting for {what}\n{self.log_tail()}")

    def cancel_all_jobs(self) -> None:
        """scancel every job in the queue and wait (KillWait plus slack) until none is left."""
        ids = self.run("squeue", "-h", "-o", "%A", check=False, timeout=10).stdout.split()
        if not ids:
            return
        self.run("scancel", *ids, check=False, timeout=10)
        deadline = time.monotonic() + 15  # KillWait plus slack
        while (
            time.monotonic() < deadline and self.run("squeue", "-h", "-o", "%A", check=False).stdout.strip()
        ):
            time.sleep(0.3)


def parse_record(line: str) -> dict[str, str]:
    """``Key=Value Key2=a b Key3=...`` (one ``scontrol -o`` line) -> dict; values may contain spaces and ``=``."""
    starts = list(re.finditer(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/.]*)=", line))
    record = {}
    for m, nxt in zip(starts, [*starts[1:], None], strict=True):
        end = nxt.start() if nxt is not None else len(line)
        record[m.group(1)] = line[m.end() : end].strip()
    return record


def kill_leftover_daemons(root: Path | None = None) -> list[int]:
    """SIGKILL the Slurm daemons (and their jobs) of crashed test sessions and of the cluster in ``root``."""
    marker = f"{MARKER_ENV}=".encode()
    mine = f"{os.getpid()}:{root}".encode()
    ours: set[int] = set()
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            # "pid (comm) state ppid ...": comm may hold spaces, so split after its closing parenthesis.
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(proc.name))
            if comm in DAEMONS and _left_behind(proc / "environ", marker, mine):
                ours.add(int(proc.name))
        except (OSError, ValueError):  # gone meanwhile, or not readable
            continue
    # Batch scripts and tasks are children of slurmstepd; a killed step would leave them running as orphans.
    doomed: list[int] = []
    todo = sorted(ours)
    while todo:
        pid = todo.pop()
        doomed.append(pid)
        todo.extend(children.get(pid, []))
    for pid in doomed:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while doomed and time.monotonic() < deadline and any(_alive(p) for p in doomed):
        time.sleep(0.1)
    return doomed


def _left_behind(environ: Path, marker: bytes, mine: bytes) -> bool:
    for var in environ.read_bytes().split(b"\0"):
        if var.startswith(marker):
            value = var[len(marker) :]
            return value == mine or not _alive(int(value.split(b":")[0]))
    return False


def _alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting for its parent (often PID 1 here) to reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _stop(proc: subprocess.Popen[bytes], grace: float) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _munge_works() -> bool:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        cred = subprocess.run(["munge", "-n"], capture_output=True, timeout=5, check=True).stdout
        subprocess.run(["unmunge"], input=cred, capture_output=True, timeout=5, check=True)
        return True
    return False


def _ensure_hostname_resolves() -> str:
    """This host's short name, which slurmctld must find in SlurmctldHost; added to /etc/hosts when unresolvable."""
    host = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(host)
    except OSError:
        with open("/etc/hosts", "a") as f:
            f.write(f"127.0.0.1 {host}\n")
    return host


def _free_ports(n: int) -> list[int]:
    """Ports free right now (a real Slurm on the same machine keeps its 6817/6818)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _real_memory_mb(n_nodes: int) -> int:
    total_kb = next(
        int(line.split()[1])
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal:")
    )
    return max(1024, total_kb // 1024 // n_nodes)


def _make_fake_device(path: Path) -> None:
    """A character device for a fake GPU: gres needs one; /dev/null's numbers make it harmless."""
    try:
        os.mknod(path, 0o666 | 0o020000, os.makedev(1, 3))
    except PermissionError:  # no CAP_MKNOD (some containers): a link to /dev/null is a character device too
        path.symlink_to("/dev/null")
