"""Run untrusted, model-written Python programs for code-RL rewards: `run_python(code, stdin, limits, files)`.

How a run works. The caller (a reward-pool worker: it has a thread, so no `preexec_fn`) starts
`[unshare --net --pid --ipc --mount --fork --kill-child] python -I -S -B -X utf8 -c HARNESS` in a session of
its own (HARNESS: the text of harness.py, beside this file).
The harness reads its settings from the head of its stdin (not argv: /proc/PID/cmdline is world-readable and one
argument is capped at 128 KiB), then, still root, mounts small private tmpfs over /tmp, /dev/shm, /var/tmp and
/run/lock, drops to a fresh uid/gid (random in 10^9..2*10^9, no supplementary groups, `no_new_privs`), writes the
program (`main.py`) and `files` into its working directory (/tmp), sets rlimits, says "ok" on a status pipe and
runs the program in-process as `__main__`. The caller feeds stdin and reads stdout and stderr (each up to
`output_bytes`) in one selector loop, which also enforces the wall clock; on a limit it SIGKILLs the process group
(unshare and the namespace's init: the kernel then kills everything in the pid namespace), and it classifies the
outcome from the exit status, the harness's reserved exit codes and the status pipe.

What it stops (root with unshare, as on our machines and CI; `isolation()` says what this machine gives):
- runaway time: the wall clock (the caller kills) and CPU time (RLIMIT_CPU); every process the program started
  dies with it: the program is init of its own pid namespace, so even a fork bomb that calls setsid() is cleaned
  up, and the harness watches a pipe only the caller holds, so the run also ends if the caller dies mid-run (the
  reward pool kills workers that overrun their timeout);
- fork bombs: RLIMIT_NPROC counts per uid and every run has its own, so a bomb takes neither the machine's nor
  another sandbox's process slots;
- memory: RLIMIT_AS per process. Output: stdout and stderr are read up to the cap, then the run is killed (the
  caller never holds more). Disk: RLIMIT_FSIZE per file, the tmpfs size for all of them together;
- the network, when `network=False`: a new network namespace whose only interface, loopback, is down;
- leftovers: System V shared memory, semaphores and message queues live in an IPC namespace of the run's own, and
  vanish with it (they would otherwise outlive the program, outside every rlimit);
- the rest of the machine: as a uid that owns nothing, the program cannot write or delete outside its tmpfs (and
  what it writes there vanishes with its mount namespace), cannot read 0600/0640 files (RUN_DIR/api_key,
  /etc/shadow), cannot signal or ptrace other processes (the caller, other sandboxes) nor read their environment;
  setuid binaries give it nothing (`no_new_privs`); it cannot make a user namespace (a seccomp filter), where it
  would be root enough to mount a tmpfs that no limit counts; its environment is built from scratch, so secrets in the
  caller's (PIPELINERL_API_KEY) never reach it.

What it does not stop:
- reading anything world-readable: the source tree, the venv, /etc, model files with mode 644, and /proc (the
  host's: the process list and other processes' command lines are visible);
- Unix sockets with a path: a network namespace does not cover them, so a world-writable one (the D-Bus system
  bus, say) can be connected to;
- the kernel's attack surface: the seccomp filter refuses only new user namespaces (and clone3); every other
  system call is allowed, so a kernel bug is a way out;
- memory and CPU time in total: both limits are per process, so a run may hold up to `processes` x `memory_mb`
  plus its tmpfs (there is no cgroup), and the wall clock is what bounds the CPU time of many processes;
- a program exiting with a reserved exit code on purpose is reported as what the code means; that is only ever a
  failure status ("sandbox_error" cannot be faked: it means the status pipe never said "ok").

Weaker machines, detected once per process and reported by `isolation()`: without unshare (missing or refused)
there are no namespaces: network is open, and setsid() children escape the group kill (with a separate user
they are still found and killed by uid). A non-root caller gets no separate user: the program runs as the
caller's user (inside a user namespace, when allowed, so the pid and network namespaces still apply), can read
and write what that user can, and RLIMIT_NPROC counts that user's tasks (from zero in a fresh user namespace,
else the limit becomes "the user's current task count + processes"). Without the private tmpfs, the working
directory is a fresh 0700 directory on disk, removed afterwards, /tmp is shared, and the disk a run may fill is
bounded per file only.

What a program sees differently from `python main.py`: it is pid 1 of its namespace, so signals it sends itself
whose action is the default (os.kill(os.getpid(), SIGTERM), an alarm without a handler) are ignored; `site` has
not run (the harness adds the site-packages directories and `exit`/`quit`, but not .pth hooks); when the
interpreter lives under a 0700 directory (as /root/.pyenv does here) the standard library is on sys.path as
/proc/self/fd/N (directory fds opened before the privilege drop), which serves imports, but `sys.executable`
cannot be run by the sandbox user.
"""

from __future__ import annotations

import functools
import logging
import marshal
import math
import os
import resource
import secrets
import selectors
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

MAIN_FILE = "main.py"  # the program's own file in its working directory, so tracebacks show its lines
PRIVATE_TMP = "/tmp"  # the working directory when the run has its own tmpfs there
# Exit codes the harness reserves (documented in the module docstring: a program can exit with them itself).
EXIT_MEMORY, EXIT_CPU, EXIT_SETUP, EXIT_ORPHANED = 251, 252, 253, 254
_UID_BASE, _UID_SPAN = 1_000_000_000, 1_000_000_000  # far above login users and the usual subuid ranges
_DRAIN_GRACE_S = 1.0  # after the run ends or is killed: how long to wait for the pipes to close (normally ~ms)
_SMALL_TMPFS_MB = 1  # /var/tmp and /run/lock: world-writable places a program has no business filling


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may take. Every limit is per run; `processes` counts the program's main process too."""

    cpu_s: float = 2.0  # RLIMIT_CPU, rounded up to whole seconds (SIGXCPU there, SIGKILL one second later)
    wall_s: float = 5.0  # parent kills the whole process group / pid namespace after this
    memory_mb: int = 512  # RLIMIT_AS of the program (per process)
    output_bytes: int = 1 << 20  # stdout and stderr each capped; over it -> status "output_limit", program killed
    file_mb: int = 16  # RLIMIT_FSIZE
    open_files: int = 64  # RLIMIT_NOFILE
    processes: int = 16  # RLIMIT_NPROC (tasks, threads included) of the run's own uid
    network: bool = False  # False: a new network namespace (loopback only, down) where the machine allows
    disk_mb: int = 64  # size of the private /tmp (and /dev/shm) tmpfs, where the machine gives one

    def __post_init__(self) -> None:
        for name in ("cpu_s", "wall_s", "memory_mb", "output_bytes", "file_mb", "open_files", "processes", "disk_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive number, got {value!r}")


@dataclass
class RunResult:
    """What a run did. `reason` says why, in words, when the status is not "ok" (e.g. which limit was hit)."""

    status: str  # "ok" | "error" | "timeout" | "memory" | "output_limit" | "killed" | "sandbox_error"
    returncode: int | None
    stdout: str  # decoded utf-8 (errors="replace"), at most output_bytes
    stderr: str
    wall_s: float
    reason: str = ""
    cpu_s: float = 0.0  # CPU seconds of the run's processes (those reaped before it ended; from wait4)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# The child side: harness.py beside this file, read once here and run as `python -I -S -B -X utf8 -c HARNESS`
# (see its header for why so).
HARNESS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness.py")


def _read_harness() -> str:
    with open(HARNESS_FILE, encoding="utf-8") as f:
        return f.read()


HARNESS = _read_harness()


def _no_user_namespaces_filter() -> bytes:
    """A seccomp program that refuses new user namespaces (unshare or clone with CLONE_NEWUSER: EPERM) and clone3
    (ENOSYS, whose flags a filter cannot read; glibc then falls back to clone, as under Docker's default profile).

    Why: inside a user namespace of its own a program is root enough to mount a tmpfs, whose pages count against
    neither RLIMIT_AS nor the private /tmp's size, so one run could fill the machine's memory. Everything else is
    allowed. Foreign system call conventions (i386 `int 0x80`, x32) get ENOSYS, so they cannot go around it.
    Empty (no filter) on architectures other than x86-64 and aarch64."""
    import platform
    import struct

    arch, nrs = {"x86_64": (0xC000003E, {"clone": 56, "unshare": 272, "clone3": 435}),
                 "aarch64": (0xC00000B7, {"clone": 220, "unshare": 97, "clone3": 435})}.get(
        platform.machine(), (None, None))
    if arch is None:
        return b""
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    program = [  # (code, jump if true, jump if false, k); jumps count from the next instruction
        (ld, 0, 0, 4),                            # 0: arch
        (jeq, 0, 9, arch),                        # 1: foreign convention -> 11
        (ld, 0, 0, 0),                            # 2: system call number
        (jge, 7, 0, 0x40000000),                  # 3: x32 -> 11
        (jeq, 6, 0, nrs["clone3"]),               # 4: -> 11
        (jeq, 1, 0, nrs["unshare"]),              # 5: -> 7
        (jeq, 0, 2, nrs["clone"]),                # 6: -> 7, else -> 9
        (ld, 0, 0, 16),                           # 7: flags, the low half of the first argument
        (jset, 1, 0, 0x10000000),                 # 8: CLONE_NEWUSER -> 10
        (ret, 0, 0, allow),                       # 9
        (ret, 0, 0, eperm),                       # 10
        (ret, 0, 0, enosys),                      # 11
    ]
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in program)


SECCOMP_FILTER = _no_user_namespaces_filter()


@dataclass(frozen=True)
class _Mode:
    """One way of isolating runs; `_detect_mode` picks the strongest this machine allows."""

    unshare: str | None  # the unshare binary, or None: no namespaces
    namespaces: tuple[str, ...] = ()  # e.g. ("--net", "--pid", "--mount")
    separate_user: bool = False  # root: each run gets its own fresh uid
    private_tmp: bool = False  # root in a mount namespace: tmpfs over the world-writable directories

    def __post_init__(self) -> None:
        if self.private_tmp and "--mount" not in self.namespaces:  # the harness checks again before mounting
            raise ValueError("private_tmp needs a mount namespace: it would mount over the machine's own /tmp")

    def command_prefix(self, network: bool) -> list[str]:
        if self.unshare is None or not self.namespaces:
            return []
        flags = [f for f in self.namespaces if not (network and f == "--net")]
        propagation = ["--propagation", "private"] if "--mount" in flags else []
        return [self.unshare, *flags, *propagation, "--fork", "--kill-child"]

    def describe(self) -> dict[str, bool]:
        return {"network_namespace": "--net" in self.namespaces, "pid_namespace": "--pid" in self.namespaces,
                "separate_user": self.separate_user, "private_tmp": self.private_tmp}


_mode: _Mode | None = None
_mode_lock = threading.Lock()


def isolation() -> dict[str, bool]:
    """What this machine gives: {"network_namespace", "pid_namespace", "separate_user", "private_tmp"}.

    Probed once per process (a few short trial runs, ~50 ms) and cached, so callers and tests can say which
    guarantees hold instead of assuming them; `run_python` uses the same answer."""
    return _detect_mode().describe()


def _candidate_modes() -> list[_Mode]:
    """Strongest first. Root can drop to a fresh uid and mount; a non-root user gets namespaces only through a
    user namespace (mapped to itself, so the program keeps the user's identity and no capabilities)."""
    unshare = shutil.which("unshare")
    root = os.geteuid() == 0
    candidates = []
    if unshare and root:
        candidates += [_Mode(unshare, ("--net", "--pid", "--ipc", "--mount"), separate_user=True, private_tmp=True),
                       _Mode(unshare, ("--net", "--pid", "--ipc"), separate_user=True)]
    elif unshare:
        candidates += [_Mode(unshare, ("--user", "--map-current-user", "--net", "--pid", "--ipc")),
                       _Mode(unshare, ("--user", "--map-root-user", "--net", "--pid", "--ipc"))]
    if root:
        candidates.append(_Mode(None, separate_user=True))
    candidates.append(_Mode(None))
    return candidates


def _detect_mode() -> _Mode:
    global _mode
    with _mode_lock:
        if _mode is None:
            candidates = _candidate_modes()
            _mode = candidates[-1]  # the weakest needs nothing from the machine: it is not probed
            for mode in candidates[:-1]:
                if _probe(mode):
                    _mode = mode
                    break
        return _mode


def _probe(mode: _Mode) -> bool:
    """A trial run under `mode`: the harness must set up and the program must see the identity it should."""
    probe_limits = SandboxLimits(wall_s=30.0, cpu_s=10.0)
    try:
        result = _execute("import os\nprint(os.getuid(), os.getcwd())", "", probe_limits, None, (), mode)
    except OSError:
        return False
    if result.status != "ok":
        return False
    uid, _, cwd = result.stdout.strip().partition(" ")
    if mode.separate_user and uid == str(os.geteuid()):
        return False
    return not mode.private_tmp or cwd == PRIVATE_TMP


def run_python(code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits(),  # noqa: B008 (immutable)
               files: dict[str, str] | None = None, argv: Sequence[str] = ()) -> RunResult:
    """Run `code` as a python program in a fresh temp dir (files written there first), sandboxed.

    The program is `main.py` in its working directory (so `files` may not use that name); `argv` becomes
    `sys.argv[1:]`. Blocks until the run ends; thread-safe, so a thread pool runs programs in parallel. Never
    raises for anything the program does: every outcome is a `RunResult` (see its `status`); bad arguments
    (`files` names that are absolute or contain "..") raise ValueError."""
    mode = _detect_mode()
    _say_if_weak(mode)
    return _execute(code, stdin, limits, files, argv, mode)


@functools.cache
def _say_if_weak(mode: _Mode) -> None:
    """Once per process, in the log of the role that runs programs (the reward workers, the actor's tools): which
    protections this machine did not give, so that a weaker sandbox is never a surprise."""
    missing = [name for name, given in mode.describe().items() if not given]
    if missing:
        logging.getLogger(__name__).warning(
            "the sandbox runs model-written programs without %s on this machine (%s); see "
            "pipelinerl/sandbox/__init__.py for what that leaves open", ", ".join(missing),
            "not root" if os.geteuid() else "unshare missing or refused")


def _check_files(files: dict[str, str] | None) -> dict[str, str]:
    files = dict(files or {})
    for name, text in files.items():
        parts = name.split("/") if isinstance(name, str) else None
        if not parts or name.startswith("/") or "\0" in name or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"files: {name!r} must be a relative path without '.', '..' or empty parts")
        if name == MAIN_FILE:
            raise ValueError(f"files: {MAIN_FILE!r} is the program's own file; pick another name")
        if not isinstance(text, str):
            raise ValueError(f"files[{name!r}] must be a str, got {type(text).__name__}")
    return files


def _child_env(workdir: str) -> dict[str, str]:
    """Built from scratch, never copied: whatever secrets the caller's environment holds stay there. One thread
    per math library, so a program's numpy does not spread over every core."""
    bin_dir = os.path.dirname(sys.executable)
    return {"PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir,
            "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1"}


@functools.cache
def _site_dirs() -> list[str]:
    """The caller's site-packages (the venv's), so programs can import numpy & co. without running `site`."""
    dirs = site.getsitepackages() if hasattr(site, "getsitepackages") else []
    return [d for d in dirs if os.path.isdir(d)]


def _execute(code: str, stdin: str, limits: SandboxLimits, files: dict[str, str] | None, argv: Sequence[str],
             mode: _Mode) -> RunResult:
    """One run under an explicit mode (tests use this to exercise the fallbacks on a machine that has more)."""
    if not isinstance(code, str) or not isinstance(stdin, str):
        raise ValueError("code and stdin must be str")
    if isinstance(argv, str):
        raise ValueError("argv must be a list of arguments, not one string")
    argv = [str(a) for a in argv]
    files = _check_files(files)
    uid = _UID_BASE + secrets.randbelow(_UID_SPAN) if mode.separate_user else -1
    on_disk = not mode.private_tmp
    workdir = tempfile.mkdtemp(prefix="pipelinerl-sandbox-") if on_disk else PRIVATE_TMP
    try:
        if on_disk and uid >= 0:
            os.chown(workdir, uid, uid)
        return _spawn_and_supervise(code, stdin, limits, files, argv, mode, uid, workdir)
    finally:
        if on_disk:
            _remove_tree(workdir)


def _tmpfs_mounts(limits: SandboxLimits, uid: int) -> list[tuple[str, str]]:
    inodes = 16384  # tmpfs inodes cost kernel memory that `size` does not count
    own = f"size={limits.disk_mb}m,nr_inodes={inodes}"
    small = f"size={_SMALL_TMPFS_MB}m,nr_inodes=256,mode=1777"
    return [(PRIVATE_TMP, f"{own},mode=0700,uid={uid},gid={uid}"), ("/dev/shm", f"{own},mode=1777"),
            ("/var/tmp", small), ("/run/lock", small)]


def _spawn_and_supervise(code: str, stdin: str, limits: SandboxLimits, files: dict[str, str], argv: list[str],
                         mode: _Mode, uid: int, workdir: str) -> RunResult:
    status_r, status_w = os.pipe()
    lifeline_r, lifeline_w = os.pipe()
    settings = {
        "status_fd": status_w, "lifeline_fd": lifeline_r, "uid": uid, "workdir": workdir,
        "mounts": _tmpfs_mounts(limits, uid) if mode.private_tmp else [], "site_dirs": _site_dirs(),
        "caller_mount_ns": os.readlink("/proc/self/ns/mnt") if mode.private_tmp else "",
        "files": {**files, MAIN_FILE: code}, "main": MAIN_FILE, "argv": argv,
        "exit_codes": {"memory": EXIT_MEMORY, "cpu": EXIT_CPU, "setup": EXIT_SETUP, "orphaned": EXIT_ORPHANED},
        "rlimits": [(resource.RLIMIT_CPU, max(1, math.ceil(limits.cpu_s))),
                    (resource.RLIMIT_AS, int(limits.memory_mb) << 20),
                    (resource.RLIMIT_FSIZE, int(limits.file_mb) << 20),
                    (resource.RLIMIT_NOFILE, int(limits.open_files)),
                    (resource.RLIMIT_CORE, 0)],
        # +1: the harness's lifeline thread is a task of the uid too. A shared uid (no separate user) already has
        # tasks, counted against the limit, except in a fresh user namespace, where the count starts from zero
        "nproc": int(limits.processes) + 1, "nproc_relative": uid < 0 and "--user" not in mode.namespaces,
        "seccomp": SECCOMP_FILTER if uid >= 0 else b"",
    }
    header = marshal.dumps(settings)
    payload = len(header).to_bytes(8, "little") + header + stdin.encode("utf-8", "surrogateescape")
    cmd = [*mode.command_prefix(limits.network), sys.executable, "-I", "-S", "-B", "-X", "utf8", "-c", HARNESS]
    start = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=_child_env(workdir), cwd="/" if mode.private_tmp else workdir,
                                start_new_session=True, pass_fds=(status_w, lifeline_r))
    except OSError as e:
        for fd in (status_r, status_w, lifeline_r, lifeline_w):
            os.close(fd)
        return RunResult("sandbox_error", None, "", "", time.monotonic() - start, f"could not start: {e}")
    os.close(status_w)
    os.close(lifeline_r)
    try:
        try:  # unshare re-raises its child's fatal signal on itself: no core file from that
            resource.prlimit(proc.pid, resource.RLIMIT_CORE, (0, 0))
        except OSError:
            pass
        supervisor = _Supervisor(proc, payload, status_r, limits, start)
        supervisor.run()
        if mode.separate_user:
            # setsid() children left the process group, and without a pid namespace nothing else ends them; with
            # one, a program that is the namespace's init can still outlive unshare (the privilege drop clears the
            # parent-death signal --kill-child set, and it can disable the harness's lifeline). Every process of
            # the run has its uid, which no other run has: kill them all.
            _kill_user_tasks(uid)
        supervisor.drain()
        status, rusage = supervisor.reap()
    except BaseException:  # a bug here, or KeyboardInterrupt: the run must not outlive the call
        if proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()
        raise
    finally:
        os.close(status_r)
        os.close(lifeline_w)
    wall = time.monotonic() - start
    return _classify(supervisor, status, rusage, limits, wall)


class _Supervisor:
    """Feeds stdin, collects capped output and the harness's status message, and enforces the wall clock, all in
    one selector loop on the caller's thread (no extra threads, no deadlock on big stdin with big output)."""

    def __init__(self, proc: subprocess.Popen, payload: bytes, status_fd: int, limits: SandboxLimits,
                 start: float):
        self.proc, self.limits = proc, limits
        self.deadline = start + limits.wall_s
        self.payload, self.sent = memoryview(payload), 0
        self.out = {"stdout": bytearray(), "stderr": bytearray(), "status": bytearray()}
        self.killed_for = ""  # "timeout" | "output_limit" once the supervisor killed the run
        self.kill_reason = ""
        self.exited = self.exit_status_lost = False
        self.selector = selectors.DefaultSelector()
        try:
            self.pidfd: int | None = os.pidfd_open(proc.pid)
            self.selector.register(self.pidfd, selectors.EVENT_READ, "exit")
        except (AttributeError, OSError):  # old kernel or Python: poll with waitid instead
            self.pidfd = None
        assert proc.stdin and proc.stdout and proc.stderr
        os.set_blocking(proc.stdin.fileno(), False)
        self.selector.register(proc.stdin.fileno(), selectors.EVENT_WRITE, "stdin")
        self.selector.register(proc.stdout.fileno(), selectors.EVENT_READ, "stdout")
        self.selector.register(proc.stderr.fileno(), selectors.EVENT_READ, "stderr")
        self.selector.register(status_fd, selectors.EVENT_READ, "status")

    def _readers_left(self) -> bool:
        return any(key.data in ("stdout", "stderr", "status") for key in self.selector.get_map().values())

    def run(self) -> None:
        """Until the run's process exits or a limit is hit (then the group is killed)."""
        while not self.exited and not self.killed_for:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                self._kill("timeout", f"wall time over {self.limits.wall_s:g} s")
                break
            if self.pidfd is None:
                remaining = min(remaining, 0.02)
            for key, _ in self.selector.select(remaining):
                self._handle(key)
            if self.pidfd is None and not self.exited:
                self.exited = _has_exited(self.proc.pid)
        self._close_stdin()
        # the group: what the program started and did not move to a new session; for a run in a pid namespace
        # this kills unshare and the namespace's init, and with it everything inside
        self._killpg()

    def drain(self) -> None:
        """Read what is still in the pipes (discarding past the caps) until every writer is gone: the processes
        were just killed, so this is normally immediate; bounded in case one escaped."""
        grace = time.monotonic() + _DRAIN_GRACE_S
        while self._readers_left():
            remaining = grace - time.monotonic()
            if remaining <= 0:
                break
            for key, _ in self.selector.select(remaining):
                self._handle(key)

    def reap(self) -> tuple[int | None, resource.struct_rusage | None]:
        """Wait for the process (with its resource usage) and release every fd of the run."""
        try:
            _, status, rusage = os.wait4(self.proc.pid, 0)
            self.proc.returncode = os.waitstatus_to_exitcode(status)
        except ChildProcessError:  # reaped behind our back (a SIGCHLD handler of the caller's): status unknown
            rusage = None
            self.proc.returncode = -1
            self.exit_status_lost = True
        self.selector.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None and not stream.closed:
                stream.close()
        return (None if self.exit_status_lost else self.proc.returncode), rusage

    def _handle(self, key: selectors.SelectorKey) -> None:
        if key.data == "exit":
            self.exited = True
            self.selector.unregister(key.fd)
        elif key.data == "stdin":
            try:
                self.sent += os.write(key.fd, self.payload[self.sent:self.sent + (1 << 16)])
            except BlockingIOError:
                return
            except OSError:  # the program exited or closed its stdin: what it did not read is not its input
                self.sent = len(self.payload)
            if self.sent >= len(self.payload):
                self._close_stdin()
        else:
            try:
                chunk = os.read(key.fd, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                self.selector.unregister(key.fd)
                return
            buf = self.out[key.data]
            cap = self.limits.output_bytes if key.data != "status" else 4096
            room = cap - len(buf)
            buf += chunk[:max(room, 0)]
            if len(chunk) > room and key.data != "status" and not self.killed_for:
                self._kill("output_limit", f"{key.data} over {self.limits.output_bytes} bytes")

    def _close_stdin(self) -> None:
        stdin = self.proc.stdin
        if stdin is not None and not stdin.closed:
            try:
                self.selector.unregister(stdin.fileno())
            except KeyError:
                pass
            try:
                stdin.close()
            except OSError:
                pass

    def _kill(self, why: str, reason: str) -> None:
        self.killed_for, self.kill_reason = why, reason
        self._killpg()

    def _killpg(self) -> None:
        try:  # the pid is unreaped until `reap`, so the group id cannot belong to anyone else yet
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _has_exited(pid: int) -> bool:
    """Exited but not reaped (WNOWAIT), so `killpg` on its group id stays safe until `reap`."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _task_uids() -> dict[int, int]:
    """{pid: real uid} of every live process (zombies, which only wait for their parent to collect them, left
    out). From /proc/PID/status: after the privilege drop a sandbox process is not dumpable, so its /proc
    directory shows owner root and only the status file tells its uid."""
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as f:
                    for line in f:
                        if line.startswith("State:") and line.split()[1] in ("Z", "X"):
                            break
                        if line.startswith("Uid:"):
                            found[int(name)] = int(line.split()[1])
                            break
            except (OSError, ValueError, IndexError):
                continue
    return found


def _kill_user_tasks(uid: int, rounds: int = 50) -> bool:
    """SIGKILL every process of the run's own uid until none is left (a fork bomb forks between rounds, but at
    most `processes` of them exist at once). For runs without a pid namespace."""
    for _ in range(rounds):
        pids = [pid for pid, task_uid in _task_uids().items() if task_uid == uid]
        if not pids:
            return True
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.005)
    return False


def _remove_tree(path: str) -> None:
    """Remove a working directory whatever the program did to its modes. Root ignores modes; another user first
    makes every directory its own again (never following links, which the program may have planted)."""
    if os.geteuid() != 0:
        try:
            os.chmod(path, 0o700)
        except OSError:
            pass
        for root, dirs, _ in os.walk(path):
            for d in dirs:
                p = os.path.join(root, d)
                if not os.path.islink(p):
                    try:
                        os.chmod(p, 0o700)
                    except OSError:
                        pass
    shutil.rmtree(path, ignore_errors=True)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _classify(sup: _Supervisor, rc: int | None, rusage: resource.struct_rusage | None, limits: SandboxLimits,
              wall: float) -> RunResult:
    stdout = bytes(sup.out["stdout"]).decode("utf-8", errors="replace")
    stderr = bytes(sup.out["stderr"]).decode("utf-8", errors="replace")
    cpu = rusage.ru_utime + rusage.ru_stime if rusage is not None else 0.0
    started = bytes(sup.out["status"]).startswith(b"ok")

    def result(status: str, reason: str = "") -> RunResult:
        return RunResult(status, rc, stdout, stderr, wall, reason, cpu)

    if not started:  # the program never ran: whatever happened is the sandbox's doing, not the program's
        message = bytes(sup.out["status"]).decode("utf-8", "replace") or stderr.strip()[-500:]
        if sup.killed_for == "timeout":
            message = f"the sandbox did not start within {limits.wall_s:g} s" + (f" ({message})" if message else "")
        return result("sandbox_error", message or f"the sandbox exited with {rc} before starting the program")
    if sup.killed_for:
        return result(sup.killed_for, sup.kill_reason)
    if rc is None:
        return result("sandbox_error", "the run's exit status was lost (reaped by someone else)")
    cpu_limit = max(1, math.ceil(limits.cpu_s))
    if rc == 0:
        return result("ok")
    if rc == EXIT_MEMORY:
        return result("memory", f"MemoryError: over the {limits.memory_mb} MiB address-space limit")
    # SIGKILL is RLIMIT_CPU's hard limit (a second past the soft one) when the CPU time is there; rusage runs a
    # little behind the limit's own accounting, hence the margin
    if rc == EXIT_CPU or rc == -signal.SIGXCPU or (rc == -signal.SIGKILL and cpu >= 0.8 * cpu_limit):
        return result("timeout", f"CPU time over {cpu_limit} s")
    if rc < 0:
        return result("killed", f"killed by {_signal_name(-rc)}")
    last_line = stderr.rstrip().rpartition("\n")[2]
    if last_line.startswith("MemoryError"):  # e.g. in a child process, or re-raised as an exit code
        return result("memory", f"MemoryError: over the {limits.memory_mb} MiB address-space limit")
    return result("error", f"exit code {rc}")
