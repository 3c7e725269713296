"""Repository-wide pytest plugin: `pytest --results-json PATH` records every outcome with the environment.

It lives at the root so that any run records the same way: the CPU and GPU tests under tests/ and the
notebooks under nbval (`pytest --nbval notebooks --results-json ...`).
"""


def pytest_addoption(parser):
    parser.addoption("--results-json", default=None,
                     help="write each test's outcome and the environment block to this JSON file")
    parser.addoption("--results-json-append", action="store_true",
                     help="add this run's outcomes to the --results-json file instead of replacing it")


_outcomes: dict[str, dict] = {}


def pytest_runtest_logreport(report):
    entry = _outcomes.setdefault(report.nodeid, {"test": report.nodeid, "outcome": "passed",
                                                  "seconds": 0.0})
    entry["seconds"] += report.duration
    if report.skipped:
        entry["outcome"] = "skipped"
        entry["reason"] = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
    elif report.failed:
        entry["outcome"] = "failed" if report.when == "call" else f"error ({report.when})"
        entry["message"] = str(report.longrepr)[-2000:]


def pytest_collectreport(report):
    """A module that fails to import is an error of the run, recorded like a failed test."""
    if report.failed:
        _outcomes[report.nodeid] = {"test": report.nodeid, "outcome": "error (collect)", "seconds": 0.0,
                                    "message": str(report.longrepr)[-2000:]}


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--results-json")
    if not path or hasattr(session.config, "workerinput"):  # xdist workers: the controller writes it
        return
    import json
    from collections import Counter
    from pathlib import Path

    from jfa.workbench.envinfo import environment

    outcomes, args, status = dict(_outcomes), list(session.config.invocation_params.args), int(exitstatus)
    if session.config.getoption("--results-json-append") and Path(path).exists():
        earlier = json.loads(Path(path).read_text())
        outcomes = {t["test"]: t for t in earlier["tests"]} | outcomes
        args = earlier["args"] + [";"] + args  # the runs' arguments, in order
        status = max(status, earlier["exitstatus"])
    tests = sorted(outcomes.values(), key=lambda t: t["test"])
    doc = {"env": environment(), "args": args, "summary": dict(Counter(t["outcome"] for t in tests)),
           "exitstatus": status, "tests": tests}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1, default=str) + "\n")
