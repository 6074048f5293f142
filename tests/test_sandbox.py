"""The code-reward sandbox (pipelinerl/sandbox/) against hostile programs: each case checks the status
and reason the run reports, and that the machine is intact afterwards (this process alive, no process of the
run's uid left, files outside untouched, the next ordinary run fine). Assertions that need an isolation feature
skip, naming it, where `isolation()` says the machine does not give it; `test_isolation_is_complete_here` fails
instead of skipping where the machine could give it, so the rest cannot skip silently on root + unshare."""

from __future__ import annotations

import ast
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from conftest import wait_until

from pipelinerl import sandbox
from pipelinerl.sandbox import RunResult, SandboxLimits, isolation, run_python

SANDBOX_FILE = Path(sandbox.__file__)
FAST = SandboxLimits(wall_s=10.0, cpu_s=5.0)  # generous: ordinary cases must not flake on a busy machine


def need(*features: str) -> None:
    missing = [f for f in features if not isolation()[f]]
    if missing:
        pytest.skip(f"this machine does not give {', '.join(missing)} (sandbox.isolation() = {isolation()})")


def tasks_of(uid: int) -> list[int]:
    return [pid for pid, task_uid in sandbox._task_uids().items() if task_uid == uid]


def assert_intact(uid: int | None = None) -> None:
    """No process of the run's uid is left, and the next ordinary run works."""
    if uid is not None:
        wait_until(lambda: not tasks_of(uid), f"every process of sandbox uid {uid} gone", timeout_s=10)
    after = run_python("print(input()[::-1])", "abc", FAST)
    assert (after.status, after.stdout) == ("ok", "cba\n"), after


def printed_uid(result: RunResult) -> int | None:
    """The uid a hostile program printed first, when it runs as a uid of its own (else None: nothing to hunt)."""
    uid = int(result.stdout.split()[0])
    return uid if isolation()["separate_user"] and uid != os.getuid() else None


def separate_user_modes() -> list:
    """The default mode, and where the machine has one, a separate user without the private tmpfs: there the
    test's own tmp_path is visible to the program and only permissions stand in its way."""
    modes = [pytest.param(None, id="default")]
    if os.geteuid() == 0 and shutil.which("unshare"):
        no_tmpfs = sandbox._Mode(shutil.which("unshare"), ("--net", "--pid", "--ipc"), separate_user=True)
        modes.append(pytest.param(no_tmpfs, id="no_private_tmp"))
    return modes


def run_in(mode, code: str, stdin: str = "", limits: SandboxLimits = FAST, files=None, argv=()) -> RunResult:
    if mode is not None and not isolation()["pid_namespace"]:
        pytest.skip("unshare does not work here")
    if mode is None:
        return run_python(code, stdin, limits, files, list(argv))
    return sandbox._execute(code, stdin, limits, files, list(argv), mode)


def test_isolation_is_complete_here() -> None:
    """Root with a working unshare (this machine, CI) must get every guarantee; elsewhere this says what is left."""
    unshare = shutil.which("unshare")
    flags = ["--net", "--pid", "--ipc", "--mount", "--fork"]
    works = unshare and subprocess.run([unshare, *flags, "true"]).returncode == 0
    if os.geteuid() != 0 or not works:
        pytest.skip(f"not root with a working unshare; this machine gives {isolation()}")
    assert isolation() == {"network_namespace": True, "pid_namespace": True, "separate_user": True,
                           "private_tmp": True}


# --- ordinary programs ---------------------------------------------------------------------------------------------

def test_stdin_to_stdout_and_unicode() -> None:
    result = run_python("import sys\ndata = sys.stdin.read()\nprint(data.upper(), 'ünï ✓ 你好')\n"
                        "sys.stdout.flush()\nsys.stdout.buffer.write(b'\\xff\\n')", "héllo\nwörld", FAST)
    assert result.ok and result.returncode == 0 and result.reason == ""
    assert result.stdout == "HÉLLO\nWÖRLD ünï ✓ 你好\n\ufffd\n"  # the invalid byte decodes as U+FFFD
    assert 0 < result.wall_s < FAST.wall_s


def test_error_exit_shows_the_programs_traceback() -> None:
    result = run_python("def f():\n    raise ValueError('boom')\nf()\n", "", FAST)
    assert (result.status, result.returncode, result.reason) == ("error", 1, "exit code 1")
    assert 'File "' in result.stderr and "main.py\", line 2, in f" in result.stderr
    assert "raise ValueError('boom')" in result.stderr and result.stderr.endswith("ValueError: boom\n")
    assert "<string>" not in result.stderr  # the harness's own frame is not shown
    syntax = run_python("print(", "", FAST)
    assert syntax.status == "error" and "SyntaxError" in syntax.stderr and "main.py" in syntax.stderr
    assert run_python("exit(3)", "", FAST).returncode == 3  # `exit` exists although `site` is not run


def test_files_argv_and_imports() -> None:
    """Given files (a module too) in the working directory, argv, and imports from the standard library and the
    venv, which the sandbox user reaches through directory fds where the interpreter lives under a 0700 dir."""
    code = ("import sys, helper, json, decimal, fractions, encodings.idna, email.mime.text, numpy\n"
            "print(helper.double(21), sys.argv[1:], open('data/in.txt').read(), json.dumps(numpy.arange(3).tolist()))")
    result = run_python(code, "", FAST, files={"helper.py": "def double(x):\n    return 2 * x\n",
                                               "data/in.txt": "payload"}, argv=["a", "b c"])
    assert result.ok, result
    assert result.stdout == "42 ['a', 'b c'] payload [0, 1, 2]\n"


@pytest.mark.parametrize("name", ["/etc/passwd", "../x", "a/../../x", "", "main.py"])
def test_bad_file_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="files"):
        run_python("pass", "", FAST, files={name: "x"})


def test_big_stdin_while_the_program_writes_first() -> None:
    """The program fills its stdout pipe before reading any input while the caller is still writing 4 MB of it:
    one selector loop serves both, so neither side waits for the other."""
    code = "import sys\nsys.stdout.write('y' * 300000)\nsys.stdout.flush()\nprint(len(sys.stdin.read()))"
    result = run_python(code, "x" * (4 << 20), FAST)
    assert result.ok, result.reason
    assert result.stdout == "y" * 300000 + f"{4 << 20}\n"


def test_sandbox_errors_are_the_sandboxs_own() -> None:
    """"sandbox_error" means the program never ran; a program cannot fake it with the harness's exit codes."""
    for code in (sandbox.EXIT_SETUP, sandbox.EXIT_ORPHANED):
        faked = run_python(f"import os\nos._exit({code})", "", FAST)
        assert (faked.status, faked.returncode) == ("error", code)
    clash = run_python("print('never')", "", FAST, files={"a": "file", "a/b": "in a directory that is a file"})
    assert clash.status == "sandbox_error" and clash.stdout == "" and "Error" in clash.reason, clash
    missing = sandbox._execute("pass", "", FAST, None, [], sandbox._Mode("/nonexistent/unshare", ("--net",)))
    assert missing.status == "sandbox_error" and "could not start" in missing.reason
    with pytest.raises(ValueError, match="mount namespace"):
        sandbox._Mode(None, separate_user=True, private_tmp=True)


def test_exit_zero_before_anything_is_reported_as_is() -> None:
    """An early sys.exit(0) is a successful run with no output; catching that fake is the code-reward layer's job."""
    result = run_python("import sys\nsys.exit(0)\nprint('never')", "1 2\n", FAST)
    assert (result.status, result.returncode, result.stdout, result.stderr) == ("ok", 0, "", "")


def test_program_editing_a_given_file_leaves_the_callers_copy() -> None:
    files = {"data.txt": "original"}
    code = "print(open('data.txt').read())\nopen('data.txt', 'w').write('edited')\nprint(open('data.txt').read())"
    first = run_python(code, "", FAST, files=files)
    assert first.ok and first.stdout == "original\nedited\n"
    assert files == {"data.txt": "original"}
    assert run_python(code, "", FAST, files=files).stdout == "original\nedited\n"  # a fresh directory each run


# --- runaway programs ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("code", ["while True:\n    pass", "import time\ntime.sleep(60)"], ids=["busy", "sleeping"])
def test_wall_timeout(code: str) -> None:
    limits = SandboxLimits(wall_s=1.0, cpu_s=30.0)
    t0 = time.monotonic()
    result = run_python("print('started', flush=True)\n" + code, "", limits)
    elapsed = time.monotonic() - t0
    assert (result.status, result.returncode) == ("timeout", -signal.SIGKILL)
    assert result.reason == "wall time over 1 s" and result.stdout == "started\n"
    assert 1.0 <= elapsed < 4.0 and result.wall_s < 4.0
    assert_intact()


def test_cpu_limit() -> None:
    t0 = time.monotonic()
    busy = "print('started', flush=True)\nwhile True:\n    pass"
    result = run_python(busy, "", SandboxLimits(cpu_s=1.0, wall_s=20.0))
    assert (result.status, result.reason) == ("timeout", "CPU time over 1 s")
    assert result.returncode == sandbox.EXIT_CPU and result.stdout == "started\n"
    assert time.monotonic() - t0 < 10.0  # the CPU limit, not the 20 s wall clock, ended it


def test_process_limit_bounds_forking() -> None:
    """RLIMIT_NPROC of the run's uid: fork fails with EAGAIN after a handful, and the sleeping children do not
    outlive the run."""
    code = ("import os, time\nprint(os.getuid(), flush=True)\nn = 0\ntry:\n    while True:\n"
            "        if os.fork() == 0:\n            time.sleep(60)\n            os._exit(0)\n        n += 1\n"
            "except OSError as e:\n    print(n, type(e).__name__)")
    result = run_python(code, "", SandboxLimits(processes=8, wall_s=10.0))
    assert result.ok, result
    forked, error = result.stdout.split()[1:]
    assert error == "BlockingIOError" and 0 < int(forked) < 8
    assert_intact(printed_uid(result))


def test_fork_bomb_is_contained_and_cleaned_up() -> None:
    """Every child forks again and moves to a session of its own (out of reach of a process-group kill)."""
    need("pid_namespace")
    code = ("import os\nprint(os.getuid(), flush=True)\nwhile True:\n    try:\n        if os.fork() == 0:\n"
            "            os.setsid()\n    except OSError:\n        pass\n")
    t0 = time.monotonic()
    result = run_python(code, "", SandboxLimits(wall_s=2.0, cpu_s=30.0))
    assert (result.status, result.reason) == ("timeout", "wall time over 2 s")
    assert time.monotonic() - t0 < 6.0
    assert os.getloadavg() is not None  # this process is alive and well
    assert_intact(printed_uid(result))


def test_an_init_that_disables_its_lifeline_does_not_outlive_the_run() -> None:
    """The program is init of its pid namespace; the privilege drop clears the parent-death signal unshare set, and a
    program can replace the os._exit its lifeline calls. The run still leaves nothing behind."""
    need("pid_namespace", "separate_user")
    code = ("import os, time\nprint(os.getuid(), flush=True)\nos._exit = lambda code: None\nos.setsid()\n"
            "time.sleep(300)\n")
    result = run_python(code, "", SandboxLimits(wall_s=1.0))
    assert result.status == "timeout"
    assert_intact(printed_uid(result))


def test_no_user_namespace_to_mount_memory_in() -> None:
    """Inside a user namespace of its own a program could mount a tmpfs that no rlimit counts; the seccomp filter
    refuses CLONE_NEWUSER (and clone3, whose flags it cannot read), while threads and fork keep working."""
    need("separate_user")
    if not sandbox.SECCOMP_FILTER:
        pytest.skip("no seccomp filter for this architecture")
    code = ("import ctypes, os, threading\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print(libc.unshare(0x10000000), ctypes.get_errno())\n"
            "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
            "pid = os.fork()\nif pid == 0:\n    os._exit(7)\nprint(os.waitpid(pid, 0)[1] >> 8)\n")
    result = run_python(code, "", FAST)
    assert (result.status, result.stdout) == ("ok", "-1 1\nthread\n7\n"), result


@pytest.mark.parametrize("code", ["x = bytearray(1 << 40)",
                                  "chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 24))"],
                         ids=["one_huge_allocation", "growing"])
def test_memory_bomb(code: str) -> None:
    result = run_python(code, "", SandboxLimits(memory_mb=256, wall_s=10.0))
    assert result.status == "memory", result
    assert result.returncode == sandbox.EXIT_MEMORY and "256 MiB" in result.reason
    assert "MemoryError" in result.stderr
    assert_intact()


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_gigabytes_of_output(stream: str) -> None:
    """A program that would write without end is stopped at the cap; the caller never holds more than that."""
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    t0 = time.monotonic()
    result = run_python(f"import sys\nwhile True:\n    sys.{stream}.write('x' * 65536)", "", SandboxLimits(wall_s=30))
    assert (result.status, result.reason) == ("output_limit", f"{stream} over {1 << 20} bytes")
    assert getattr(result, stream) == "x" * (1 << 20)
    assert time.monotonic() - t0 < 10.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before < 64 * 1024
    assert_intact()


# --- reaching outside ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", separate_user_modes())
def test_writing_outside_is_refused(mode, tmp_path: Path) -> None:
    need("separate_user")
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o755)
    at_root = Path(f"/pipelinerl-sandbox-test-{uuid.uuid4().hex}")
    code = ("import sys\nfor path in sys.argv[1:]:\n    try:\n        open(path, 'w').write('pwned')\n"
            "        print('wrote', path)\n    except OSError as e:\n        print('refused', type(e).__name__)\n"
            "open('mine.txt', 'w').write('fine')\nprint(open('mine.txt').read())")
    try:
        result = run_in(mode, code, argv=[str(outside / "pwned"), str(at_root), "/etc/pwned"])
    finally:
        at_root.unlink(missing_ok=True)
    assert result.ok, result
    lines = result.stdout.splitlines()
    assert all(line.startswith("refused") for line in lines[:3]) and lines[3] == "fine", lines
    assert lines[1] == lines[2] == "refused PermissionError"
    assert not (outside / "pwned").exists() and not Path("/etc/pwned").exists()
    assert_intact()


@pytest.mark.parametrize("mode", separate_user_modes())
def test_deleting_files_outside_fails(mode, tmp_path: Path) -> None:
    need("separate_user")
    keep = tmp_path / "keep" / "precious.txt"
    keep.parent.mkdir()
    keep.write_text("precious")
    code = ("import os, shutil, sys\ntarget = sys.argv[1]\n"
            "for attempt in (lambda: os.remove(target), lambda: shutil.rmtree(os.path.dirname(target)),\n"
            "                lambda: os.rename(target, 'stolen.txt'), lambda: os.chmod(target, 0o777)):\n"
            "    try:\n        attempt()\n        print('done')\n    except OSError as e:\n"
            "        print(type(e).__name__)")
    result = run_in(mode, code, argv=[str(keep)])
    assert result.ok, result
    assert "done" not in result.stdout.split(), result.stdout
    assert keep.read_text() == "precious" and oct(keep.stat().st_mode & 0o777) == "0o644"
    assert_intact()


@pytest.mark.parametrize("network", [False, True])
def test_socket_to_a_local_server(network: bool) -> None:
    """A real server listens on 127.0.0.1; without network the program cannot reach it, with it it can (which
    shows the first case fails for the right reason)."""
    if not network:
        need("network_namespace")
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    port = server.getsockname()[1]
    code = ("import socket, sys\ntry:\n    socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=3)\n"
            "    print('connected')\nexcept OSError as e:\n    print('failed', type(e).__name__, e)")
    try:
        result = run_python(code, "", SandboxLimits(network=network, wall_s=10.0), argv=[str(port)])
        assert result.ok, result
        if network:
            assert result.stdout == "connected\n"
            server.accept()[0].close()
        else:
            assert result.stdout.startswith("failed"), result.stdout
            with pytest.raises(BlockingIOError):  # nobody ever knocked
                server.accept()
    finally:
        server.close()


def test_secrets_do_not_reach_the_program(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    secret = f"sk-{uuid.uuid4().hex}"
    monkeypatch.setenv("PIPELINERL_API_KEY", secret)
    key_file = tmp_path / "api_key"
    key_file.write_text(secret)
    key_file.chmod(0o600)
    code = ("import os, sys\nprint(dict(os.environ))\nfor path in sys.argv[1:]:\n    try:\n"
            "        print(open(path).read())\n    except OSError as e:\n        print('no', path, type(e).__name__)")
    environ_files = [f"/proc/{os.getpid()}/environ", f"/proc/{os.getppid()}/environ", "/proc/1/environ"]
    result = run_python(code, "", FAST, argv=[str(key_file), *environ_files])
    assert result.ok, result
    lines = result.stdout.splitlines()
    env = ast.literal_eval(lines[0])  # the dict the program printed: the rebuilt environment only
    assert "PIPELINERL_API_KEY" not in env
    assert set(env) <= {"PATH", "LANG", "HOME", "TMPDIR", "PYTHONDONTWRITEBYTECODE", "OMP_NUM_THREADS",
                        "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}
    if isolation()["separate_user"]:  # as the caller's own user, reading its own files cannot be stopped
        assert secret not in result.stdout + result.stderr
        assert len(lines) == 5 and all(line.startswith("no /") for line in lines[1:]), lines


def test_system_v_shared_memory_does_not_outlive_the_run() -> None:
    """A SysV segment outlives its creator and no rlimit covers it: the run's IPC namespace takes it along."""
    if "--ipc" not in sandbox._detect_mode().namespaces or not Path("/proc/sysvipc/shm").exists():
        pytest.skip("no IPC namespace here")
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print(os.getuid(), libc.shmget(0, 1 << 20, 0o1000 | 0o600))")  # IPC_PRIVATE, IPC_CREAT
    result = run_python(code, "", FAST)
    uid, shmid = map(int, result.stdout.split())
    assert result.ok and shmid >= 0, result
    header, *rows = Path("/proc/sysvipc/shm").read_text().splitlines()
    uid_column = header.split().index("uid")
    assert not [row for row in rows if int(row.split()[uid_column]) == uid]


def test_root_only_files_are_unreadable() -> None:
    need("separate_user")
    if not Path("/etc/shadow").exists():
        pytest.skip("no /etc/shadow on this machine")
    result = run_python("try:\n    open('/etc/shadow').read()\n    print('read it')\nexcept OSError as e:\n"
                        "    print(type(e).__name__)", "", FAST)
    assert result.stdout == "PermissionError\n"


def test_killing_the_parent_fails() -> None:
    """The program is told this process's pid and tries to kill it (and, where that is safe to try, everything
    it may signal); it gets an error and this process lives on."""
    if not (isolation()["separate_user"] or isolation()["pid_namespace"]):  # then these would succeed
        pytest.skip("without a separate user or a pid namespace the program may kill its caller")
    killers = ["os.kill(int(sys.argv[1]), signal.SIGKILL)", "os.killpg(int(sys.argv[2]), signal.SIGKILL)",
               "os.kill(-1, signal.SIGKILL)"]
    code = ("import os, signal, sys\n"
            + "".join(f"try:\n    {k}\n    print('sent')\nexcept OSError as e:\n    print(type(e).__name__)\n"
                      for k in killers))
    result = run_python(code, "", FAST, argv=[str(os.getpid()), str(os.getpgid(0))])
    assert result.ok, result
    outcomes = result.stdout.split()
    assert len(outcomes) == 3 and all(o in ("PermissionError", "ProcessLookupError") for o in outcomes[:2]), outcomes
    assert outcomes[2] in ("ProcessLookupError", "sent")  # kill(-1) reaches only the program's own: none
    assert_intact()


# --- the caller and the fallbacks ----------------------------------------------------------------------------------

def _descendants(root: int) -> dict[int, str]:
    """{pid: start time} of every process below `root` (start time: a reused pid is not the same process)."""
    children: dict[int, list[int]] = {}
    started = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                fields = Path(f"/proc/{name}/stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(name))
            started[int(name)] = fields[19]
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = started[child]
            todo.append(child)
    return found


def _still_running(processes: dict[int, str]) -> list[int]:
    alive = []
    for pid, start in processes.items():
        try:
            if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19] == start:
                alive.append(pid)
        except OSError:
            pass
    return alive


def test_a_run_ends_when_its_caller_dies() -> None:
    """The reward pool kills a worker that overruns its timeout: the sandbox it was waiting on must not live on
    (here a program that sleeps, with a forked child that sleeps too)."""
    script = ("import importlib.util, sys\n"
              f"spec = importlib.util.spec_from_file_location('sb', {str(SANDBOX_FILE)!r})\n"
              "sb = importlib.util.module_from_spec(spec)\nsys.modules['sb'] = sb\nspec.loader.exec_module(sb)\n"
              "sb.run_python('import os, time\\nos.fork()\\ntime.sleep(120)', '', sb.SandboxLimits(wall_s=120))\n")
    caller = subprocess.Popen([sys.executable, "-c", script])
    try:
        # caller -> [unshare ->] harness = program -> its child: the program has forked once it is 2-3 deep
        depth = 3 if isolation()["pid_namespace"] else 2
        wait_until(lambda: len(_descendants(caller.pid)) >= depth, "the sandboxed program running", timeout_s=30)
        time.sleep(0.2)
        below = _descendants(caller.pid)
    finally:
        caller.kill()
        caller.wait()
    wait_until(lambda: not _still_running(below), f"the orphaned run {sorted(below)} gone", timeout_s=10)


def fallback_modes() -> list:
    """What runs where unshare is missing or refused: a separate user only (root), nothing at all."""
    modes = [pytest.param(sandbox._Mode(None), id="no_isolation")]
    if os.geteuid() == 0:
        modes.insert(0, pytest.param(sandbox._Mode(None, separate_user=True), id="separate_user_only"))
    return modes


@pytest.mark.parametrize("mode", fallback_modes())
def test_fallback_modes_still_run_limit_and_clean_up(mode) -> None:
    if mode.separate_user and not isolation()["separate_user"]:
        pytest.skip("root cannot switch to a fresh uid here")
    normal = sandbox._execute("import os\nprint(input(), os.getcwd())", "hi", FAST, None, [], mode)
    assert normal.ok, normal
    said, workdir = normal.stdout.split()
    assert said == "hi" and Path(workdir).name.startswith("pipelinerl-sandbox-") and not Path(workdir).exists()
    # a working directory made hard to remove: read-only files in a directory tree with its modes taken away
    messy = sandbox._execute("import os\nos.makedirs('a/b')\nopen('a/b/f', 'w').write('x')\nos.chmod('a/b/f', 0)\n"
                             "os.chmod('a/b', 0)\nos.chmod('a', 0o500)\nprint(os.getcwd())", "", FAST, None, [], mode)
    assert messy.ok and not Path(messy.stdout.strip()).exists(), messy
    timeout = sandbox._execute("while True:\n    pass", "", SandboxLimits(wall_s=1.0), None, [], mode)
    assert timeout.status == "timeout" and timeout.wall_s < 3.0
    if mode.separate_user:  # a daemon that left the process group is still found by its uid
        code = ("import os, time\nprint(os.getuid(), flush=True)\n"
                "if os.fork() == 0:\n    os.setsid()\n    time.sleep(60)")
        daemon = sandbox._execute(code, "", FAST, None, [], mode)
        assert daemon.ok, daemon
        assert not tasks_of(int(daemon.stdout))  # already when the run returns


def test_non_root_caller() -> None:
    """The same module run by an unprivileged user (nobody, through the system python, which it can execute):
    no separate user, but the runs work, are limited and clean up."""
    system_python, setpriv = Path("/usr/bin/python3"), shutil.which("setpriv")
    if os.geteuid() != 0 or not setpriv or not system_python.exists():
        pytest.skip("needs root (to become nobody), setpriv and /usr/bin/python3")
    forks = ("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(60)\n"
             "            os._exit(0)\n        n += 1\nexcept OSError:\n    print(n)")
    messy = ("import os\nos.makedirs('a/b')\nopen('a/b/f', 'w').write('x')\nos.chmod('a/b/f', 0)\nos.chmod('a/b', 0)\n"
             "os.chmod('a', 0o500)\nos.chmod('.', 0o500)\nprint(os.getcwd())")
    # a copy nobody can read: the checkout may sit under a directory only root can enter (mktemp -d makes 0700)
    readable = Path(tempfile.mkdtemp(prefix="pipelinerl-sandbox-test-"))
    readable.chmod(0o755)
    for source, name in ((SANDBOX_FILE, "sandbox.py"), (Path(sandbox.HARNESS_FILE), "harness.py")):  # side by side
        shutil.copy(source, readable / name)
        (readable / name).chmod(0o644)
    script = (
        "import importlib.util, json, sys\n"
        f"spec = importlib.util.spec_from_file_location('sb', {str(readable / 'sandbox.py')!r})\n"
        "sb = importlib.util.module_from_spec(spec)\nsys.modules['sb'] = sb\nspec.loader.exec_module(sb)\n"
        "out = {'isolation': sb.isolation()}\n"
        "r = sb.run_python('import os\\nprint(input(), os.getuid())', 'hi', sb.SandboxLimits(wall_s=10))\n"
        "out['echo'] = [r.status, r.stdout]\n"
        "r = sb.run_python('while True:\\n    pass', '', sb.SandboxLimits(wall_s=1))\n"
        "out['timeout'] = [r.status, r.wall_s]\n"
        f"r = sb.run_python({forks!r}, '', sb.SandboxLimits(processes=8, wall_s=10))\n"
        "out['forks'] = [r.status, r.stdout]\n"
        f"r = sb.run_python({messy!r}, '', sb.SandboxLimits(wall_s=10))\n"
        "out['messy'] = [r.status, r.stdout.strip()]\n"
        "print(json.dumps(out))\n")
    proc = subprocess.run([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", str(system_python), "-c",
                           script], capture_output=True, text=True, timeout=60, cwd="/")
    shutil.rmtree(readable)
    if proc.returncode != 0 and ("SyntaxError" in proc.stderr or "No module named" in proc.stderr):
        pytest.skip(f"the system python cannot load the module: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["isolation"]["separate_user"] is False and out["isolation"]["private_tmp"] is False
    assert out["echo"] == ["ok", "hi 65534\n"]
    assert out["timeout"][0] == "timeout" and out["timeout"][1] < 3.0
    assert out["forks"][0] == "ok" and 0 < int(out["forks"][1]) <= 8, out
    assert out["messy"][0] == "ok" and not Path(out["messy"][1]).exists(), out  # removed despite its modes
    # the forked children slept for 60 s: none of nobody's sandbox processes is left
    wait_until(lambda: not [pid for pid in tasks_of(65534) if "utf8" in _cmdline(pid)], "nobody's runs gone")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
