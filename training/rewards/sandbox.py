"""Runs the `python` grader's user code in a separate, locked-down interpreter; never in this process.

Invariant: user code only ever runs in a child that has already (1) entered fresh network, mount,
PID, IPC and UTS namespaces, (2) chrooted into an empty, size-capped tmpfs, (3) dropped to an
unprivileged uid and (4) set its resource limits. One child grades a whole batch over a JSON-lines
pipe; a child that dies or overruns is killed and the rest of the batch gets a fresh one. This
module is the parent's side (limits, start-up probe, the child's lifecycle); the child's program,
which enters the sandbox itself, is `sandbox_child.py`.

Threat model. The author of the code is a member of some team; the code must not reach anything
beyond its own samples. Protected:
- network: a fresh network namespace has only a loopback interface, and it is down ("Network is
  unreachable"), so no exfiltration and no access to the database, Redis or internal services;
- secrets: the child gets an empty environment (only HOME), `python -I -S` ignores PYTHON* variables
  and site-packages, and its files are an empty tmpfs: no /proc (so no /proc/1/environ), no
  settings files, no keys, nothing world-readable from the host, no other team's data;
- privileges: as root we drop to uid/gid 65534 (nobody) with no supplementary groups, so no
  capabilities (no mount, chroot escape, ptrace of others); run as non-root, a user namespace maps
  the caller to root inside and the kernel confines that "root" to the namespaces;
- other processes: a PID namespace, so `kill(-1, ...)` reaches only the child itself;
- resources: RLIMIT_CPU per sample (and a cap per child), a wall-clock timeout per sample (the
  parent kills the child), RLIMIT_AS (memory), RLIMIT_NPROC=0 (no fork, no threads: a fork bomb
  gets EAGAIN), RLIMIT_FSIZE (file size) plus a tmpfs of `disk_bytes` (total disk), RLIMIT_NOFILE,
  no core dumps, and a source-size cap (checked when the spec is validated);
- the result channel: the child's stdin/stdout pipes are moved to private descriptors and every
  other inherited descriptor is closed before user code runs; fd 1 and 2 then both lead to a
  stderr file the parent reads only as an error's tail (`print` goes to a bounded buffer shown
  with errors), so nothing written there can become a reward. The parent reads only the result
  pipe and trusts none of it: one reply per request, carrying that request's id (a reply for
  another request, or a second one, kills the child and fails the sample), every field
  type-checked, the reward finite (and within the grader's declared `range`, checked by
  `PythonGrader`). Code that writes on the result pipe itself can only say what `grade()` could
  have returned.

THE control is this OS boundary, not Python. The module allow-list (`ALLOWED_MODULES`: checked at
validation, preloaded before the chroot, the only stdlib an `import` statement finds afterwards)
is a convenience for authors, not a boundary, and we do not pretend otherwise: the child's own
modules (`os`, `posix`, `resource`, ...) stay reachable at run time through `__builtins__`,
`().__class__.__base__.__subclasses__()`, frames and function globals. Closing those in-process
would mean a restricted-Python interpreter, which CPython does not offer and whose history is a
list of escapes; what such code then meets is the empty root, uid nobody, no fork, no network and
the limits above.
Not protected: kernel vulnerabilities (there is no seccomp filter; the syscall surface is the
whole kernel's), CPU caches and other side channels, and whatever a sample itself contains (the
code sees its samples and items, by design).

Where `unshare` is missing or not permitted (a container without CAP_SYS_ADMIN and without user
namespaces) the grader fails closed with `python_grader_server_error`. `allow_unsandboxed=True`
is a development-only opt-out: the child then still gets the clean environment, its own directory,
the resource limits and (as root) the drop to nobody, but shares the host's network, PID space and
file system (it can read world-readable files; as a non-root caller, the caller's own files).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import IO, Any

from training.rewards.errors import GradingError
from training.safety.slots import SlotHolder, SlotPolicy

# The stdlib a grader may import: preloaded before the chroot, so these (and what they import)
# are all that `import` can find afterwards. Pure computation only: no os, io, socket, subprocess.
ALLOWED_MODULES = (
    "bisect",
    "cmath",
    "collections",
    "copy",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "enum",
    "fractions",
    "functools",
    "heapq",
    "itertools",
    "json",
    "math",
    "operator",
    "random",
    "re",
    "statistics",
    "string",
    "textwrap",
    "time",
    "typing",
    "unicodedata",
)
MAX_SOURCE_BYTES = 100_000
NAMESPACE_FLAGS = ("--net", "--pid", "--fork", "--kill-child", "--mount", "--ipc", "--uts")
UNPRIVILEGED_UID = 65534  # nobody
CPU_EXIT_CODE = 152  # 128 + SIGXCPU: the child's own handler exits with it when out of CPU time
ALARM_EXIT_CODE = 142  # 128 + SIGALRM: the child's wall-clock backstop (see BOOTSTRAP)
MAX_REPLY_BYTES = 1024 * 1024
STDERR_TAIL_CHARS = 800

RUNTIME_ERROR = "python_grader_runtime_error"
SERVER_ERROR = "python_grader_server_error"
CHILD_ERROR_CODES = (RUNTIME_ERROR, "memory_limit")  # what the child may report


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SandboxConfig:
    """Limits and switches for the python grader's sandbox, chosen by the operator, not the spec."""

    timeout_seconds: float = 5.0  # wall time per sample (and for running the source's top level)
    cpu_seconds: int = 5  # CPU time per sample (RLIMIT_CPU, re-armed before each sample)
    process_cpu_seconds: int = 120  # CPU time over one child's life; a fresh child after that
    memory_bytes: int = 512 * 1024 * 1024  # address space (RLIMIT_AS)
    file_size_bytes: int = 1024 * 1024  # largest file the code may write (RLIMIT_FSIZE)
    disk_bytes: int = 16 * 1024 * 1024  # size of the child's tmpfs
    open_files: int = 64  # RLIMIT_NOFILE
    start_timeout_seconds: float = 10.0  # interpreter start-up and module preloading
    python: str = sys.executable
    unshare: str = "unshare"  # a name on PATH or an absolute path
    allow_unsandboxed: bool = False  # development only: see the module docstring
    extra_modules: tuple[str, ...] = field(default=())  # preloaded besides ALLOWED_MODULES
    slots: SlotPolicy = field(default_factory=SlotPolicy)  # the host's sandbox caps (training.safety.slots)
    team: str = ""  # whose slot a child takes
    # Not the sandbox's: the regex grader's limit per match (the regex engine's own timeout, see
    # training/rewards/patterns.py), kept with the operator's other limits on an author's code.
    # Far beyond a sane pattern on a long answer (micro- to milliseconds); a catastrophic one costs
    # one second a sample. The operator's GRADER_REGEX_TIMEOUT_S.
    regex_timeout_seconds: float = 1.0


class SandboxUnavailable(RuntimeError):
    """Namespaces cannot be created here and the unsandboxed opt-out is off."""


def sandbox_mode(config: SandboxConfig) -> str:
    """ "namespaces" or "unsandboxed"; raises SandboxUnavailable (fail closed). Probed once per
    process and configuration (a few milliseconds)."""
    problem = _namespace_problem(config.unshare, config.python, os.geteuid() == 0)
    if problem is None:
        return "namespaces"
    if config.allow_unsandboxed:
        return "unsandboxed"
    raise SandboxUnavailable(
        f"python grader sandbox unavailable: {problem} (it needs `unshare` with network, mount and "
        "PID namespaces: run as root or enable unprivileged user namespaces)"
    )


@lru_cache(maxsize=8)
def _namespace_problem(unshare: str, python: str, as_root: bool) -> str | None:
    binary = shutil.which(unshare)
    if binary is None:
        return f"{unshare!r} not found"
    command = [binary, *_unshare_flags(as_root), "--", python, "-I", "-S", "-c", ""]
    try:
        probe = subprocess.run(command, env={}, capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unshare failed: {error}"
    if probe.returncode != 0:
        return f"unshare failed: {probe.stderr.decode('utf-8', 'replace').strip()[:300]}"
    return None


def _unshare_flags(as_root: bool) -> list[str]:
    return list(NAMESPACE_FLAGS) if as_root else ["--map-root-user", *NAMESPACE_FLAGS]


class PythonSandbox:
    """One sandboxed interpreter loaded with one grader source, grading many samples in turn.

        with PythonSandbox(source, config) as sandbox:
            rewards = [sandbox.grade(sample, item) for sample, item in pairs]

    `grade` returns the reward or raises GradingError (`timeout`, `memory_limit`,
    `python_grader_runtime_error`, `python_grader_server_error`). Not thread-safe."""

    def __init__(self, source: str, config: SandboxConfig | None = None) -> None:
        self.source = source
        self.config = config or SandboxConfig()
        self.starts = 0  # children started so far (for tests and benchmarks)
        self._process: subprocess.Popen[bytes] | None = None
        self._directory: str | None = None
        self._stderr: IO[bytes] | None = None
        self._buffer = b""
        self._cpu_used = 0.0
        self._load_failure: GradingError | None = None
        self._request_id = 0  # the last request's id, rising across children; a child's ready reply has id 0
        self._slot = SlotHolder()  # held while a child lives; SlotsBusy (not a GradingError) when none frees

    def __enter__(self) -> PythonSandbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def grade(self, sample: dict[str, Any], item: dict[str, Any]) -> float:
        self._request_id += 1
        request = json.dumps({"id": self._request_id, "sample": sample, "item": item}).encode() + b"\n"
        if (
            self._process is not None
            and self._cpu_used > self.config.process_cpu_seconds - self.config.cpu_seconds
        ):
            self._stop()  # not enough CPU left in this child's lifetime cap for a full sample
        for attempt in range(2):
            self._ensure_started()
            assert self._process is not None and self._process.stdin is not None
            try:
                self._process.stdin.write(request)
                self._process.stdin.flush()
                break
            except OSError:
                # The child died between samples (not this sample's doing): one fresh try.
                self._stop()
                if attempt == 1:
                    raise GradingError(
                        SERVER_ERROR, "the sandbox process died before the sample was sent"
                    ) from None
        reply = self._read_reply(self.config.timeout_seconds, "grade()", self._request_id)
        # The child runs user code, which can reach the protocol descriptor: trust no field's type.
        if _is_number(reply.get("cpu")):
            self._cpu_used = float(reply["cpu"])
        if "reward" in reply:
            if not _is_number(reply["reward"]):
                raise GradingError(RUNTIME_ERROR, "the sandbox sent a malformed reply")
            return float(reply["reward"])
        code = reply.get("error")
        if code not in CHILD_ERROR_CODES:
            code = RUNTIME_ERROR
        if code == "memory_limit":
            self._stop()  # the child exits after a MemoryError; reap it now
            raise GradingError(
                code, f"grade() reached the memory limit of {self.config.memory_bytes >> 20} MiB"
            )
        raise GradingError(code, str(reply.get("detail", ""))[:2000])

    def close(self) -> None:
        self._stop()

    # --- child lifecycle -----------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self._load_failure is not None:
            raise self._load_failure  # a source that fails to load fails every sample alike
        if self._process is not None:
            return
        try:
            mode = sandbox_mode(self.config)
        except SandboxUnavailable as error:
            raise GradingError(SERVER_ERROR, str(error)) from None
        as_root = os.geteuid() == 0
        isolate = mode == "namespaces"
        self._slot.acquire(self.config.slots, self.config.team)
        self._directory = tempfile.mkdtemp(prefix="artweb-grader-")
        if as_root and not isolate:
            os.chown(self._directory, UNPRIVILEGED_UID, UNPRIVILEGED_UID)  # its cwd once it drops to nobody
        # The child's stderr: a file, not a pipe, so nobody has to drain it while it runs.
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed in _stop
        command = [self.config.python, "-I", "-S", "-B", "-c", BOOTSTRAP]
        if isolate:
            unshare = shutil.which(self.config.unshare) or self.config.unshare
            command = [unshare, *_unshare_flags(as_root), "--", *command]
        child_config = {
            "isolate": isolate,
            "directory": self._directory,
            "uid": UNPRIVILEGED_UID if as_root else None,
            "cpu_exit_code": CPU_EXIT_CODE,
            "alarm_exit_code": ALARM_EXIT_CODE,
            "timeout_seconds": self.config.timeout_seconds,
            "tmpfs_owner": UNPRIVILEGED_UID if as_root else 0,
            "modules": [*ALLOWED_MODULES, *self.config.extra_modules],
            "limits": {
                "cpu_seconds": self.config.cpu_seconds,
                "process_cpu_seconds": self.config.process_cpu_seconds,
                "memory_bytes": self.config.memory_bytes,
                "file_size_bytes": self.config.file_size_bytes,
                "disk_bytes": self.config.disk_bytes,
                "open_files": self.config.open_files,
            },
            "source": self.source,
        }
        try:
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                env={"HOME": "/" if isolate else self._directory},
                cwd=self._directory,
                start_new_session=True,  # its own process group, killed as one
            )
        except OSError as error:
            self._stop()
            raise GradingError(SERVER_ERROR, f"could not start the sandbox: {error}") from None
        self.starts += 1
        self._buffer = b""
        self._cpu_used = 0.0
        assert self._process.stdin is not None
        try:
            self._process.stdin.write(json.dumps(child_config).encode() + b"\n")
            self._process.stdin.flush()
        except OSError:
            pass  # reported below as a child that died at start-up
        timeout = self.config.start_timeout_seconds + self.config.timeout_seconds
        try:
            reply = self._read_reply(timeout, "loading the source", 0)
        except GradingError as error:
            # Death or overrun while loading is the source's doing (or the host's), the same for
            # every sample of the batch: recorded once, not retried per sample.
            self._load_failure = error
            raise
        if "fatal" in reply:
            self._stop()
            self._load_failure = GradingError(
                SERVER_ERROR, f"sandbox set-up failed: {str(reply['fatal'])[:300]}"
            )
            raise self._load_failure
        if "load_error" in reply:
            self._stop()
            code = reply["load_error"] if reply["load_error"] in CHILD_ERROR_CODES else RUNTIME_ERROR
            self._load_failure = GradingError(code, str(reply.get("detail", ""))[:2000])
            raise self._load_failure

    def _read_reply(self, timeout: float, doing: str, request_id: int) -> dict[str, Any]:
        """The child's reply to request `request_id`; kills the child and raises GradingError on a
        timeout, a death, or a reply that is not exactly one line answering that request."""
        assert self._process is not None and self._process.stdout is not None
        descriptor = self._process.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._stop()
                raise GradingError("timeout", f"{doing} took longer than {timeout:g} s (wall clock)")
            ready, _, _ = select.select([descriptor], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(descriptor, 65536)
            if not chunk:
                raise self._death(doing)
            self._buffer += chunk
            if len(self._buffer) > MAX_REPLY_BYTES:
                self._stop()
                raise GradingError(RUNTIME_ERROR, "the sandbox sent a reply larger than 1 MiB")
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            reply = json.loads(line)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            self._stop()
            raise GradingError(RUNTIME_ERROR, "the sandbox sent a malformed reply")
        if reply.get("id") != request_id or self._buffer:
            self._stop()
            raise GradingError(
                RUNTIME_ERROR,
                f"the sandbox's result channel carried something other than the one reply to "
                f"{doing} (did the code write on it?); this sample is not graded",
            )
        return reply

    def _death(self, doing: str) -> GradingError:
        """The error for a child that closed its output: what killed it, in the user's terms."""
        assert self._process is not None
        try:
            status = self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            status = None
        tail = self._stderr_tail()
        self._stop()
        if status == CPU_EXIT_CODE:
            return GradingError("timeout", f"{doing} used more than {self.config.cpu_seconds} s of CPU time")
        if status == ALARM_EXIT_CODE:
            return GradingError("timeout", f"{doing} ran past its own wall-clock backstop")
        if status is not None and status < 0:
            name = signal.Signals(-status).name
            return GradingError(
                RUNTIME_ERROR, f"the sandbox process was killed by {name} during {doing}. {tail}".strip()
            )
        return GradingError(
            RUNTIME_ERROR, f"the sandbox process exited (status {status}) during {doing}. {tail}".strip()
        )

    def _stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0, os.SEEK_END)
        size = self._stderr.tell()
        self._stderr.seek(max(0, size - STDERR_TAIL_CHARS))
        return self._stderr.read().decode("utf-8", "replace").strip()

    def _stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)  # unshare --kill-child takes the child along
            process.wait()
            for stream in (process.stdin, process.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None
        self._buffer = b""
        self._slot.release()


# The child's program (`sandbox_child.py`), passed with -c: read once, never imported here.
BOOTSTRAP = (Path(__file__).parent / "sandbox_child.py").read_text(encoding="utf-8")
