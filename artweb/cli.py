"""``artweb``: the command line for CI pipelines, over the REST API (``/api/v1/``).

    artweb login --base-url URL < key.txt          # check and save the base URL and API key
    artweb runs create -f run.json --wait          # start a run, follow it, exit with its outcome
    artweb runs watch 42                           # a progress bar with reward and loss per step
    artweb evaluations create -f eval.json --wait --fail-below 0.6
    artweb checkpoints download 17 -o adapter.tar.gz

Credentials: ``ARTWEB_BASE_URL`` and ``ARTWEB_API_KEY`` from the environment (what a CI job sets),
else what ``artweb login`` saved in ``$ARTWEB_CONFIG`` (default ``~/.config/artweb/credentials.json``,
mode 0600). Exit codes, so a pipeline can branch on them: 0 done and passed; 1 the run or
evaluation failed, was cancelled, or missed ``--fail-below``; 2 bad usage or input the API refused
(its message is printed); 3 cannot reach or authenticate to artweb; 141 standard output was closed
before the command finished (``| head``), as for a Unix tool stopped by SIGPIPE; 130 interrupted.

Plain standard library HTTP (urllib) and tqdm: nothing here sets up Django or imports torch, so
the command starts in a fraction of a second.

Why one module of this length: the whole command line (parsing, one function per subcommand, the
progress bar) in one file a pipeline author can read end to end; it only calls the REST API.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import stat
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

EXIT_OK, EXIT_OUTCOME, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
# What a shell reports for a tool killed by SIGPIPE (128 + 13), the status ``yes | head`` leaves:
# not 0, since the command never said all it had to (``runs watch`` never printed the outcome).
EXIT_CLOSED_OUTPUT = 141
EXIT_INTERRUPTED = 130
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
    param = error.get("param")
    # The API's message usually names the field already ("config.group_size: must be ..."); a
    # domain error's may not ("no such task set", param "task_set"). The field once, either way.
    if param and param != "non_field_errors" and not message.startswith(f"{param}: "):
        message = f"{param}: {message}"
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
    api_key = args.api_key or os.environ.get("ARTWEB_API_KEY") or read_api_key()
    credentials = Credentials(base_url, api_key)
    projects = Client(credentials).request("GET", "projects/", limit=1)  # fails loudly on a bad key
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"base_url": base_url, "api_key": api_key}))
    path.chmod(stat.S_IRUSR | stat.S_IWUSR)
    shown = "some" if projects.get("has_more") else len(projects.get("data", []))
    print(f"Signed in to {base_url} (the key sees {shown} project(s)); saved to {path}")
    return EXIT_OK


def read_api_key() -> str:
    """The key from standard input: its first line when piped (``echo "$KEY" | artweb login``, so
    the key is in neither the command line nor the shell history), else asked without echo."""
    if sys.stdin is None or not sys.stdin.isatty():
        # One line, not up to end of file: a pipe whose writer stays open must not hang us.
        key = sys.stdin.readline().strip() if sys.stdin is not None else ""
        if not key:
            raise CliError(
                "no API key: pipe it on standard input, pass --api-key or set ARTWEB_API_KEY", EXIT_USAGE
            )
        return key
    import getpass

    return getpass.getpass("API key (aw_…): ").strip()


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
    """Follow a run to its end: a bar over its steps with the latest reward and loss, its warnings,
    phases and evaluations as timestamped lines, then every evaluation recorded for the run. The
    exit code is the run's outcome.

    What happened before the watch began is summarised, not replayed: fed to the bar at once, a
    finished run's 20 steps read as 100 steps a second. Speed and time left come only from steps
    seen finishing during the watch, timed by the server's clock (``StepRate``)."""
    from tqdm import tqdm

    run = client.request("GET", f"runs/{run_id}/")
    history, last_event = read_list(client, f"runs/{run_id}/events/", after=None)
    metrics, last_metric = read_list(client, f"runs/{run_id}/metrics/", after=None)
    latest = metrics[-1] if metrics else None
    steps_seen = len(metrics)  # one metrics row per finished step of this run
    rate = StepRate()
    bar = tqdm(
        total=run["total_steps"],
        initial=run["steps_done"],
        desc=f"run {run_id}",
        unit="step",
        bar_format=BAR_FORMAT,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    try:
        for line in history_lines(run, history):
            say(bar, line)
        while True:
            # The metrics are read after the run, so they may already hold a step the run's
            # steps_done does not count yet: the bar shows the later of the two.
            bar.n = min(run["total_steps"], max(run["steps_done"], steps_seen))
            bar.set_postfix_str(progress_text(run, latest, rate))  # refreshes the bar
            if run["status"] in TERMINAL:
                break
            time.sleep(interval)
            run = client.request("GET", f"runs/{run_id}/")
            # Read after the run, so a run seen ending is followed by its last events and steps.
            events, last_event = read_list(client, f"runs/{run_id}/events/", after=last_event)
            for event in events:
                if event_is_shown(event):
                    say(bar, event_line(event))
            metrics, last_metric = read_list(client, f"runs/{run_id}/metrics/", after=last_metric)
            for row in metrics:
                rate.add(row["created_at"])
                latest = row
            steps_seen += len(metrics)
    finally:
        bar.close()
    print_run_evaluations(client, run_id)
    line = f"Run {run_id} {run['status']} after {run['steps_done']}/{run['total_steps']} steps"
    print(line + (f": {run['error']}" if run.get("error") else ""), flush=True)
    return EXIT_OK if run["status"] == "succeeded" else EXIT_OUTCOME


# tqdm's own rate and time left are left out: it would time the bar's jumps, not the run's steps.
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"


class StepRate:
    """Steps a second over the steps seen finishing while watching, from each step's metrics row
    (``created_at``, the server's clock): the first only starts the clock, so a speed needs two."""

    def __init__(self) -> None:
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.intervals = 0

    def add(self, finished_at: str) -> None:
        at = datetime.fromisoformat(finished_at).timestamp()
        if self.first_at is None:
            self.first_at = at
        else:
            self.intervals += 1
        self.last_at = at

    def per_second(self) -> float | None:
        if self.first_at is None or self.last_at is None or self.last_at <= self.first_at:
            return None
        return self.intervals / (self.last_at - self.first_at)


def progress_text(run: dict[str, Any], latest: dict[str, Any] | None, rate: StepRate) -> str:
    """The bar's postfix: the latest step's reward and loss; speed and time left once known."""
    parts = []
    if latest is not None:
        parts += [
            f"step={latest['step']}",
            f"reward={_short(latest['reward_mean'])}",
            f"loss={_short(latest['loss'])}",
        ]
    speed = rate.per_second()
    if speed:
        from tqdm import tqdm

        parts.append(f"{speed:.2f} step/s" if speed >= 1 else f"{1 / speed:.1f} s/step")
        left = run["total_steps"] - run["steps_done"]
        if left > 0 and run["status"] not in TERMINAL:
            parts.append(f"{tqdm.format_interval(left / speed)} left")
    return ", ".join(parts)


def event_is_shown(event: dict[str, Any]) -> bool:
    """Warnings and errors, phase changes and evaluation results get a line; other info does not."""
    data = event.get("data") or {}
    return event["level"] != "info" or "phase" in data or "evaluation" in data


def event_line(event: dict[str, Any]) -> str:
    return f"{event['created_at'][11:19]} {event['level'].upper():5} {event['message']}"


def history_lines(run: dict[str, Any], events: list[dict[str, Any]]) -> list[str]:
    """The events from before the watch began, in brief: its warnings, errors and evaluations, and
    only the latest of its phases (what the run is doing now, or did last)."""

    def is_phase(event: dict[str, Any]) -> bool:
        return "phase" in (event.get("data") or {})

    last_phase = next((event for event in reversed(events) if is_phase(event)), None)
    kept = [
        event for event in events if event is last_phase or (event_is_shown(event) and not is_phase(event))
    ]
    lines = [event_line(event) for event in kept]
    if run["steps_done"] and len(kept) < len(events):
        lines.insert(
            0,
            f"Run {run['id']} {run['status']}, {run['steps_done']}/{run['total_steps']} steps done before"
            f" this watch; its warnings, evaluations and latest phase ({len(events) - len(kept)} other"
            f" events: GET /api/v1/runs/{run['id']}/events/):",
        )
    return lines


def print_run_evaluations(client: Client, run_id: int) -> None:
    """The run's validation evaluations (at its first and last step, and every ``eval_interval``),
    one line each. They are the run's result, but not its outcome: one that cannot be read is said
    on stderr and the exit code stays the run's."""
    try:
        evaluations, _ = read_list(client, f"runs/{run_id}/evaluations/", after=None)
    except CliError as exc:
        print(f"artweb: cannot read run {run_id}'s evaluations: {exc}", file=sys.stderr)
        return
    if not evaluations:
        print(f"No evaluations recorded for run {run_id} (none when its task set has no validation rows)")
    for evaluation in evaluations:
        print(evaluation_line(evaluation), flush=True)


def evaluation_line(evaluation: dict[str, Any]) -> str:
    results = evaluation.get("results") or {}
    head = f"Evaluation {evaluation['id']} at step {evaluation['step']} ({evaluation['split']}"
    if evaluation["status"] != "succeeded":
        return f"{head}): {evaluation['status']} {evaluation.get('error') or ''}".rstrip()
    text = (
        f"{head}, n={results.get('n')}): reward_mean {_short(results.get('reward_mean'))}, pass_rate"
        f" {_short(results.get('pass_rate'))} (reward >= {_short(evaluation['pass_threshold'])})"
    )
    baseline = results.get("comparison_to_baseline") or {}
    if baseline.get("win_rate") is not None:
        text += f", win rate vs step {results.get('baseline_step')} {_short(baseline['win_rate'])}"
    return text


def read_list(client: Client, path: str, *, after: int | None) -> tuple[list[dict[str, Any]], int | None]:
    """Every item of an API list after the id ``after``, page by page, and the last id seen."""
    items: list[dict[str, Any]] = []
    while True:
        page = client.request("GET", path, after=after, limit=1000)
        items += page["data"]
        after = page["last_id"] or after
        if not page["has_more"]:
            return items, after


def say(bar: Any, line: str) -> None:
    """A line on stdout above the bar, flushed: a CI log shows it now, and a closed pipe stops the
    watch here rather than at exit."""
    bar.write(line, file=sys.stdout)
    sys.stdout.flush()


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
        f"pass_rate {_short(results.get('pass_rate'))} (reward >= {_short(evaluation.get('pass_threshold'))}) "
        f"over {results.get('n')} samples"
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


def cmd_aliases(args: argparse.Namespace) -> int:
    """Model aliases (``project/model:prod``): list, set, canary, promote, rollback; prints the
    alias after the change as JSON (its events say who changed it and when)."""
    client = Client(load_credentials())
    if args.action == "list":
        result = client.request("GET", "aliases/")
    elif args.action == "set":
        body = {"model": args.model, "name": args.name, "checkpoint": args.checkpoint}
        result = client.request("POST", "aliases/", body)
    elif args.action == "canary":
        result = client.request(
            "POST", f"aliases/{args.id}/canary", {"checkpoint": args.checkpoint, "share": args.share}
        )
    else:  # promote, rollback
        result = client.request("POST", f"aliases/{args.id}/{args.action}", {})
    print(json.dumps(result, indent=2))
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


def plain(text: str) -> str:
    """The module docstring's reST as plain text for --help (````name```` is shown as name)."""
    return re.sub(r"``([^`]*)``", r"\1", text)


def build_parser() -> argparse.ArgumentParser:
    paragraphs = (__doc__ or "").split("\n\n")
    parser = argparse.ArgumentParser(
        prog="artweb",
        description=plain(paragraphs[0]),
        epilog=plain("\n\n".join(paragraphs[1:3])),
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the examples keep their lines
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")

    login = commands.add_parser(
        "login",
        help="check an API key and save it with the base URL",
        description="Check a team API key against artweb and save it with the base URL. The key is"
        " --api-key, else $ARTWEB_API_KEY, else read from standard input: its first line when"
        ' piped (echo "$KEY" | artweb login --base-url URL), asked without echo at a terminal.',
    )
    login.add_argument(
        "--base-url",
        "--url",
        help=f"artweb's address (default $ARTWEB_BASE_URL or {DEFAULT_BASE_URL})",
    )
    login.add_argument(
        "--api-key",
        help="a team API key (default $ARTWEB_API_KEY, else standard input; a key on the command"
        " line is visible to other local users in the process list)",
    )
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

    aliases = commands.add_parser(
        "aliases", help="model aliases (project/model:prod): canary, promote, rollback"
    ).add_subparsers(dest="action", required=True, metavar="action")
    aliases.add_parser("list", help="the team's aliases").set_defaults(handler=cmd_aliases)
    alias_set = aliases.add_parser("set", help="create an alias, or move it to a checkpoint")
    alias_set.add_argument("--model", type=int, required=True, help="the trainable model's id")
    alias_set.add_argument("--name", required=True, help="e.g. prod")
    alias_set.add_argument("--checkpoint", type=int, required=True, help="the step it names")
    alias_set.set_defaults(handler=cmd_aliases)
    canary = aliases.add_parser("canary", help="send a share of the alias's conversations to a candidate")
    canary.add_argument("id", type=int)
    canary.add_argument("--checkpoint", type=int, required=True, help="the candidate's step")
    canary.add_argument("--share", type=float, required=True, help="above 0 and at most 1")
    canary.set_defaults(handler=cmd_aliases)
    for verb, text in (("promote", "the candidate becomes the alias's checkpoint"),
                       ("rollback", "drop the candidate, or go back to the checkpoint before")):  # fmt: skip
        parser_ = aliases.add_parser(verb, help=text)
        parser_.add_argument("id", type=int)
        parser_.set_defaults(handler=cmd_aliases)

    checkpoints = commands.add_parser("checkpoints", help="trained checkpoints").add_subparsers(
        dest="action", required=True, metavar="action"
    )
    download = checkpoints.add_parser("download", help="download a checkpoint's adapter (PEFT archive)")
    download.add_argument("id", type=int)
    download.add_argument("-o", "--output", help="file to write (default checkpoint-ID-adapter.tar.gz)")
    download.set_defaults(handler=cmd_checkpoints_download)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return run_command(argv)
        finally:
            # Flushed here, where a closed pipe is caught, rather than by the interpreter at exit,
            # where it is a traceback. argparse's --help and usage errors come through here too.
            sys.stdout.flush()
    except BrokenPipeError:  # `artweb runs get 1 | head`: the reader is gone; stop quietly
        silence_closed_output()
        return EXIT_CLOSED_OUTPUT


def run_command(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except CliError as exc:
        print(f"artweb: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def silence_closed_output() -> None:
    """Point stdout and stderr at /dev/null: what is still buffered for the closed pipe would
    otherwise be flushed at exit and fail there ("Exception ignored ... BrokenPipeError")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, OSError, ValueError):  # no descriptor (a test's capture)
            os.dup2(devnull, stream.fileno())
    os.close(devnull)


def run() -> NoReturn:  # the console script
    sys.exit(main())


if __name__ == "__main__":
    run()
