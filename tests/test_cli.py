import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args):
    return subprocess.run([sys.executable, "-m", "deployments.cli.main", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_generate_greedy_matches_in_process_generation():
    from model import load_model, load_tokenizer
    from model.runner import ModelRunner, generate

    out = _run("generate", "--model", "tiny-k3", "--prompt", "def f(x):", "--max-tokens", "12", "--ids", "--ignore-eos")
    assert out.returncode == 0, out.stderr
    ids = list(map(int, out.stdout.split()))
    tok = load_tokenizer("tiny-k3")
    expected = generate(ModelRunner(load_model("tiny-k3"), 1), tok.encode("def f(x):"), 12)
    assert ids == expected and len(ids) == 12
    assert "12 generated" in out.stderr


def test_generate_sampling_is_seeded():
    a = _run("generate", "--model", "tiny-k3", "--prompt", "x", "--max-tokens", "8", "--temperature", "1.0", "--top-p", "0.9", "--seed", "3", "--ids", "--ignore-eos")
    b = _run("generate", "--model", "tiny-k3", "--prompt", "x", "--max-tokens", "8", "--temperature", "1.0", "--top-p", "0.9", "--seed", "3", "--ids", "--ignore-eos")
    assert a.returncode == 0 and a.stdout == b.stdout


def test_generate_bad_arguments_exit_2_with_message():
    out = _run("generate", "--model", "nope", "--prompt", "x")
    assert out.returncode == 2 and "'nope'" in out.stderr
    out = _run("generate", "--model", "tiny-k3", "--prompt", "x", "--max-tokens", "0")
    assert out.returncode == 2 and "--max-tokens" in out.stderr
    out = _run("generate", "--model", "tiny-k3", "--prompt", "x", "--temperature", "-1")
    assert out.returncode == 2 and "temperature" in out.stderr


def test_the_command_line_s_parsers_do_not_import_torch():
    """The whole parser (``--help``, an unknown command) must not pay torch's and the model's import (seconds on a
    busy machine); a named command's parser imports that command's module and no other's."""
    code = ("import sys; from deployments.cli.main import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'model', 'ray', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
    code = ("import sys; from deployments.cli.main import COMMANDS, build_parser; "
            "args = build_parser('ops').parse_args(['ops', 'status']); "
            "print(args.command, sorted(m for m, _ in COMMANDS.values() if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ops", "['deployments.cli.ops']"], out.stdout


def test_ops_bad_counts_and_budgets_exit_2_before_any_platform_is_reached():
    """A count or budget out of range is the operator's typo, not a platform problem: argparse refuses it (exit 2,
    the value named) without looking for a cluster (here there is none to find)."""
    for args, want in ((("scale", "decode-standard", "0"), "replica count must be an integer >= 1, got '0'"),
                       (("scale", "decode-standard", "-1"), "replica count must be an integer >= 1, got '-1'"),
                       (("scale", "decode-standard", "1.5"), "replica count must be an integer >= 1, got '1.5'"),
                       (("budget", "-2"), "budget must be a number > 0, got '-2'"),
                       (("budget", "inf"), "budget must be a number > 0, got 'inf'"),
                       (("budget", "nan"), "budget must be a number > 0, got 'nan'")):
        out = _run("ops", *args, "--address", "127.0.0.1:1")
        assert out.returncode == 2 and want in out.stderr, (args, out.returncode, out.stderr[-500:])
        assert "cannot reach the platform" not in out.stderr, args


def test_an_output_path_that_cannot_be_written_is_refused_before_the_work(tmp_path):
    """A profile (tens of seconds), a simulation or a render that could not write its result says so at once (exit 2,
    the path named) instead of ending its work in a traceback."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for args in (("autoscale", "profile", "--out", str(blocker / "profile.json")),
                 ("autoscale", "profile", "--out", str(tmp_path)),
                 ("autoscale", "simulate", "--trace", f"standard={blocker}", "--out", str(blocker / "sim")),
                 ("k8s", "render", "--out", str(blocker / "k8s"))):
        out = _run(*args)
        assert out.returncode == 2 and "cannot write" in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)
        assert str(tmp_path) in out.stderr, (args, out.stderr)


def test_commands_that_need_the_platform_say_how_to_point_them_at_it(tmp_path):
    """No cluster where they look (an empty temporary directory, no RAY_ADDRESS): exit 1 with what to do, the same
    hint whichever command it is, not Ray's bare error."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": str(tmp_path)}
    for args, what in ((("ops", "status"), "cannot reach the platform"),
                       (("cache", "stats"), "cannot reach the platform's cache-admin deployment"),
                       (("usage",), "cannot reach the platform's ingress deployment")):
        out = subprocess.run([sys.executable, "-m", "deployments.cli.main", *args], cwd=ROOT, capture_output=True,
                             text=True, timeout=120, env=env)
        assert out.returncode == 1 and what in out.stderr and "Is `deltaserve up` running" in out.stderr, (args, out.stderr)
