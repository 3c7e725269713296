"""Every command the README shows runs as written, or, where it needs the GPU host, exists and says
what it needs.

The commands are read from the README itself: every line of its bash blocks, and every inline code
span that starts like a command (`python -m jfa check`), so an edited README is tested as it reads.
A command this file does not know how to check fails with its text: add a rule for it here.

On a CPU machine the runnable ones run for real (`python -m jfa check`, `inspect`, `report` on the
recorded results, `make check`, the Python example); `make lab` and `make test` are expanded with
`make -n` (the browser test starts `make lab` itself, and `make test` is this run); the GPU host's
commands (`make gpu-test`, `make bench`, `head-to-head`, the scripts) must exist, show their help
with every option the README passes, and, run as written, refuse with a message naming what is
missing. Nothing is written into the checkout: outputs go to temporary folders.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
SHELL_BLOCKS = ("bash", "sh", "shell", "console")
COMMAND_PREFIXES = ("python ", "python3 ", "make ", "bash ", "compute-sanitizer ", "pytest ", "pip ")
PLACEHOLDER_JSON = re.compile(r"\b[A-Z][A-Z_]*\.json\b")  # OUT.json: a file the user names
RUN_S = 600  # a kernel compile for `inspect` on a shared 2-core machine
# What a refusal must name: the GPU, CUDA, or the GPU host's bundle.
NEEDS_GPU = re.compile(r"GPU|CUDA|\.gpu-bundle", re.I)
# Command-line tools of the GPU host that a CPU machine does not have.
GPU_TOOLS = ("compute-sanitizer",)


def _has_gpu() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


HAS_GPU = _has_gpu()


# ---- what the README shows -----------------------------------------------------------------------
def _blocks(text: str) -> list[tuple[str, str]]:
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)


def readme_commands() -> list[str]:
    text = README.read_text()
    commands = []
    for lang, body in _blocks(text):
        if lang in SHELL_BLOCKS:
            for line in body.splitlines():
                line = re.sub(r"\s+#.*$", "", line).strip()  # a trailing comment explains the line
                if line and not line.startswith("#"):
                    commands.append(line)
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    commands += [span.strip() for span in re.findall(r"`([^`\n]+)`", prose) if span.startswith(COMMAND_PREFIXES)]
    return list(dict.fromkeys(commands))


def readme_python_blocks() -> list[str]:
    return [body for lang, body in _blocks(README.read_text()) if lang == "python"]


# ---- running ---------------------------------------------------------------------------------------
def _env(**extra) -> dict:
    """This interpreter first on PATH, so `python` in a command is the Python that runs the tests."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def run(command: str, cwd: Path = REPO, timeout: int = RUN_S, **env) -> tuple[int, str]:
    """Run `command` through bash (globs expand as in a terminal); (exit status, stdout + stderr)."""
    done = subprocess.run(["bash", "-c", command], cwd=cwd, env=_env(**env), capture_output=True, text=True,
                          timeout=timeout)
    return done.returncode, done.stdout + done.stderr


def _fill(command: str, tmp: Path) -> str:
    """The command with the files a user would name (OUT.json) in `tmp`."""
    return PLACEHOLDER_JSON.sub(lambda m: str(tmp / m.group(0).lower()), command)


def _options(command: str) -> list[str]:
    return re.findall(r"(?<![\w-])--[a-z][\w-]*", command)


def _results_snapshot() -> dict:
    return {p.relative_to(REPO): p.stat().st_mtime_ns for p in (REPO / "results").rglob("*")}


def _check_help(command: list[str], readme_command: str) -> str:
    """`command --help` succeeds and names every option `readme_command` passes."""
    status, out = run(shlex.join(command + ["--help"]))
    assert status == 0 and "usage" in out.lower(), f"{shlex.join(command)} --help:\n{out[-2000:]}"
    missing = [opt for opt in _options(readme_command) if opt not in out]
    assert not missing, f"the README passes {missing}, which {shlex.join(command)} does not take:\n{out[-2000:]}"
    return out


def _check_script_file(path: Path) -> None:
    assert path.is_file(), f"{path} does not exist"
    if path.suffix == ".sh":
        status, out = run(f"bash -n {shlex.quote(str(path))}")
        assert status == 0, f"{path} does not parse:\n{out}"
        assert "usage" in path.read_text()[:2000].lower(), f"{path} says nowhere how to call it"


def _make_dry_run(args: list[str]) -> str:
    status, out = run(shlex.join(["make", "--no-print-directory", "-n", "-o", ".venv/.installed"] + args))
    assert status == 0, f"make -n {shlex.join(args)}:\n{out}"
    return out


# ---- the rules: how each kind of command is checked ------------------------------------------------
def check_make(command: str, tmp: Path) -> None:
    args = shlex.split(command)[1:]
    target = next(a for a in args if "=" not in a)
    variables = [a.split("=", 1)[1] for a in args if "=" in a]
    if target == "lab":  # the browser test runs it; here: what it runs
        out = _make_dry_run(args)
        assert "-m jupyter lab" in out and f'--ServerApp.root_dir="{REPO}"' in out, out
        assert "notebooks/00_start_here.ipynb" in out, out
        assert all(v in out for v in variables), (variables, out)
    elif target == "test":  # what this run is part of
        out = _make_dry_run(args)
        assert "-m pytest --nbval tests notebooks" in out, out
    elif target == "check":
        status, out = run(shlex.join(["make", "--no-print-directory", "-o", ".venv/.installed", *args,
                                      f"PY={sys.executable}"]))
        assert status == 0 and "live:" in out, out
    elif target in GPU_HOST_TARGETS:
        out = _make_dry_run(args)
        script = re.search(r"bash (scripts/\S+)", out)
        assert script, f"make {target} runs no script of scripts/:\n{out}"
        _check_script_file(REPO / script.group(1))
    else:
        pytest.fail(f"the README shows `{command}`: say in this test how to check make {target}")


def check_jfa_cli(command: str, tmp: Path) -> None:
    from jfa.workbench.cli import COMMANDS

    words = shlex.split(command)
    sub = words[3] if len(words) > 3 else None
    if sub is None:  # the command line itself, named in prose: it lists its commands
        status, out = run(command + " --help", cwd=tmp)
        assert status == 0 and all(name in out for name in COMMANDS), out
        return
    assert sub in COMMANDS, f"`{command}`: python -m jfa has no command {sub!r} (it has {sorted(COMMANDS)})"
    if sub in GPU_HOST_CLI:
        _check_help(words[:4], command)
    elif sub == "check":
        status, out = run(command, cwd=tmp)
        assert status == 0 and "torch" in out and "live:" in out, out
    elif sub == "inspect":
        if any(w.isupper() for w in words[4:]):  # `inspect MODULE`: left out, the modules are listed
            status, out = run(shlex.join(words[:4]), cwd=tmp)
            assert status == 0 and "jfa.kernels." in out and "tutorials." in out, out
        else:
            status, out = run(command, cwd=tmp)
            assert status == 0 and "registers" in out.lower(), out[-3000:]
    elif sub == "report":
        shutil.copytree(REPO / "results", tmp / "results")  # the recorded runs, written beside, not over
        before = _results_snapshot()
        status, out = run(_fill(command, tmp), cwd=tmp)
        assert status == 0, out[-3000:]
        written = Path(words[words.index("-o") + 1]) if "-o" in words else None
        if written is not None:
            page = tmp / written
            assert page.is_file() and "<html" in page.read_text()[:2000].lower(), f"{page} is no HTML page"
        assert _results_snapshot() == before, "the report was written into the checkout"
    else:
        pytest.fail(f"the README shows `{command}`: say in this test how to check python -m jfa {sub}")


def check_script(command: str, tmp: Path) -> None:
    """`python scripts/X.py ...` and `bash scripts/X.sh`: the GPU host's entry points (README, Layout)."""
    words = shlex.split(command)
    script = next(w for w in words if w.endswith((".py", ".sh")))
    path = (REPO / script).resolve()
    if not path.is_relative_to(REPO) and not path.exists():
        pytest.skip(f"{script} lies outside this checkout (the shared GPU tooling)")
    if path.is_relative_to(REPO):
        _check_script_file(path)
    else:  # the shared GPU tooling: it parses, and builds only where its sources are (not run here)
        status, out = run(f"bash -n {shlex.quote(str(path))}")
        assert status == 0, f"{path} does not parse:\n{out}"
    if path.suffix == ".py":
        _check_help(["python", script], command)


def check_gpu_tool(command: str, tmp: Path) -> None:
    """`compute-sanitizer ... python scripts/X.py ...`: the script it runs, and the tool where present."""
    tool, _, rest = command.partition(" python ")
    assert rest, f"`{command}`: no `python SCRIPT` for the tool to run"
    check_script("python " + rest, tmp)
    if shutil.which(tool.split()[0]):
        status, out = run(f"{tool.split()[0]} --version")
        assert status == 0, out


# Shortcomings of the commands themselves (not of the README), marked strict: fixed, the mark must
# go. Each names the tests it fails: "shown" (help, dry run) and "run" (run as written without a GPU).
KNOWN_DEFECTS: dict = {}


def _param(command: str, test: str):
    reason = next((why for prefix, (tests, why) in KNOWN_DEFECTS.items()
                   if command.startswith(prefix) and test in tests), None)
    return pytest.param(command, id=command, marks=[pytest.mark.xfail(strict=True, reason=reason)] if reason else [])


GPU_HOST_TARGETS = ("gpu-test", "bench")
GPU_HOST_CLI = ("bench", "head-to-head")
RULES = (
    (re.compile(r"make\s+\S.*"), check_make),
    (re.compile(r"python3? -m jfa(\s.*)?"), check_jfa_cli),
    (re.compile(r"(python3?|bash) (\.\./)*scripts/\S+(\s.*)?|bash \.\./\S+\.sh(\s.*)?"), check_script),
    (re.compile(r"(%s)\s.*" % "|".join(GPU_TOOLS)), check_gpu_tool),
)


def _rule(command: str):
    return next((check for pattern, check in RULES if pattern.fullmatch(command)), None)


COMMANDS = readme_commands()


def test_the_readme_shows_commands():
    assert "make lab" in " ".join(COMMANDS) and any(c.startswith("python -m jfa") for c in COMMANDS), COMMANDS


@pytest.mark.parametrize("command", [_param(c, "shown") for c in COMMANDS])
def test_readme_command(command, tmp_path):
    check = _rule(command)
    if check is None:
        pytest.fail(f"the README shows `{command}`, which this test does not know: add a rule for it")
    check(command, tmp_path)


# ---- the GPU host's commands, run as written on a machine without its GPU --------------------------
def _gpu_host_runs() -> list:
    """The README's GPU host commands that can be started here, each as the user types it (a
    subcommand named in prose without its arguments is no command to run)."""
    runs = []
    for command in COMMANDS:
        words = shlex.split(command)
        gpu_host = ((words[0] == "make" and len(words) > 1 and words[1] in GPU_HOST_TARGETS)
                    or (command.startswith(tuple(f"python -m jfa {c}" for c in GPU_HOST_CLI)) and len(words) > 4)
                    or (words[0].startswith("python") and len(words) > 1 and words[1].startswith("scripts/")))
        if gpu_host:
            runs.append(_param(command, "run"))
    return runs


def _checkout_without_bundles(tmp: Path) -> Path:
    """A folder that links every top-level entry of the repository but the bundles carried to the
    GPU host (.gpu-bundle, .fa4-part*): the checkout as a CPU machine has it."""
    tree = tmp / "checkout"
    tree.mkdir()
    for entry in REPO.iterdir():
        if not (entry.name == ".gpu-bundle" or entry.name.startswith(".fa4-part")):
            (tree / entry.name).symlink_to(entry)
    return tree


@pytest.mark.skipif(HAS_GPU, reason="a GPU is here: the GPU host's commands would run for real")
@pytest.mark.parametrize("command", _gpu_host_runs())
def test_gpu_host_command_refuses_without_a_gpu(command, tmp_path):
    words = shlex.split(command)
    before = _results_snapshot()
    if words[0] == "make":  # in a checkout without the GPU host's bundles, whether or not this one has them
        status, out = run(f"{command} RESULTS={tmp_path / 'out'}", cwd=_checkout_without_bundles(tmp_path),
                          OUT=str(tmp_path / "out"), MAX_SECONDS="60")
    else:
        status, out = run(_fill(command, tmp_path), cwd=tmp_path if command.startswith("python -m") else REPO,
                          OUT=str(tmp_path), MAX_SECONDS="60")
    assert status != 0, f"`{command}` exited 0 on a machine without a GPU:\n{out[-3000:]}"
    assert NEEDS_GPU.search(out), f"`{command}` does not say it needs the GPU host:\n{out[-3000:]}"
    assert "Traceback" not in out, f"`{command}` ends in a traceback instead of a message:\n{out[-3000:]}"
    usage_error = re.search(r"error: (argument|unrecognized).*", out)
    assert not usage_error, f"`{command}` passes arguments its tools reject: {usage_error.group(0)}"
    assert _results_snapshot() == before, f"`{command}` wrote into the checkout's results/"


def test_make_bench_passes_bench_gpu_only_suites():
    from jfa.specs import BENCH_SUITES

    if not any(shlex.split(c)[:2] == ["make", "bench"] for c in COMMANDS):
        pytest.skip("the README shows no make bench")
    out = _make_dry_run(["bench"])
    args = shlex.split(re.search(r"bash scripts/bench_gpu\.sh(.*)", out).group(1))
    assert all(a in BENCH_SUITES or a == "--quick" for a in args), args


# ---- the Python example --------------------------------------------------------------------------
@pytest.mark.parametrize("index", range(len(readme_python_blocks())))
def test_readme_python_example_runs_and_warns_at_its_own_line(index, tmp_path):
    """The example runs as a script; without a GPU its fallback warning names the script's line
    that made the call (an entry point, a variant), never a line inside jfa or torch."""
    source = readme_python_blocks()[index]
    script = tmp_path / "readme_example.py"
    script.write_text(source)
    status, out = run(f"python {script.name}", cwd=tmp_path)
    assert status == 0, out[-3000:]
    if not HAS_GPU and "jfa." in source:
        warned = re.findall(r"^(\S+):(\d+): ReferenceFallbackWarning", out, flags=re.M)
        assert warned, f"no fallback warning:\n{out[-2000:]}"
        lines = source.splitlines()
        for filename, line in warned:
            assert Path(filename).name == script.name, f"the warning names {filename}, not the example"
            assert "(" in lines[int(line) - 1], f"line {line} of the example is no call"
