"""The sandbox child's program: `training/rewards/sandbox.py` passes this file's text to
`python -I -S -B -c` in the child; the parent never imports it.

It runs as root (or namespace root) until it drops privileges; nothing from the user runs before
the chroot, the uid drop, the closing of every other descriptor and the limits. Protocol: the first
line on stdin is the parent's JSON config (limits, source, ...); the reply to it (id 0) is
`{"ready"}`, `{"load_error"}` or `{"fatal"}`; then one `{"id", "sample", "item"}` request per line,
each answered with `{"id", "reward", "cpu"}` or `{"id", "error", "detail", "cpu"}`. Replies travel
only on the result channel (the stdout pipe, moved to a private descriptor); what the code writes on
fd 1 or 2 lands in the stderr file, which the parent reads only as an error's tail. Only the
standard library, and only what is loaded before the chroot.
"""

import ast  # noqa: F401  # unused here; kept so the modules loaded before the chroot stay as they were
import builtins
import json
import linecache
import math
import os
import resource
import signal
import sys
import traceback

MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8


class Tail:
    # print() lands here: bounded, and never on the protocol pipe.
    def __init__(self):
        self.text = ""

    def write(self, text):
        self.text = (self.text + str(text))[-2000:]
        return len(text)

    def flush(self):
        pass


def describe(error, tail):
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if frame.filename == "<grader>"]
    text = "".join(traceback.format_list(frames)) + "".join(
        traceback.format_exception_only(type(error), error)
    )
    if tail.text:
        text += "--- output ---\n" + tail.text[-500:]
    return text[-2000:]


def cpu_used():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def close_all_but(*keep):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = max(limit for limit in (soft, hard, 1 << 16) if limit != resource.RLIM_INFINITY)
    kept = sorted(set(keep))
    for low, high in zip(kept, [*kept[1:], ceiling], strict=True):
        os.closerange(low + 1, high)


def main():
    # Private descriptors for the protocol, open for the child's whole life.
    requests = open(os.dup(0), "rb")  # noqa: SIM115
    replies = open(os.dup(1), "wb", buffering=0)  # noqa: SIM115
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    os.close(devnull)

    def reply(message):
        replies.write(json.dumps(message).encode() + b"\n")

    # The result channel is the only descriptor the parent reads: close anything else inherited
    # (the launcher's or the host's), keeping stdin/stdout/stderr (now /dev/null and the stderr
    # file) and the two protocol pipes.
    close_all_but(0, 1, 2, requests.fileno(), replies.fileno())

    config = json.loads(requests.readline())
    # Codecs load lazily, which fails once chrooted: load the common ones now.
    preload = [
        "encodings." + name for name in ("ascii", "latin_1", "utf_16", "utf_32", "idna", "unicode_escape")
    ]
    for name in preload + config["modules"]:
        try:  # noqa: SIM105 - contextlib would be one more module loaded into the child
            __import__(name)
        except ImportError:
            pass
    limits = config["limits"]
    if config["isolate"]:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        owner = config["tmpfs_owner"]
        options = "size={},mode=0700,uid={},gid={}".format(limits["disk_bytes"], owner, owner)
        flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
        if libc.mount(b"tmpfs", config["directory"].encode(), b"tmpfs", flags, options.encode()) != 0:
            reply({"id": 0, "fatal": "mounting the tmpfs failed: " + os.strerror(ctypes.get_errno())})
            return 70
        os.chroot(config["directory"])
        os.chdir("/")
        del libc
        for name in [name for name in sys.modules if name.split(".")[0] in ("ctypes", "_ctypes")]:
            del sys.modules[name]
    else:
        os.chdir(config["directory"])
    if config["uid"] is not None:
        os.setgroups([])
        os.setgid(config["uid"])
        os.setuid(config["uid"])
    cpu, cpu_cap = limits["cpu_seconds"], limits["process_cpu_seconds"]
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_size_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_CPU, (min(cpu, cpu_cap), cpu_cap))
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    # An oversized write fails with EFBIG instead of killing; running out of CPU exits with a
    # status the parent recognises (as PID 1 of its namespace, the default action would be ignored).
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    cpu_exit_code = config["cpu_exit_code"]
    signal.signal(signal.SIGXCPU, lambda *_: os._exit(cpu_exit_code))
    # A backstop for a child whose parent died mid-sample (so nobody kills it at the timeout)
    # while its code sleeps rather than burns CPU.
    alarm_exit_code = config["alarm_exit_code"]
    signal.signal(signal.SIGALRM, lambda *_: os._exit(alarm_exit_code))
    backstop = 2 * config["timeout_seconds"] + 1

    tail = Tail()
    sys.stdout = sys.stderr = tail
    sys.stdin = None
    source = config.pop("source")
    linecache.cache["<grader>"] = (len(source), None, source.splitlines(True), "<grader>")
    namespace = {"__name__": "grader", "__builtins__": builtins}
    signal.setitimer(signal.ITIMER_REAL, backstop)
    try:
        exec(compile(source, "<grader>", "exec"), namespace)
        grade = namespace.get("grade")
        if not callable(grade):
            raise TypeError("the source defines no function grade(sample, item)")
    except MemoryError as error:
        reply(
            {
                "id": 0,
                "load_error": "memory_limit",
                "detail": "the source reached the memory limit: " + describe(error, tail),
            }
        )
        return 0
    except BaseException as error:
        reply({"id": 0, "load_error": "python_grader_runtime_error", "detail": describe(error, tail)})
        return 0
    signal.setitimer(signal.ITIMER_REAL, 0)
    reply({"id": 0, "ready": True, "cpu": cpu_used()})

    while True:
        line = requests.readline()
        if not line:
            return 0
        request = json.loads(line)
        number = request["id"]
        resource.setrlimit(resource.RLIMIT_CPU, (min(cpu_cap, math.ceil(cpu_used() + cpu)), cpu_cap))
        tail.text = ""
        signal.setitimer(signal.ITIMER_REAL, backstop)
        try:
            value = grade(request["sample"], request["item"])
            if isinstance(value, bool):
                value = float(value)
            if not isinstance(value, (int, float)):
                raise TypeError(f"grade() returned {type(value).__name__}, not a number")
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"grade() returned {value!r}")
            reply({"id": number, "reward": value, "cpu": cpu_used()})
        except MemoryError as error:
            del error
            reply(
                {"id": number, "error": "memory_limit", "detail": "memory limit reached", "cpu": cpu_used()}
            )
            return 0  # start afresh rather than trust a heap that ran out
        except BaseException as error:
            reply(
                {
                    "id": number,
                    "error": "python_grader_runtime_error",
                    "detail": describe(error, tail),
                    "cpu": cpu_used(),
                }
            )
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)


if __name__ == "__main__":
    sys.exit(main())
