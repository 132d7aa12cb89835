"""The launcher of an MCP stdio server: `training/environments/mcp.py` passes this file's text to
`python -I -S -B -c` inside `unshare` (fresh network, mount, PID, IPC and UTS namespaces); the
parent never imports it.

It runs as root (or namespace root) only until the server starts. Before that it builds a new root
from read-only bind mounts of what the server needs and nothing else (the interpreter, its
packages, `training/`, /usr and a few /etc files; a fresh /proc, /dev/null and friends, a small
private /tmp), chroots into it, drops to uid nobody, keeps only the environment variables the
parent named and sets its resource limits. Then it runs the shipped demo server's module in this
interpreter, or execs the operator's program. Its one argument is the parent's JSON config, built
by code only (paths, limits, the module or the operator's command); no value of a team's request is
in it. The MCP protocol travels on stdin/stdout, which it leaves alone. Only the standard library.
"""

import ctypes
import json
import os
import resource
import runpy
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18

libc = ctypes.CDLL(None, use_errno=True)


def fail(message):
    sys.stderr.write("artweb mcp sandbox: " + message + "\n")
    sys.stderr.flush()
    os._exit(70)


def mount(source, target, fstype, flags, data=None):
    encode = lambda text: None if text is None else text.encode()  # noqa: E731
    if libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)) != 0:
        fail(f"mount {source} on {target}: {os.strerror(ctypes.get_errno())}")


def make_target(path, is_directory):
    if is_directory:
        os.makedirs(path, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        if not os.path.exists(path):
            open(path, "w").close()  # noqa: SIM115


def bind(path, root, *, writable=False):
    target = root + path
    make_target(target, os.path.isdir(path))
    mount(path, target, None, MS_BIND | MS_REC)
    flags = MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | (0 if writable else MS_RDONLY)
    mount(None, target, None, flags)


def build_root(config):
    root = config["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=0755")
    for link, destination in config["links"]:
        make_target(os.path.dirname(root + link), True)
        os.symlink(destination, root + link)
    os.makedirs(root + "/proc", mode=0o555, exist_ok=True)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(root + "/tmp", exist_ok=True)
    size = config["limits"]["disk_bytes"]
    mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=1777")
    # After /tmp: a file an operator's command names may live there (read-only on the fresh tmpfs).
    for path in config["read_only"]:
        bind(path, root)
    for device in ("null", "zero", "random", "urandom"):
        bind("/dev/" + device, root, writable=True)
    os.chroot(root)
    os.chdir("/tmp")


def main():
    config = json.loads(sys.argv[1])
    if config["isolate"]:
        build_root(config)
    else:
        os.chdir(config["directory"])
    if config["uid"] is not None:
        os.setgroups([])
        os.setgid(config["uid"])
        os.setuid(config["uid"])
    limits = config["limits"]
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_size_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_seconds"],) * 2)
    if config["uid"] is not None:  # per uid: every sandbox of uid nobody together
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"],) * 2)
    keep = set(config["environment"])
    for name in list(os.environ):
        if name not in keep:
            del os.environ[name]
    if config["module"]:
        sys.path[:] = config["sys_path"]
        sys.argv[:] = [config["module"]]
        runpy.run_module(config["module"], run_name="__main__", alter_sys=True)
    else:
        os.execve(config["program"], config["argv"], dict(os.environ))


main()
