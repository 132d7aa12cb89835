"""``artweb``: the command line for CI pipelines, over the REST API (``/api/v1/``).

    artweb login                                   # check and save ARTWEB_BASE_URL / ARTWEB_API_KEY
    artweb runs create -f run.json --wait          # start a run, follow it, exit with its outcome
    artweb runs watch 42                           # a progress bar with reward and loss per step
    artweb evaluations create -f eval.json --wait --fail-below 0.6
    artweb checkpoints download 17 -o adapter.tar.gz

Credentials: ``ARTWEB_BASE_URL`` and ``ARTWEB_API_KEY`` from the environment (what a CI job sets),
else what ``artweb login`` saved in ``$ARTWEB_CONFIG`` (default ``~/.config/artweb/credentials.json``,
mode 0600). Exit codes, so a pipeline can branch on them: 0 done and passed; 1 the run or
evaluation failed, was cancelled, or missed ``--fail-below``; 2 bad usage or input the API refused
(its message is printed); 3 cannot reach or authenticate to artweb.

Plain standard library HTTP (urllib) and tqdm: nothing here sets up Django or imports torch, so
the command starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

EXIT_OK, EXIT_OUTCOME, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
TERMINAL = {"succeeded", "failed", "cancelled"}
DEFAULT_BASE_URL = "http://127.0.0.1:8000"


class CliError(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Credentials:
    base_url: str
    api_key: str


def config_path() -> Path:
    return Path(os.environ.get("ARTWEB_CONFIG") or Path.home() / ".config" / "artweb" / "credentials.json")


def load_credentials() -> Credentials:
    saved: dict[str, str] = {}
    path = config_path()
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
        except ValueError as exc:
            raise CliError(f"{path} is not valid JSON ({exc}); run `artweb login` again", EXIT_USAGE) from exc
    base_url = os.environ.get("ARTWEB_BASE_URL") or saved.get("base_url") or DEFAULT_BASE_URL
    api_key = os.environ.get("ARTWEB_API_KEY") or saved.get("api_key") or ""
    if not api_key:
        raise CliError("no API key: set ARTWEB_API_KEY or run `artweb login`", EXIT_UNREACHABLE)
    return Credentials(base_url.rstrip("/"), api_key)


class Client:
    """JSON over HTTP with the team's key; an API error becomes a CliError with its message."""

    def __init__(self, credentials: Credentials, *, timeout: float = 30.0) -> None:
        self.credentials = credentials
        self.timeout = timeout

    def request(self, method: str, path: str, body: Any = None, **query: Any) -> Any:
        response = self._open(method, path, body, query)
        with response:
            raw = response.read()
        return json.loads(raw) if raw else None

    def download(self, path: str, destination: Path) -> int:
        """Stream ``path`` into ``destination`` (written beside it, then renamed: never a partial file)."""
        partial = destination.with_name(destination.name + ".part")
        size = 0
        with self._open("GET", path, None, {}) as response, open(partial, "wb") as handle:
            while chunk := response.read(1 << 20):
                handle.write(chunk)
                size += len(chunk)
        partial.replace(destination)
        return size

    def _open(self, method: str, path: str, body: Any, query: dict[str, Any]) -> Any:
        url = f"{self.credentials.base_url}/api/v1/{path.lstrip('/')}"
        query = {key: value for key, value in query.items() if value is not None}
        if query:
            url += "?" + urllib.parse.urlencode(query)
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {self.credentials.api_key}", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)  # noqa: S310 (the user's own server)
        except urllib.error.HTTPError as exc:
            raise api_error(exc) from exc
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise CliError(f"cannot reach {self.credentials.base_url}: {reason}", EXIT_UNREACHABLE) from exc


def api_error(exc: urllib.error.HTTPError) -> CliError:
    """The API's OpenAI-shaped error (``{"error": {"message", "param", "code"}}``) as one line."""
    try:
        error = json.loads(exc.read()).get("error") or {}
    except (ValueError, AttributeError):
        error = {}
    message = error.get("message") or exc.reason
    if error.get("param"):
        message = f"{error['param']}: {message}"
    code = EXIT_UNREACHABLE if exc.code in (401, 403) else EXIT_USAGE
    return CliError(f"HTTP {exc.code}: {message}", code)


def read_json_file(path: str) -> Any:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror}", EXIT_USAGE) from exc
    try:
        return json.loads(text)
    except ValueError as exc:
        raise CliError(f"{path} is not valid JSON: {exc}", EXIT_USAGE) from exc


# --- commands -------------------------------------------------------------------------------------


def cmd_login(args: argparse.Namespace) -> int:
    base_url = (args.base_url or os.environ.get("ARTWEB_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
    api_key = args.api_key or os.environ.get("ARTWEB_API_KEY")
    if not api_key:
        if not sys.stdin.isatty():
            raise CliError("no API key: pass --api-key or set ARTWEB_API_KEY", EXIT_USAGE)
        import getpass

        api_key = getpass.getpass("API key (aw_…): ").strip()
    credentials = Credentials(base_url, api_key)
    projects = Client(credentials).request("GET", "projects/", limit=1)  # fails loudly on a bad key
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"base_url": base_url, "api_key": api_key}))
    path.chmod(stat.S_IRUSR | stat.S_IWUSR)
    shown = "some" if projects.get("has_more") else len(projects.get("data", []))
    print(f"Signed in to {base_url} (the key sees {shown} project(s)); saved to {path}")
    return EXIT_OK


def cmd_runs_create(args: argparse.Namespace) -> int:
    body = read_json_file(args.file)
    client = Client(load_credentials())
    run = client.request("POST", "runs/", body)
    print(f"Run {run['id']} {run['status']} ({run['total_steps']} steps)", flush=True)
    if args.json:
        print(json.dumps(run))
    return watch_run(client, run["id"], interval=args.interval) if args.wait else EXIT_OK


def cmd_runs_watch(args: argparse.Namespace) -> int:
    return watch_run(Client(load_credentials()), args.id, interval=args.interval)


def cmd_runs_get(args: argparse.Namespace) -> int:
    print(json.dumps(Client(load_credentials()).request("GET", f"runs/{args.id}/"), indent=2))
    return EXIT_OK


def watch_run(client: Client, run_id: int, *, interval: float) -> int:
    """Follow a run to its end: a bar over its steps with the latest reward and loss, its warnings
    and phase changes as timestamped lines. The exit code is the run's outcome."""
    from tqdm import tqdm

    run = client.request("GET", f"runs/{run_id}/")
    bar = tqdm(
        total=run["total_steps"], desc=f"run {run_id}", unit="step", file=sys.stderr, dynamic_ncols=True
    )
    last_event: int | None = None
    last_metric: int | None = None
    try:
        while True:
            events = client.request("GET", f"runs/{run_id}/events/", after=last_event, limit=1000)
            for event in events["data"]:
                if event["level"] != "info" or (event.get("data") or {}).get("phase"):
                    stamp = event["created_at"][11:19]
                    bar.write(f"{stamp} {event['level'].upper():5} {event['message']}")
            last_event = events["last_id"] or last_event
            metrics = client.request("GET", f"runs/{run_id}/metrics/", after=last_metric, limit=1000)
            for row in metrics["data"]:
                bar.set_postfix(step=row["step"], reward=_short(row["reward_mean"]), loss=_short(row["loss"]))
            last_metric = metrics["last_id"] or last_metric
            run = client.request("GET", f"runs/{run_id}/")
            bar.n = run["steps_done"]
            bar.refresh()
            if run["status"] in TERMINAL:
                break
            time.sleep(interval)
    finally:
        bar.close()
    line = f"Run {run_id} {run['status']} after {run['steps_done']}/{run['total_steps']} steps"
    print(line + (f": {run['error']}" if run.get("error") else ""), flush=True)
    return EXIT_OK if run["status"] == "succeeded" else EXIT_OUTCOME


def cmd_evaluations_create(args: argparse.Namespace) -> int:
    if args.fail_below is not None and not args.wait:
        raise CliError("--fail-below needs --wait", EXIT_USAGE)
    body = read_json_file(args.file)
    client = Client(load_credentials())
    evaluation = client.request("POST", "evaluations/", body)
    print(f"Evaluation {evaluation['id']} {evaluation['status']} of {evaluation['model']}", flush=True)
    if not args.wait:
        return EXIT_OK
    while evaluation["status"] not in TERMINAL:
        time.sleep(args.interval)
        evaluation = client.request("GET", f"evaluations/{evaluation['id']}/")
    if evaluation["status"] != "succeeded":
        print(
            f"Evaluation {evaluation['id']} {evaluation['status']}: {evaluation.get('error') or ''}".rstrip(
                ": "
            )
        )
        return EXIT_OUTCOME
    results = evaluation.get("results") or {}
    value = results.get(args.metric)
    print(
        f"Evaluation {evaluation['id']} succeeded: reward_mean {_short(results.get('reward_mean'))}, "
        f"pass_rate {_short(results.get('pass_rate'))} over {results.get('n')} samples"
    )
    if args.fail_below is None:
        return EXIT_OK
    if not isinstance(value, int | float):
        print(f"FAIL: the evaluation reports no {args.metric}")
        return EXIT_OUTCOME
    if value < args.fail_below:
        print(f"FAIL: {args.metric} {value:.4g} is below {args.fail_below:g}")
        return EXIT_OUTCOME
    print(f"PASS: {args.metric} {value:.4g} >= {args.fail_below:g}")
    return EXIT_OK


def cmd_checkpoints_download(args: argparse.Namespace) -> int:
    client = Client(load_credentials())
    destination = Path(args.output or f"checkpoint-{args.id}-adapter.tar.gz")
    size = client.download(f"checkpoints/{args.id}/adapter", destination)
    print(f"Saved checkpoint {args.id}'s adapter to {destination} ({size} bytes)")
    return EXIT_OK


def _short(value: Any) -> str:
    return "-" if not isinstance(value, int | float) else f"{value:.4g}"


# --- parser ---------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="artweb", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")

    login = commands.add_parser("login", help="check an API key and save it with the base URL")
    login.add_argument(
        "--base-url", help=f"artweb's address (default $ARTWEB_BASE_URL or {DEFAULT_BASE_URL})"
    )
    login.add_argument("--api-key", help="a team API key (default $ARTWEB_API_KEY, else asked)")
    login.set_defaults(handler=cmd_login)

    runs = commands.add_parser("runs", help="start and follow training runs").add_subparsers(
        dest="action", required=True, metavar="action"
    )
    create = runs.add_parser("create", help="POST a run (the body of POST /api/v1/runs/)")
    create.add_argument("-f", "--file", required=True, help="JSON file with the run ('-': stdin)")
    create.add_argument("--wait", action="store_true", help="follow the run; exit 0 only if it succeeds")
    create.add_argument("--json", action="store_true", help="also print the created run as JSON")
    create.add_argument("--interval", type=float, default=2.0, help="seconds between polls")
    create.set_defaults(handler=cmd_runs_create)
    watch = runs.add_parser("watch", help="follow a run to its end; exit 0 only if it succeeds")
    watch.add_argument("id", type=int)
    watch.add_argument("--interval", type=float, default=2.0, help="seconds between polls")
    watch.set_defaults(handler=cmd_runs_watch)
    get = runs.add_parser("get", help="print a run as JSON")
    get.add_argument("id", type=int)
    get.set_defaults(handler=cmd_runs_get)

    evaluations = commands.add_parser("evaluations", help="evaluate a checkpoint").add_subparsers(
        dest="action", required=True, metavar="action"
    )
    evaluate = evaluations.add_parser(
        "create", help="POST an evaluation (the body of POST /api/v1/evaluations/)"
    )
    evaluate.add_argument("-f", "--file", required=True, help="JSON file with the evaluation ('-': stdin)")
    evaluate.add_argument("--wait", action="store_true", help="wait for the result")
    evaluate.add_argument(
        "--fail-below", type=float, help="exit 1 when the metric is below this (needs --wait)"
    )
    evaluate.add_argument(
        "--metric", default="pass_rate", help="the result --fail-below checks (default pass_rate)"
    )
    evaluate.add_argument("--interval", type=float, default=2.0, help="seconds between polls")
    evaluate.set_defaults(handler=cmd_evaluations_create)

    checkpoints = commands.add_parser("checkpoints", help="trained checkpoints").add_subparsers(
        dest="action", required=True, metavar="action"
    )
    download = checkpoints.add_parser("download", help="download a checkpoint's adapter (PEFT archive)")
    download.add_argument("id", type=int)
    download.add_argument("-o", "--output", help="file to write (default checkpoint-ID-adapter.tar.gz)")
    download.set_defaults(handler=cmd_checkpoints_download)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except CliError as exc:
        print(f"artweb: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130


def run() -> NoReturn:  # the console script
    sys.exit(main())


if __name__ == "__main__":
    run()
